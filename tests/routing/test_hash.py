"""Balanced hash routing (Roller et al. 2106.04426)."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.routing.hashing import hash_experts, select_hash
from moejax.routing.router import init_router_params, route
from tests.routing.util import PROPS, make_cfg

# Pinned table (seed 0, E=4, K=2, ids 0..11). Checkpoints trained with hash
# routing depend on it, so a change here is a breaking change, not a refactor.
GOLDEN = [[0, 2], [2, 1], [1, 3], [3, 0], [2, 0], [0, 3], [3, 1], [1, 2],
          [3, 1], [1, 0], [0, 2], [2, 3]]


def test_table_is_pinned():
  np.testing.assert_array_equal(hash_experts(jnp.arange(12), 4, 2, 0), GOLDEN)


def test_hand_structure_of_the_table():
  table = np.asarray(hash_experts(jnp.arange(12), 4, 2, 0))
  for block in range(3):
    rows = table[4 * block: 4 * block + 4]
    # Slot 0 over a block of E ids is a permutation of the E experts ...
    assert sorted(rows[:, 0]) == [0, 1, 2, 3]
    # ... and slot 1 is the next position of the same permutation.
    np.testing.assert_array_equal(rows[:, 1], np.roll(rows[:, 0], -1))


def test_route_weights_probs_logits():
  cfg = make_cfg(num_experts=4, kind="hash", top_k=2, routed_scaling_factor=1.0)
  assert init_router_params(None, 8, cfg) == {}
  ids = jnp.array([0, 5, 5, 11])
  r = route({}, jnp.zeros((4, 8)), None, cfg, token_ids=ids)
  np.testing.assert_array_equal(r.expert_ids, [GOLDEN[0], GOLDEN[5], GOLDEN[5], GOLDEN[11]])
  np.testing.assert_allclose(r.weights, 0.5)
  assert r.valid.all()
  want = np.zeros((4, 4))
  for t, row in enumerate(r.expert_ids):
    want[t, np.asarray(row)] = 0.5
  np.testing.assert_allclose(r.probs, want)
  np.testing.assert_array_equal(r.logits, 0.0)
  r1 = select_hash(ids, make_cfg(num_experts=4, kind="hash", top_k=1))
  np.testing.assert_allclose(r1.weights, 1.0)


def test_missing_token_ids_is_a_clear_error():
  cfg = make_cfg(num_experts=4, kind="hash", top_k=1)
  with pytest.raises(ValueError, match="token_ids"):
    route({}, jnp.zeros((3, 8)), None, cfg)
  with pytest.raises(ValueError, match="shape"):
    route({}, jnp.zeros((3, 8)), None, cfg, token_ids=jnp.arange(4))
  with pytest.raises(ValueError, match="integer"):
    route({}, jnp.zeros((3, 8)), None, cfg, token_ids=jnp.zeros(3))


def test_top_k_above_experts_is_a_clear_error():
  with pytest.raises(ValueError, match="top_k=5"):
    hash_experts(jnp.arange(3), 4, 5, 0)


def test_seed_changes_the_table():
  a = hash_experts(jnp.arange(256), 8, 1, 0)
  b = hash_experts(jnp.arange(256), 8, 1, 1)
  assert not np.array_equal(a, b)
  np.testing.assert_array_equal(a, hash_experts(jnp.arange(256), 8, 1, 0))


@PROPS
@hypothesis.given(vocab=st.integers(1, 300), e=st.sampled_from([2, 3, 4, 8]),
                  k=st.integers(1, 3), seed=st.integers(0, 1000))
def test_balanced_buckets_and_distinct_experts(vocab, e, k, seed):
  k = min(k, e)
  # A token's experts depend on its id only, so the table of vocabulary V is
  # the first V rows of one fixed-shape table (one compiled shape).
  table = np.asarray(hash_experts(jnp.arange(300), e, k, seed))[:vocab]
  assert table.shape == (vocab, k) and table.min() >= 0 and table.max() < e
  for j in range(k):
    counts = np.bincount(table[:, j], minlength=e)
    assert counts.max() - counts.min() <= 1
    if vocab % e == 0:
      assert (counts == vocab // e).all()
  assert all(len(set(row)) == k for row in table)
