"""Score functions, router probabilities and gating conventions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.routing.gating import gate_weights
from moejax.routing.scores import probs_from_scores, scores


def test_score_functions_hand_values():
  z = jnp.array([[0.0, math.log(3.0)]])
  np.testing.assert_allclose(scores(z, "softmax"), [[0.25, 0.75]], rtol=1e-6)
  np.testing.assert_allclose(scores(z, "sigmoid"), [[0.5, 0.75]], rtol=1e-6)
  # DeepSeek-V4: sqrt(softplus(z)); softplus(0) = log 2, softplus(log 3) = log 4.
  np.testing.assert_allclose(scores(z, "sqrtsoftplus"),
                             [[math.sqrt(math.log(2)), math.sqrt(math.log(4))]], rtol=1e-6)


@pytest.mark.parametrize("score_fn,expected", [
    ("softmax", [[0.25, 0.75]]),
    ("sigmoid", [[0.4, 0.6]]),  # [0.5, 0.75] / 1.25
    ("sqrtsoftplus", [[1 / (1 + math.sqrt(2)), math.sqrt(2) / (1 + math.sqrt(2))]]),
])
def test_probs_sum_to_one(score_fn, expected):
  z = jnp.array([[0.0, math.log(3.0)]])
  p = probs_from_scores(scores(z, score_fn), score_fn)
  np.testing.assert_allclose(p, expected, rtol=1e-6)


def test_gate_conventions_hand_values():
  s = jnp.array([[0.1, 0.4, 0.3, 0.2]])
  logits = jnp.log(s)
  ids = jnp.array([[1, 2]])
  valid = jnp.array([[True, True]])
  np.testing.assert_allclose(gate_weights(s, logits, ids, valid, "scores", 1.0), [[0.4, 0.3]],
                             rtol=1e-6)
  np.testing.assert_allclose(gate_weights(s, logits, ids, valid, "normalized", 1.0),
                             [[4 / 7, 3 / 7]], rtol=1e-6)
  np.testing.assert_allclose(gate_weights(s, logits, ids, valid, "topk_softmax", 1.0),
                             [[4 / 7, 3 / 7]], rtol=1e-6)
  np.testing.assert_allclose(gate_weights(s, logits, ids, valid, "normalized", 2.5),
                             [[10 / 7, 7.5 / 7]], rtol=1e-6)


def test_invalid_slots_get_exactly_zero():
  s = jnp.array([[0.1, 0.4, 0.3, 0.2]])
  ids, valid = jnp.array([[1, 2]]), jnp.array([[True, False]])
  for gating in ("scores", "normalized", "topk_softmax"):
    g = gate_weights(s, jnp.log(s), ids, valid, gating, 1.0)
    assert g[0, 1] == 0.0
  np.testing.assert_allclose(gate_weights(s, jnp.log(s), ids, valid, "normalized", 1.0),
                             [[1.0, 0.0]])


def test_no_valid_slot_is_finite_and_zero():
  s = jnp.array([[0.5, 0.5]])
  ids, valid = jnp.array([[0, 1]]), jnp.array([[False, False]])
  for gating in ("scores", "normalized", "topk_softmax"):
    g = gate_weights(s, jnp.log(s), ids, valid, gating, 1.0)
    np.testing.assert_array_equal(g, [[0.0, 0.0]])
    grad = jax.grad(lambda z: gate_weights(jax.nn.softmax(z), z, ids, valid, gating, 1.0).sum())(
        jnp.zeros((1, 2)))
    assert np.all(np.isfinite(grad))
