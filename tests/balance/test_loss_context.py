"""Balance losses that read the routing context: the whole batch's statistics, exactly.

A registered loss whose function has a ``context`` parameter gets the layer's
RoutingContext; the others are called as before. A batch split over a named
axis is simulated with ``jax.vmap(..., axis_name=...)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import balance
from moejax import layer as L
from moejax.balance.losses import balance_losses
from moejax.config.registry import BALANCE_LOSSES
from moejax.routing.types import RoutingContext, make_result
from tests.configs import moe_config

SEEN = []


def kl_to_uniform(result, cfg, *, batch_shape, axis_names, context):
  """KL(mean_batch p || uniform) = sum_e pbar_e log(E pbar_e), pbar over the whole batch."""
  SEEN.append(context)
  pbar = context.mean(result.probs)
  return jnp.sum(jnp.where(pbar > 0, pbar * jnp.log(pbar.shape[-1] * pbar), 0.0))


def local_kl_to_uniform(result, cfg, *, batch_shape, axis_names):
  """The same on this call's tokens only (a loss written without the context)."""
  pbar = jnp.mean(result.probs, axis=0)
  return jnp.sum(jnp.where(pbar > 0, pbar * jnp.log(pbar.shape[-1] * pbar), 0.0))


@pytest.fixture(scope="module")
def losses():
  balance.register_loss("ctx_kl")(kl_to_uniform)
  balance.register_loss("ctx_kl_local")(local_kl_to_uniform)
  yield
  for name in ("ctx_kl", "ctx_kl_local"):
    BALANCE_LOSSES.unregister(name)


def _cfg():
  return moe_config(num_experts=2, expert_width=4, routing=dict(top_k=1),
                    balance=dict(extra_losses=(("ctx_kl", 1.0), ("ctx_kl_local", 2.0))))


def _result(probs):
  p = jnp.asarray(probs, jnp.float32)
  ids = jnp.argmax(p, -1)[:, None]
  return make_result(ids, jnp.ones_like(ids, jnp.float32), jnp.ones_like(ids, bool), p,
                     jnp.log(p + 1e-9))


def test_one_device_by_hand(losses):
  # pbar = (0.75, 0.25): KL = 0.75 log 1.5 + 0.25 log 0.5.
  out = balance_losses(_result([[0.5, 0.5], [1.0, 0.0]]), _cfg(), batch_shape=(1, 2))
  want = 0.75 * np.log(1.5) + 0.25 * np.log(0.5)
  np.testing.assert_allclose(out["ctx_kl"], want, rtol=1e-6)
  np.testing.assert_allclose(out["ctx_kl_local"], 2 * want, rtol=1e-6)
  assert SEEN[-1] == RoutingContext((), 2, 2, (1, 2), False)


def test_a_split_batch_reads_the_whole_batch(losses):
  # Two shards of one token each: the context's mean is the batch's, a local one is not.
  probs = jnp.asarray([[[0.5, 0.5]], [[1.0, 0.0]]])

  def one(p):
    ctx = RoutingContext.build(1, "shard", batch_shape=(1, 1), train=True)
    return balance_losses(_result(p), _cfg(), batch_shape=(1, 1), context=ctx)

  out = jax.vmap(one, axis_name="shard")(probs)
  want = 0.75 * np.log(1.5) + 0.25 * np.log(0.5)
  np.testing.assert_allclose(out["ctx_kl"], [want, want], rtol=1e-6)
  np.testing.assert_allclose(out["ctx_kl_local"], [0.0, 2 * np.log(2.0)], rtol=1e-6, atol=1e-7)


def test_the_layer_hands_its_context_to_the_loss(losses):
  cfg = _cfg()
  params = L.init_moe_params(jax.random.key(0), 4, cfg)
  x = jax.random.normal(jax.random.key(1), (3, 2, 4))
  SEEN.clear()
  _, aux = L.moe_layer(params, x, None, cfg, train=True)
  assert SEEN == [RoutingContext((), 6, 6, (3, 2), True)]
  np.testing.assert_allclose(aux.losses["ctx_kl_local"], 2 * aux.losses["ctx_kl"], rtol=1e-6)


def test_the_rules_docstring_example_runs_as_written():
  import re
  import textwrap
  from moejax.balance import rules
  block = re.findall(r"::\n\n((?:    .*\n|\n)+)", rules.__doc__)[1]
  assert "context.mean" in block
  try:
    exec(textwrap.dedent(block), {"register_loss": balance.register_loss, "jnp": jnp})  # noqa: S102
    cfg = moe_config(num_experts=2, expert_width=4, routing=dict(top_k=1),
                     balance=dict(extra_losses=(("kl_uniform", 1.0),)))
    out = balance_losses(_result([[0.5, 0.5], [1.0, 0.0]]), cfg, batch_shape=(1, 2))
    np.testing.assert_allclose(out["kl_uniform"], 0.75 * np.log(1.5) + 0.25 * np.log(0.5),
                               rtol=1e-5)
  finally:
    BALANCE_LOSSES.unregister("kl_uniform")
