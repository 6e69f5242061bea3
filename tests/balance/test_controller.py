"""Aux-loss-free bias controller: hand numbers, freezing, no gradient, a closed loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax.balance.controller import update_bias
from moejax.balance.metrics import expert_load, max_vio
from moejax.routing.types import RouterState, RoutingResult


def bc(**kw):
  return C.BalanceConfig(**kw)


def test_sign_rule_hand():
  # mean 2: overloaded expert 0 goes down, idle expert 2 goes up, at-mean ones stay.
  s = update_bias(RouterState.zeros(4), jnp.array([4.0, 2.0, 0.0, 2.0]),
                  bc(bias_update="sign", bias_rate=0.1))
  np.testing.assert_allclose(s.bias, [-0.1, 0.0, 0.1, 0.0], rtol=1e-6)
  assert int(s.step) == 1


def test_proportional_rule_hand():
  # mean 2: (2 - c) / 2 = [-2, 0, 1, 1], times u = 0.1, added to the old bias.
  start = RouterState(bias=jnp.array([0.5, 0.0, 0.0, 0.0]), step=jnp.array(7, jnp.int32))
  s = update_bias(start, jnp.array([6.0, 2.0, 0.0, 0.0]),
                  bc(bias_update="proportional", bias_rate=0.1))
  np.testing.assert_allclose(s.bias, [0.3, 0.0, 0.1, 0.1], rtol=1e-6)
  assert int(s.step) == 8
  idle = update_bias(start, jnp.zeros(4), bc(bias_update="proportional"))
  np.testing.assert_array_equal(idle.bias, start.bias)  # no load: no change, no NaN


def test_none_returns_state_unchanged():
  s = RouterState.zeros(3)
  assert update_bias(s, jnp.array([9.0, 0.0, 0.0]), bc()) is s


def test_freeze_step_stops_updates_but_counts_steps():
  cfg = bc(bias_update="sign", bias_rate=1.0, bias_freeze_step=2)
  s = RouterState.zeros(2)
  load = jnp.array([3.0, 1.0])
  step = jax.jit(update_bias, static_argnums=2)
  biases = []
  for _ in range(4):
    s = step(s, load, cfg)
    biases.append(np.asarray(s.bias).copy())
  np.testing.assert_allclose(biases, [[-1, 1], [-2, 2], [-2, 2], [-2, 2]])
  assert int(s.step) == 4


def test_no_gradient_reaches_load_or_bias():
  cfg = bc(bias_update="proportional", bias_rate=0.1)
  def f(load, bias):
    return jnp.sum(update_bias(RouterState(bias=bias, step=jnp.zeros((), jnp.int32)),
                               load, cfg).bias ** 2)
  g_load, g_bias = jax.grad(f, argnums=(0, 1))(jnp.array([3.0, 1.0]), jnp.array([1.0, 2.0]))
  np.testing.assert_array_equal(g_load, 0.0)
  np.testing.assert_array_equal(g_bias, 0.0)


def test_shape_mismatch_names_the_fix():
  with pytest.raises(ValueError, match="num_experts=cfg.num_routed"):
    update_bias(RouterState.zeros(4), jnp.ones(3), bc(bias_update="sign"))


@pytest.mark.parametrize("rule, rate", [("sign", 2e-3), ("proportional", 4e-3)])
def test_closed_loop_balances_a_skewed_sigmoid_router(rule, rate):
  """Wang et al.'s loop: select top-K on sigmoid(score) + bias, update from the load."""
  t, e, k, steps = 512, 8, 2, 600
  pref = jnp.linspace(2.0, -2.0, e)  # expert 0 strongly preferred by every token
  cfg = bc(bias_update=rule, bias_rate=rate)

  def batch(key, bias):
    logits = pref + 0.5 * jax.random.normal(key, (t, e))
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(scores + bias, k)  # the bias changes selection only
    probs = scores / scores.sum(-1, keepdims=True)
    gates = jnp.take_along_axis(probs, ids, -1)
    r = RoutingResult(expert_ids=ids.astype(jnp.int32), weights=gates / gates.sum(-1, keepdims=True),
                      valid=jnp.ones((t, k), bool), probs=probs, logits=logits)
    return expert_load(r, e)

  def body(state, key):
    load = batch(key, state.bias)
    return update_bias(state, load, cfg), max_vio(load)

  keys = jax.random.split(jax.random.key(0), steps)
  final, vios = jax.jit(lambda s, ks: jax.lax.scan(body, s, ks))(RouterState.zeros(e), keys)
  vios = np.asarray(vios)
  initial, late = vios[0], vios[-50:].mean()
  assert initial > 1.0  # expert 0 first takes nearly every token: MaxVio near 3
  assert late < 0.25 * initial, (rule, initial, late)
  assert np.asarray(final.bias)[0] < np.asarray(final.bias)[-1]  # favourite pushed down
