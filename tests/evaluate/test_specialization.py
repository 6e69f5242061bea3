"""Joint expert/domain counts and their mutual information, by hand."""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

from moejax.evaluate.specialization import joint_counts, mutual_information


def test_joint_counts_by_hand():
  # B=1, S=3, K=2; position 2 is padding (mask False), slot (1, 1) invalid.
  ids = jnp.array([[[0, 1], [2, 0], [1, 2]]], jnp.int32)
  valid = jnp.array([[[True, True], [True, False], [True, True]]])
  labels = jnp.array([[0, 1, 1]], jnp.int32)
  mask = jnp.array([[True, True, False]])
  counts = joint_counts(ids, valid, labels, mask, num_experts=3, num_domains=2)
  np.testing.assert_array_equal(counts, [[1, 0], [1, 0], [0, 1]])


def test_mutual_information_extremes():
  # Independent: every expert sees the same domain mix.
  assert mutual_information([[2, 6], [1, 3]]) == (0.0, 0.0)
  # The expert determines the domain: I = H(domain) = log 2, normalised 1.
  mi, norm = mutual_information([[5, 0], [0, 5]])
  assert math.isclose(mi, math.log(2)) and math.isclose(norm, 1.0)
  # Hand case: p = [[.5, 0], [.25, .25]]; I = H(D) - H(D|E) = H(.75) - .5 log 2.
  mi, _ = mutual_information([[2, 0], [1, 1]])
  h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
  assert math.isclose(mi, h - 0.5 * math.log(2))
  assert mutual_information(np.zeros((3, 2))) == (0.0, 0.0)
  assert mutual_information([[3], [4]]) == (0.0, 0.0)  # one domain: nothing to explain


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3),
                           min_size=1, max_size=5))
def test_mutual_information_is_bounded_by_both_entropies(rows):
  n = np.asarray(rows, float)
  mi, norm = mutual_information(n)
  if n.sum() == 0:
    return
  p = n / n.sum()
  ent = lambda q: -sum(x * math.log(x) for x in q if x > 0)
  assert -1e-12 <= mi <= min(ent(p.sum(0)), ent(p.sum(1))) + 1e-9
  assert 0.0 <= norm <= 1.0 + 1e-9
  # Relabelling experts or domains changes nothing.
  assert math.isclose(mutual_information(n[::-1, ::-1])[0], mi, abs_tol=1e-12)
