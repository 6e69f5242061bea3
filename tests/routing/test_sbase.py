"""S-BASE (Clark et al. 2202.01169): Sinkhorn-balanced top-k in training, greedy in eval."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax.routing import ROUTERS
from moejax.routing.router import route
from moejax.routing.sbase import select_sbase, sinkhorn
from moejax.routing.topk import select_topk
from moejax.routing.types import RoutingContext
from tests.routing.util import identity_route_inputs, log_rows, make_cfg, random_logits

# Every token prefers expert 0; tokens 2 and 3 least so (p1 / p0 = 3/7 and 4/6).
PROBS = [[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]]


def _train(t):
  return RoutingContext.build(t, train=True)


def _sinkhorn_np(p, iterations, n_tokens=None):
  """float64 reference of the same iterations on probabilities p [T, E]."""
  c = np.asarray(p, np.float64)
  c = c / c.max(axis=1, keepdims=True)
  n = n_tokens or c.shape[0]
  d1 = np.ones(c.shape[1])
  for _ in range(iterations):
    d0 = 1.0 / (n * (c @ d1))
    d1 = 1.0 / (c.shape[1] * (c * d0[:, None]).sum(0))
  return d0[:, None] * c * d1[None, :]


def test_one_iteration_by_hand():
  # c = p / max p: rows [1, 1/9], [1, 1/4], [1, 3/7], [1, 2/3]; with d1 = 1 the rows
  # become c / (4 rowsum), then each column is scaled to sum 1/2.
  c = np.array([[1, 1 / 9], [1, 1 / 4], [1, 3 / 7], [1, 2 / 3]])
  rows = c / (4 * c.sum(1, keepdims=True))
  want = rows / (2 * rows.sum(0))
  got = sinkhorn(log_rows(PROBS), 1, _train(4))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got.sum(0), [0.5, 0.5], rtol=1e-6)


def test_training_balances_what_greedy_top1_sends_to_one_expert():
  cfg = make_cfg(num_experts=2, kind="sbase", top_k=1, gating="scores")
  logits = log_rows(PROBS)
  greedy = select_topk(logits, None, cfg)
  assert greedy.expert_ids[:, 0].tolist() == [0, 0, 0, 0]
  r = select_sbase(logits, cfg, _train(4))
  # The two tokens that like expert 1 most move there; gates stay their own scores.
  assert r.expert_ids[:, 0].tolist() == [0, 0, 1, 1]
  np.testing.assert_allclose(r.weights[:, 0], [0.9, 0.8, 0.3, 0.4], rtol=1e-6)
  np.testing.assert_allclose(r.probs, PROBS, rtol=1e-6)
  assert bool(r.valid.all())


def test_eval_is_the_greedy_top_k():
  cfg = make_cfg(num_experts=8, kind="sbase", top_k=2)
  logits = random_logits(3, 16, 8)
  got = select_sbase(logits, cfg, RoutingContext.build(16, train=False))
  want = select_topk(logits, None, make_cfg(num_experts=8, top_k=2))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("iterations", [1, 3, 8])
def test_matches_a_float64_reference_and_balances(iterations):
  logits = random_logits(1, 64, 8, scale=2.0) + jnp.arange(8.0)  # skewed towards expert 7
  got = sinkhorn(logits, iterations, _train(64))
  z = np.asarray(logits, np.float64)
  want = _sinkhorn_np(np.exp(z) / np.exp(z).sum(1, keepdims=True), iterations)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)
  cfg = make_cfg(num_experts=8, kind="sbase", top_k=1, iterations=iterations)
  load = np.bincount(np.asarray(select_sbase(logits, cfg, _train(64)).expert_ids[:, 0]),
                     minlength=8)
  greedy = np.bincount(np.asarray(jnp.argmax(logits, -1)), minlength=8)
  # Each expert's balanced mass is exactly T / E = 8 tokens; the top-1 counts follow it
  # within 1.5x once the rows have converged (greedy puts 32 on expert 7).
  assert greedy.max() == 32 and load.max() < greedy.max() / 1.8
  assert iterations < 3 or load.max() <= 12


def test_a_split_batch_decides_on_the_whole_batch():
  """4 shards over a named axis route like the 16 tokens together; alone they would not."""
  cfg = make_cfg(num_experts=4, kind="sbase", top_k=2)
  logits = random_logits(2, 16, 4, scale=1.5) + jnp.asarray([1.5, 0.0, 0.0, -1.0])
  x, w = identity_route_inputs(logits)
  whole = route({"w": w}, x, None, cfg, train=True)
  shards = jax.vmap(lambda xs: route({"w": w}, xs, None, cfg, train=True,
                                     context=RoutingContext.build(4, "shard", train=True)),
                    axis_name="shard")(x.reshape(4, 4, 16))
  np.testing.assert_array_equal(shards.expert_ids.reshape(16, 2), whole.expert_ids)
  np.testing.assert_allclose(shards.weights.reshape(16, 2), whole.weights, rtol=1e-6)
  alone = jax.vmap(lambda xs: route({"w": w}, xs, None, cfg, train=True))(x.reshape(4, 4, 16))
  assert not np.array_equal(alone.expert_ids.reshape(16, 2), whole.expert_ids)


def test_gradients_reach_the_gates_not_the_assignment():
  cfg = make_cfg(num_experts=4, kind="sbase", top_k=2, gating="scores")
  logits = random_logits(4, 8, 4)
  ids = select_sbase(logits, cfg, _train(8)).expert_ids

  def gates(z):
    return jnp.sum(select_sbase(z, cfg, _train(8)).weights * jnp.arange(1.0, 3.0))

  def fixed(z):  # the same gates with the assignment held fixed
    return jnp.sum(jnp.take_along_axis(jax.nn.softmax(z, -1), ids, -1) * jnp.arange(1.0, 3.0))

  np.testing.assert_allclose(jax.grad(gates)(logits), jax.grad(fixed)(logits), rtol=1e-6)


def test_registered_through_the_public_api_with_its_capabilities():
  spec = ROUTERS.get("sbase")
  assert type(spec).__module__ == "moejax.routing.sbase" and "sbase" not in ROUTERS.plugins()
  assert spec.batch_wide and spec.reads_context and spec.expert_parallel and spec.causal
  assert spec.token_choice and not spec.supports_bias
  assert make_cfg(kind="sbase").routing.opts.iterations == 8
  with pytest.raises(C.ConfigError, match=r"^moe\.routing\.options\.iterations=0: "):
    make_cfg(kind="sbase", iterations=0)
