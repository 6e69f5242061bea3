"""ReMoE (Wang, Zhu and Chen 2412.14711): ReLU gates, the adaptive L1 penalty and its state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import layer as layer_lib
from moejax.config import ConfigError
from moejax.routing import state as state_lib
from moejax.routing.remoe import select_relu
from moejax.routing.router import route
from moejax.routing.types import RouterState, RoutingContext
from tests.configs import moe_config

L1 = (("remoe_l1", 1.0),)


def _cfg(top_k=2, num_experts=4, **options):
  return moe_config(num_experts=num_experts,
                    routing=dict(kind="remoe", top_k=top_k, options=options or None),
                    balance=dict(extra_losses=L1))


def test_gates_are_the_relu_and_a_token_uses_the_positive_ones():
  cfg = _cfg()
  logits = jnp.asarray([[1.0, -1.0, 0.5, -0.2], [-1.0, -2.0, -0.1, -3.0]], jnp.float32)
  r = select_relu(logits, cfg)
  np.testing.assert_array_equal(r.valid, [[True, False, True, False], [False] * 4])
  np.testing.assert_array_equal(r.combine_weights(), [[1.0, 0.0, 0.5, 0.0], [0.0] * 4])
  np.testing.assert_allclose(r.probs, jax.nn.softmax(logits), rtol=1e-6)
  assert cfg.router.slots(cfg) == (2.0, 4.0)  # declared: the target k, every expert at most


def test_observations_are_sums_over_the_batch_and_the_update_is_multiplicative():
  cfg = _cfg(top_k=2, l1_init=0.5, alpha=2.0)
  state = layer_lib.init_router_state(cfg)
  assert float(state.ideas["remoe"]["coef"]) == 0.5
  # 3 + 1 active experts over 2 tokens: 2 per token, the target: lambda stays.
  logits = jnp.asarray([[1.0, 2.0, 3.0, -1.0], [-1.0, -1.0, 0.5, -1.0]], jnp.float32)
  seen = state_lib.observe(select_relu(logits, cfg), cfg, state.ideas,
                           RoutingContext.build(2, train=True))
  assert {k: float(v) for k, v in seen["remoe"].items()} == {"active": 4.0, "tokens": 2.0}
  coefs, ideas = [], state.ideas
  # Per token: 2 (= k), 3 (> k: x2), 3 (x2), 1 (< k: /2), and a step with no token.
  for active, tokens in ((4.0, 2.0), (6.0, 2.0), (9.0, 3.0), (2.0, 2.0), (0.0, 0.0)):
    ideas = state_lib.update(cfg, ideas, {"remoe": {"active": jnp.float32(active),
                                                    "tokens": jnp.float32(tokens)}})
    coefs.append(float(ideas["remoe"]["coef"]))
  assert coefs == [0.5, 1.0, 2.0, 1.0, 1.0]
  assert ideas["remoe"]["coef"].dtype == jnp.float32


def test_l1_penalty_reads_lambda_from_the_state_plain_and_balanced():
  logits = jnp.asarray([[1.0, 2.0, -3.0, -1.0], [-1.0, 0.5, 0.5, -1.0]], jnp.float32)
  x, w = jnp.eye(2, dtype=jnp.float32), logits
  for balanced, want in ((False, 0.25 * (3.0 + 1.0) / 2),
                         # active share per expert: [1, 2, 1, 0] / 2 tokens, x E / k = 2
                         (True, 0.25 * ((1 * 1 + 2 * 2) + (2 * 0.5 + 1 * 0.5)) / 2)):
    cfg = _cfg(l1_init=0.25, balanced=balanced)
    state = layer_lib.init_router_state(cfg)
    r = route({"w": w}, x, state, cfg)
    from moejax.balance.losses import balance_losses  # pylint: disable=g-import-not-at-top
    out = balance_losses(r, cfg, batch_shape=(1, 2), state=state.ideas)
    np.testing.assert_allclose(out["remoe_l1"], want, rtol=1e-6)


def test_the_penalty_is_required_and_zero_computation_experts_refused():
  with pytest.raises(ConfigError, match=r"moe.balance.extra_losses=\(\): .*add \('remoe_l1', "
                                        r"1.0\)"):
    moe_config(num_experts=4, routing=dict(kind="remoe"))
  with pytest.raises(ConfigError, match="moe.topology.zero_experts=1"):
    moe_config(num_experts=4, zero_experts=1, routing=dict(kind="remoe"),
               balance=dict(extra_losses=L1))
  with pytest.raises(ConfigError, match="moe.routing.score_fn='sigmoid': ReMoE's gates"):
    moe_config(num_experts=4, routing=dict(kind="remoe", score_fn="sigmoid"),
               balance=dict(extra_losses=L1))
  with pytest.raises(ConfigError, match="moe.routing.options.alpha=1.0"):
    _cfg(alpha=1.0)


def test_the_penalty_without_remoe_is_one_line():
  cfg = moe_config(num_experts=4, balance=dict(extra_losses=L1))
  x = jnp.eye(4, dtype=jnp.float32)
  params = layer_lib.init_moe_params(jax.random.key(0), 4, cfg)
  with pytest.raises(ValueError, match="reads the state of routing.kind='remoe', but the "
                                       "router is 'topk'"):
    layer_lib.moe_layer(params, x, None, cfg)


def test_the_layer_observes_and_logs_through_its_aux():
  cfg = _cfg()
  params = layer_lib.init_moe_params(jax.random.key(0), 8, cfg)
  x = jax.random.normal(jax.random.key(1), (2, 3, 8))
  state = layer_lib.init_router_state(cfg)
  assert isinstance(state, RouterState) and set(state.ideas) == {"remoe"}
  _, aux = layer_lib.moe_layer(params, x, state, cfg, train=True)
  active = float(jnp.sum(aux.routing.valid))  # every slot kept: no capacity
  assert float(aux.observed["remoe"]["active"]) == active
  np.testing.assert_allclose(float(aux.metrics.active_mean), active / 6, rtol=1e-6)
  assert float(aux.observed["remoe"]["tokens"]) == 6.0
  assert float(aux.losses["remoe_l1"]) > 0.0
