"""The reference MoE layer against naive per-token computations.

Legend: T tokens, d width, E experts, K slots.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax import layer as L
from moejax.topology import experts as experts_lib

D = 8

# Eager op-by-op dispatch is slow; the layer is jit-compatible with a static cfg.
moe_layer = jax.jit(L.moe_layer, static_argnames=("cfg", "train", "axis_names"))


def make(**kw):
  router = kw.pop("router", {})
  balance = kw.pop("balance", {})
  base = dict(num_experts=4, expert_width=6)
  base.update(kw)
  return C.from_dict(C.MoEConfig, {**base, "router": router, "balance": balance})


def naive(params, x, result, cfg):
  """sum_k w[t,k] FFN_{e[t,k]}(x_t), one token and one slot at a time.

  Each expert's FFN is evaluated once on all tokens (E calls, not T*K) and
  the per-token combination is done by explicit loops over the result.
  """
  outs = [np.asarray(experts_lib.expert_ffn(jax.tree.map(lambda a: a[e], params["experts"]),
                                            x, cfg.activation), np.float64)
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
    "mixtral": dict(router=dict(top_k=2, gating="topk_softmax")),
    "switch": dict(router=dict(top_k=1, gating="scores")),
    "qwen_unnormalized": dict(router=dict(top_k=2, gating="scores")),
    "deepseek_v3": dict(num_experts=8, router=dict(top_k=2, score_fn="sigmoid", use_bias=True,
                                                   n_groups=4, topk_groups=2,
                                                   routed_scaling_factor=2.5)),
    "sqrtsoftplus": dict(router=dict(top_k=2, score_fn="sqrtsoftplus")),
    "expert_choice": dict(router=dict(kind="expert_choice", expert_choice_capacity=2.0)),
    "hash": dict(router=dict(kind="hash", top_k=1)),
    "top_p": dict(router=dict(kind="top_p", top_k=3, top_p=0.5)),
    "hierarchical": dict(num_experts=8, router=dict(kind="hierarchical", n_families=2,
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
  y, _, aux = moe_layer(params, x, None, cfg, token_ids=ids)
  assert y.shape == x.shape
  expect = naive(params, x.reshape(-1, D), aux["routing"], cfg)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), expect, rtol=2e-5, atol=2e-5)
  assert np.isfinite(float(aux["losses"]["total"]))


def test_shared_and_zero_compute_experts_add_their_paths():
  cfg = make(num_shared_experts=1, zero_experts=1, copy_experts=1, constant_experts=1,
             router=dict(top_k=3))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (6, D))
  y, _, aux = moe_layer(params, x, None, cfg)
  from moejax.topology import zero_compute
  res = aux["routing"]
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
  dropless = make(router=dict(top_k=2))
  big = make(router=dict(top_k=2), capacity_factor=float(dropless.num_experts))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, dropless)
  y0, _, a0 = moe_layer(params, x, None, dropless)
  y1, _, a1 = moe_layer(params, x, None, big)
  np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))
  assert int(a1["num_dropped"]) == 0


def test_small_capacity_drops_and_dropped_tokens_pass_through_as_zero():
  cfg = make(router=dict(top_k=1, gating="scores"), capacity_factor=0.5)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (16, D))
  y, _, aux = moe_layer(params, x, None, cfg)
  res = aux["routing"]
  cap = 2  # ceil(0.5 * 16 * 1 / 4)
  load = np.asarray(aux["load"])
  assert load.max() <= cap
  dropped_tokens = ~np.asarray(res.valid).any(axis=1)
  assert int(aux["num_dropped"]) == dropped_tokens.sum() > 0
  np.testing.assert_array_equal(np.asarray(y)[dropped_tokens], 0.0)


def test_gradients_reach_router_and_experts():
  cfg = make(router=dict(top_k=2), balance=dict(aux_loss_coef=1e-2, z_loss_coef=1e-3))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, D))

  def loss(p):
    y, _, aux = moe_layer(p, x, None, cfg)
    return jnp.sum(y ** 2) + aux["losses"]["total"]

  grads = jax.grad(loss)(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(np.asarray(g))), path
    assert float(jnp.abs(g).sum()) > 0, path


def test_bias_controller_runs_only_in_training_and_never_touches_gates():
  cfg = make(router=dict(top_k=1, score_fn="sigmoid", use_bias=True),
             balance=dict(bias_update="sign", bias_rate=0.1))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (12, D))
  state = L.init_router_state(cfg)
  _, s_eval, _ = moe_layer(params, x, state, cfg, train=False)
  np.testing.assert_array_equal(np.asarray(s_eval.bias), 0.0)
  _, s_train, aux = moe_layer(params, x, state, cfg, train=True)
  load = np.asarray(aux["load"])
  expect = 0.1 * np.sign(load.mean() - load)
  np.testing.assert_allclose(np.asarray(s_train.bias), expect, atol=1e-7)
  assert int(s_train.step) == 1


def test_soft_moe_layer_matches_naive_slots():
  cfg = make(kind="soft", slots_per_expert=2)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, D))
  y, _, _ = moe_layer(params, x, None, cfg)
  from moejax.routing import soft
  for b in range(2):
    disp, comb, _ = soft.soft_weights(params["router"], x[b], cfg)
    slots = np.asarray(disp).T @ np.asarray(x[b])  # [P, d]
    outs = []
    for p in range(slots.shape[0]):
      e = p // cfg.slots_per_expert
      p_e = jax.tree.map(lambda a: a[e], params["experts"])
      outs.append(np.asarray(experts_lib.expert_ffn(p_e, slots[p:p + 1], cfg.activation))[0])
    expect = np.asarray(comb) @ np.stack(outs)
    np.testing.assert_allclose(np.asarray(y[b]), expect, rtol=2e-5, atol=2e-5)


def test_peer_layer_runs_and_is_differentiable():
  cfg = make(kind="peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=4)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, D))
  y, _, _ = moe_layer(params, x, None, cfg)
  assert y.shape == x.shape
  g = jax.grad(lambda p: jnp.sum(moe_layer(p, x, None, cfg)[0] ** 2))(params)
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(g))


def test_bf16_activations_keep_dtype():
  cfg = make(router=dict(top_k=2))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, D)).astype(jnp.bfloat16)
  y, _, aux = moe_layer(params, x, None, cfg)
  assert y.dtype == jnp.bfloat16
  assert aux["routing"].probs.dtype == jnp.float32


def test_bad_shapes_fail_clearly():
  cfg = make(router=dict(kind="hash", top_k=1))
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  with pytest.raises(ValueError, match="token_ids has 3 entries"):
    L.moe_layer(params, jnp.zeros((4, D)), None, cfg, token_ids=jnp.zeros((3,), jnp.int32))
