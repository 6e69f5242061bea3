"""The reference MoE layer against naive per-token computations.

Legend: T tokens, d width, E experts, K slots.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import layer as L
from moejax.balance import controller
from moejax.topology import experts as experts_lib
from tests.configs import moe_config

D = 8

# Eager op-by-op dispatch is slow; the layer is jit-compatible with a static cfg.
moe_layer = jax.jit(L.moe_layer, static_argnames=("cfg", "train", "axis_names"))


def make(**kw):
  return moe_config(**{"num_experts": 4, "expert_width": 6, **kw})


def naive(params, x, result, cfg):
  """sum_k w[t,k] FFN_{e[t,k]}(x_t), one token and one slot at a time.

  Each expert's FFN is evaluated once on all tokens (E calls, not T*K) and
  the per-token combination is done by explicit loops over the result.
  """
  outs = [np.asarray(experts_lib.expert_ffn(jax.tree.map(lambda a: a[e], params["experts"]),
                                            x, cfg.topology.activation), np.float64)
          for e in range(cfg.num_experts)]
  ids, w, valid = (np.asarray(a) for a in (result.expert_ids, result.weights, result.valid))
  y = np.zeros(x.shape, np.float64)
  for t in range(x.shape[0]):
    for k in range(ids.shape[1]):
      e = int(ids[t, k])
      if valid[t, k] and e < cfg.num_experts:
        y[t] += w[t, k] * outs[e][t]
  return y


ROUTERS = {
    "mixtral": dict(routing=dict(top_k=2, gating="topk_softmax")),
    "switch": dict(routing=dict(top_k=1, gating="scores")),
    "qwen_unnormalized": dict(routing=dict(top_k=2, gating="scores")),
    "deepseek_v3": dict(num_experts=8, routing=dict(top_k=2, score_fn="sigmoid", use_bias=True,
                                                   n_groups=4, topk_groups=2,
                                                   routed_scaling_factor=2.5)),
    "sqrtsoftplus": dict(routing=dict(top_k=2, score_fn="sqrtsoftplus")),
    "expert_choice": dict(routing=dict(kind="expert_choice", capacity=2.0)),
    "hash": dict(routing=dict(kind="hash", top_k=1)),
    "top_p": dict(routing=dict(kind="top_p", top_k=3, top_p=0.5)),
    "hierarchical": dict(num_experts=8, routing=dict(kind="hierarchical", n_families=2,
                                                    top_k_families=1, top_k=2)),
    "gelu": dict(activation="gelu"),
    "heterogeneous": dict(expert_widths=(2, 6, 4, 6)),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_layer_equals_naive_per_token(name):
  cfg = make(**ROUTERS[name])
  key = jax.random.PRNGKey(0)
  params = L.init_moe_params(key, D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, D))
  ids = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 0, 256)
  y, aux = moe_layer(params, x, None, cfg, token_ids=ids)
  assert y.shape == x.shape
  expect = naive(params, x.reshape(-1, D), aux.routing, cfg)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), expect, rtol=2e-5, atol=2e-5)
  assert np.isfinite(float(aux.losses["total"]))


def test_shared_and_zero_compute_experts_add_their_paths():
  cfg = make(num_shared_experts=1, zero_experts=1, copy_experts=1, constant_experts=1,
             routing=dict(top_k=3))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (6, D))
  y, aux = moe_layer(params, x, None, cfg)
  from moejax.topology import zero_compute
  res = aux.routing
  expect = naive(params, x, res, cfg)
  expect += np.asarray(experts_lib.apply_shared(params["shared"], x))
  z = np.asarray(zero_compute.apply_zero_compute(params["zero_compute"], x, cfg))  # [T, Z, d]
  cw = np.asarray(res.combine_weights())[:, cfg.num_experts:]
  expect += np.einsum("tz,tzd->td", cw, z)
  np.testing.assert_allclose(np.asarray(y), expect, rtol=2e-5, atol=2e-5)
  # The copy expert's contribution is gate * x exactly: pin one token that chose it.
  assert res.expert_ids.shape == (6, 3)


def test_dropless_equals_infinite_capacity():
  x = jax.random.normal(jax.random.PRNGKey(1), (16, D))
  dropless = make(routing=dict(top_k=2))
  big = make(routing=dict(top_k=2), capacity_factor=float(dropless.num_experts))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, dropless)
  y0, a0 = moe_layer(params, x, None, dropless)
  y1, a1 = moe_layer(params, x, None, big)
  np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))
  assert int(a1.num_dropped) == 0


def test_small_capacity_drops_and_dropped_tokens_pass_through_as_zero():
  cfg = make(routing=dict(top_k=1, gating="scores"), capacity_factor=0.5)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (16, D))
  y, aux = moe_layer(params, x, None, cfg)
  res = aux.routing
  cap = 2  # ceil(0.5 * 16 * 1 / 4)
  kept = np.bincount(np.asarray(res.expert_ids)[np.asarray(res.valid)], minlength=4)
  assert kept.max() <= cap
  # aux['load'] is the router's decision before capacity: kept copies plus dropped ones.
  assert np.asarray(aux.load).sum() == kept.sum() + int(aux.num_dropped) == 16
  dropped_tokens = ~np.asarray(res.valid).any(axis=1)
  assert int(aux.num_dropped) == dropped_tokens.sum() > 0
  np.testing.assert_array_equal(np.asarray(y)[dropped_tokens], 0.0)


def test_gradients_reach_router_and_experts():
  cfg = make(routing=dict(top_k=2), balance=dict(aux_loss_coef=1e-2, z_loss_coef=1e-3))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, D))

  def loss(p):
    y, aux = moe_layer(p, x, None, cfg)
    return jnp.sum(y ** 2) + aux.losses["total"]

  grads = jax.grad(loss)(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(np.asarray(g))), path
    assert float(jnp.abs(g).sum()) > 0, path


def test_layer_returns_the_controller_input_and_the_controller_never_touches_gates():
  cfg = make(routing=dict(top_k=1, score_fn="sigmoid", use_bias=True),
             balance=dict(bias_update="sign", bias_rate=0.1))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (12, D))
  state = L.init_router_state(cfg)
  _, aux = moe_layer(params, x, state, cfg, train=True)
  load = np.asarray(aux.router_load)
  assert load.sum() == 12  # one copy per token, before capacity
  new = controller.update_bias(state, aux.router_load, cfg.balance)
  expect = 0.1 * np.sign(load.mean() - load)
  np.testing.assert_allclose(np.asarray(new.bias), expect, atol=1e-7)
  assert int(new.step) == 1
  # The bias moves the selection, never the gate values of what is selected.
  _, aux2 = moe_layer(params, x, new, cfg, train=False)
  r1, r2 = aux.routing, aux2.routing
  same = np.asarray(r1.expert_ids) == np.asarray(r2.expert_ids)
  np.testing.assert_allclose(np.asarray(r1.weights)[same], np.asarray(r2.weights)[same],
                             rtol=1e-6)


def test_soft_moe_layer_matches_naive_slots():
  cfg = make(kind="soft", slots_per_expert=2)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, D))
  y, _ = moe_layer(params, x, None, cfg)
  from moejax.routing import soft
  for b in range(2):
    disp, comb, _ = soft.soft_weights(params["router"], x[b], cfg)
    slots = np.asarray(disp).T @ np.asarray(x[b])  # [P, d]
    outs = []
    for p in range(slots.shape[0]):
      e = p // cfg.layer_options.slots_per_expert
      p_e = jax.tree.map(lambda a: a[e], params["experts"])
      outs.append(np.asarray(experts_lib.expert_ffn(p_e, slots[p:p + 1], cfg.topology.activation))[0])
    expect = np.asarray(comb) @ np.stack(outs)
    np.testing.assert_allclose(np.asarray(y[b]), expect, rtol=2e-5, atol=2e-5)


def test_peer_layer_runs_and_is_differentiable():
  cfg = moe_config("peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=4)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, D))
  y, _ = moe_layer(params, x, None, cfg)
  assert y.shape == x.shape
  g = jax.grad(lambda p: jnp.sum(moe_layer(p, x, None, cfg)[0] ** 2))(params)
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(g))


def test_bf16_activations_keep_dtype():
  cfg = make(routing=dict(top_k=2))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, D)).astype(jnp.bfloat16)
  y, aux = moe_layer(params, x, None, cfg)
  assert y.dtype == jnp.bfloat16
  assert aux.routing.probs.dtype == jnp.float32


def test_bad_shapes_fail_clearly():
  cfg = make(routing=dict(kind="hash", top_k=1))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  with pytest.raises(ValueError, match="token_ids has 3 entries"):
    L.moe_layer(params, jnp.zeros((4, D)), None, cfg, token_ids=jnp.zeros((3,), jnp.int32))


def test_balance_loss_counts_every_choice_before_capacity():
  """Switch eq. 4-5: f_i counts each token's choice before any drop.

  E=8, T=64, cf=1.0 (capacity 8), a router that sends every token to
  expert 0: 56 copies are dropped, and the loss (alpha=1) is E * f_0 * P_0 =
  8 * 1 * 1 = 8, not the 1.0 of perfect balance that the 8 surviving copies
  alone would give.
  """
  cfg = make(num_experts=8, capacity_factor=1.0, routing=dict(top_k=1, gating="scores"),
             balance=dict(aux_loss_coef=1.0, aux_loss_convention="switch"))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  params["router"]["w"] = jnp.zeros((D, 8)).at[:, 0].set(100.0)
  x = jnp.abs(jax.random.normal(jax.random.PRNGKey(1), (64, D))) + 0.1
  _, aux = moe_layer(params, x, None, cfg)
  assert int(aux.num_dropped) == 56
  np.testing.assert_allclose(float(aux.losses["aux_loss"]), 8.0, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux.load), [64, 0, 0, 0, 0, 0, 0, 0])
  assert float(aux.metrics.max_vio) == 7.0 and float(aux.metrics.drop_rate) == 56 / 64


def test_soft_and_peer_layers_report_their_metrics():
  soft = moe_config("soft", num_experts=2, expert_width=6, slots_per_expert=2)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, soft)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, D))
  _, aux = moe_layer(params, x, None, soft)
  m = aux.metrics
  # Combine rows sum to 1 per token: the expert loads sum to the token count.
  np.testing.assert_allclose(float(jnp.sum(m.load)), 10.0, rtol=1e-5)
  for key in ("dispatch_entropy", "combine_entropy", "load_entropy"):
    assert 0.0 <= float(getattr(m, key)) <= 1.0 + 1e-6, key
  peer = moe_config("peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=4)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, peer)
  _, aux = moe_layer(params, x, None, peer)
  m = aux.metrics
  # 10 tokens x 2 heads x 2 retrievals over 16 experts.
  assert 0.0 < float(m.experts_touched) <= 1.0
  assert float(m.experts_touched) * 16 <= 40
