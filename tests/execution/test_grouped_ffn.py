"""routed_ffn / routed_experts against a naive per-expert loop, for every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import grouped_ffn as X
from moejax.execution import gmm as gmm_lib
from moejax.execution import tiling
from moejax.routing.types import RoutingResult
from moejax.topology import experts as experts_lib

T, D, E, K, F, Z = 13, 8, 4, 3, 16, 2  # Z zero-computation experts (ids E..E+Z-1)


def _setup(activation, seed=0, dtype=jnp.float32, with_mask=True):
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  x = jax.random.normal(ks[0], (T, D), jnp.float32).astype(dtype)
  logits = jax.random.normal(ks[1], (T, E + Z))
  vals, ids = jax.lax.top_k(logits, K)
  valid = jax.random.uniform(ks[2], (T, K)) > 0.25
  weights = jnp.where(valid, jax.nn.softmax(vals), 0.0)
  result = RoutingResult(expert_ids=ids.astype(jnp.int32), weights=weights, valid=valid,
                         probs=jax.nn.softmax(logits), logits=logits)
  scale = 1.0 / np.sqrt(D)
  params = {"w_up": jax.random.normal(ks[3], (E, D, F)) * scale,
            "w_down": jax.random.normal(ks[4], (E, F, D)) / np.sqrt(F)}
  if activation == "swiglu":
    params["w_gate"] = jax.random.normal(ks[5], (E, D, F)) * scale
  params = experts_lib.fused_layout(jax.tree.map(lambda a: a.astype(dtype), params))
  # Heterogeneous widths 16, 12, 8, 16 zero-padded to F.
  widths = jnp.array([16, 12, 8, 16])
  mask = (jnp.arange(F)[None, :] < widths[:, None]).astype(jnp.float32) if with_mask else None
  return params, x, result, mask


def naive_routed(params, x, result, activation, mask):
  """sum_k w[t,k] FFN_{id}(x_t), every expert on every token, one at a time."""
  y = jnp.zeros(x.shape, jnp.float32)
  params = experts_lib.split_layout(params)
  for e in range(E):
    xe = x.astype(jnp.float32)
    if activation == "swiglu":
      h = jax.nn.silu(xe @ params["w_gate"][e]) * (xe @ params["w_up"][e])
    else:
      h = jax.nn.gelu(xe @ params["w_up"][e])
    if mask is not None:
      h = h * mask[e]
    gate = jnp.sum(jnp.where((result.expert_ids == e) & result.valid, result.weights, 0), 1)
    y = y + gate[:, None] * (h @ params["w_down"][e])
  return y


CONFIGS = {
    "blocked_fused": dict(backend="blocked", tile_m=4),
    "blocked_fused_big_tile": dict(backend="blocked"),
    # Remainder tiles of 3, 6 or 8 rows (one per expert), clamped at the end.
    "blocked_fused_classes": dict(backend="blocked", tile_m=8, tile_small=3),
    # The composed path with the dispatch folded into the matmuls (the default
    # when not fused), and without (permute -> 3 gmm -> unpermute).
    "blocked_unfused": dict(backend="blocked", fused=False, tile_m=4),
    "blocked_permute": dict(backend="blocked", fused=False, fold_permute=False, tile_m=4),
    "ragged_dot": dict(backend="ragged_dot"),
    "pallas_tpu": dict(backend="pallas_tpu", interpret=True, tiling=(8, 128, 128)),
    # One batched matmul per weight over [E, C] slots (a bucket of 4x the
    # balanced group holds every group), and its tiled fallback (a bucket of
    # a quarter of it holds none).
    "whole_group": dict(backend="whole_group", bucket_factors=(4.0,)),
    "whole_group_fallback": dict(backend="whole_group", bucket_factors=(0.25,), tile_m=4),
}


def _loss_fns(activation, mask, ids, valid, cfg):
  def fast(p, x, w):
    r = RoutingResult(expert_ids=ids, weights=w, valid=valid, probs=w, logits=w)
    return X.routed_experts(p, x, r, num_experts=E, activation=activation,
                            width_mask=mask, **cfg)

  def slow(p, x, w):
    r = RoutingResult(expert_ids=ids, weights=w, valid=valid, probs=w, logits=w)
    return naive_routed(p, x, r, activation, mask)

  return fast, slow


# Interpret mode is slow: one activation covers the Pallas kernel path.
PAIRS = [(n, a) for n in CONFIGS for a in ("swiglu", "gelu")
         if not (n == "pallas_tpu" and a == "gelu")]


@pytest.mark.parametrize("name,activation", PAIRS)
def test_matches_naive_loop_outputs_and_grads(name, activation):
  params, x, result, mask = _setup(activation)
  fast, slow = _loss_fns(activation, mask, result.expert_ids, result.valid, CONFIGS[name])
  cot = jax.random.normal(jax.random.PRNGKey(9), (T, D))

  @jax.jit
  def both(p, x, w):
    outs = []
    for fn in (fast, slow):
      y, vjp = jax.vjp(fn, p, x, w)
      outs.append((y,) + vjp(cot.astype(y.dtype)))
    return outs

  (y, gp, gx, gw), (y0, gp0, gx0, gw0) = both(params, x, result.weights)
  np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx, gx0, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gw, gw0, rtol=1e-5, atol=1e-5)
  for key in params:
    np.testing.assert_allclose(gp[key], gp0[key], rtol=1e-5, atol=1e-5, err_msg=key)
  # Zero-computation and invalid slots get no weight gradient from here.
  excluded = ~result.valid | (result.expert_ids >= E)
  assert not np.any(np.asarray(gw)[np.asarray(excluded)])
  # Masked (padded) hidden units of w_down get no gradient.
  assert not np.any(np.asarray(gp["w_down"])[2, 8:])


def test_pallas_gpu_interpret_forward():
  # One tiny forward through the Mosaic GPU interpreter (seconds per kernel);
  # the gradients of the same kernels are covered by the gmm suite.
  params, x, result, mask = _setup("swiglu", seed=3, with_mask=False)
  y = X.routed_experts(params, x, result, num_experts=E, activation="swiglu",
                       backend="pallas_gpu", interpret=True, tiling=(64, 64, 64))
  np.testing.assert_allclose(y, naive_routed(params, x, result, "swiglu", None),
                             rtol=1e-5, atol=1e-5)


def test_bf16_params_and_activations():
  params, x, result, mask = _setup("swiglu", seed=1, dtype=jnp.bfloat16)
  want = naive_routed(jax.tree.map(lambda a: a.astype(jnp.float32), params), x, result,
                      "swiglu", mask)
  for cfg in (CONFIGS["blocked_fused"], CONFIGS["blocked_unfused"]):
    def run(p, cfg=cfg):
      return X.routed_experts(p, x, result, num_experts=E, activation="swiglu",
                              width_mask=mask, **cfg)

    y, g = jax.jit(lambda p: (run(p), jax.grad(
        lambda q: jnp.sum(run(q).astype(jnp.float32)))(p)))(params)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=5e-2, atol=5e-2)
    assert all(v.dtype == jnp.bfloat16 for v in g.values())


def test_everything_zero_computation_gives_zero():
  params, x, result, _ = _setup("gelu", with_mask=False)
  result = result.replace(expert_ids=jnp.full((T, K), E, jnp.int32))
  y, grad_x = jax.value_and_grad(lambda x: jnp.sum(X.routed_experts(
      params, x, result, num_experts=E, activation="gelu", backend="blocked")))(x)
  assert float(y) == 0.0 and not np.any(np.asarray(grad_x))


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="reference"), "layer's own per-expert loop"),
    (dict(backend="ragged"), "did you mean 'ragged_dot'"),
    (dict(activation="relu"), "activation='relu' is unknown"),
    (dict(num_experts=5), r"params\['w_gate_up'\] has shape \(4, 8, 32\), expected \(5, 8, 32\)"),
    (dict(width_mask=jnp.ones((4, 3))), r"width_mask has shape \(4, 3\)"),
])
def test_bad_inputs(kwargs, match):
  params, x, result, _ = _setup("swiglu", with_mask=False)
  args = dict(num_experts=E, activation="swiglu", backend="blocked")
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    X.routed_experts(params, x, result, **args)


def test_missing_param_for_activation():
  params, x, result, _ = _setup("gelu", with_mask=False)
  with pytest.raises(ValueError, match=r"lack \['w_gate_up'\] for activation='swiglu'"):
    X.routed_experts(params, x, result, num_experts=E, activation="swiglu",
                     backend="blocked")


def test_gmm_error_type_for_unknown_backend():
  params, x, result, _ = _setup("gelu", with_mask=False)
  with pytest.raises(gmm_lib.GmmError):
    X.routed_experts(params, x, result, num_experts=E, activation="gelu", backend="nope")


def test_fused_many_experts_matches_unfused():
  # 32 experts for 12 token copies: most experts are empty, the rest get one
  # remainder tile each; outputs and all gradients equal the composed path.
  e, t, k = 32, 6, 2
  ks = jax.random.split(jax.random.PRNGKey(5), 6)
  x = jax.random.normal(ks[0], (t, D))
  ids = jax.random.randint(ks[1], (t, k), 0, e)
  weights = jax.random.uniform(ks[2], (t, k))
  params = {"w_gate": jax.random.normal(ks[3], (e, D, F)) / np.sqrt(D),
            "w_up": jax.random.normal(ks[4], (e, D, F)) / np.sqrt(D),
            "w_down": jax.random.normal(ks[5], (e, F, D)) / np.sqrt(F)}
  params = experts_lib.fused_layout(params)
  valid = jnp.ones((t, k), bool)

  def run(p, x, w, fused):
    return X.routed_ffn(p, x, ids, valid, w, num_experts=e, activation="swiglu",
                        backend="blocked", fused=fused, tile_m=4, tile_small=2)

  got, want = [jax.jit(jax.value_and_grad(
      lambda p, x, w, f=f: jnp.sum(run(p, x, w, f) * x), argnums=(0, 1, 2)))(
          params, x, weights) for f in (True, False)]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("counts", [
    # 16 experts, balanced size 128: fine sizes near 128. Two full tiles and
    # no remainder (1024), a full tile plus a fine remainder (520 = 512 + 8),
    # fine remainders (130, 141), grain ones (40, 193), empty experts.
    [1024, 520, 0, 130, 141, 40, 0, 193] + [0] * 8,
    # 4 experts, balanced size 512 = tm: fold sizes above tm. 520 runs as one
    # 528-row tile, 1030 as a full tile plus a 518-row one, 498 as a 512 one.
    [520, 1030, 498, 0],
    # 2 experts, balanced size 1024: 1024-row tiles (tiling.fused_tiles);
    # 1040 runs as one 1040-row fold tile, 1008 as a fine-size one.
    [1040, 1008],
    # 2 experts of ~2048 rows: 2048-row tiles, 128-row grain; 2100 is a full
    # tile plus a 52-row remainder in a 128-row tile, 1996 a fine-size tile.
    [2100, 1996]])
def test_fused_fine_tile_sizes_match_unfused(counts):
  # >= 2048 token copies, so the fused loop adds the fine remainder sizes
  # (tiling.remainder_sizes); outputs and all gradients equal the composed path.
  e, k = len(counts), 4
  t = sum(counts) // k
  tm, grain = tiling.fused_tiles(t * k, e)
  assert tm == {1024: 1024, 2048: 2048}.get(sum(counts) // e, 512)
  assert tiling.remainder_sizes(t * k, e, tm, grain, 16) != tiling.remainder_sizes(
      t * k, e, tm, grain, 0)
  ks = jax.random.split(jax.random.PRNGKey(6), 7)
  ids = jax.random.permutation(ks[6], jnp.repeat(jnp.arange(e), jnp.array(counts),
                                                 total_repeat_length=t * k)).reshape(t, k)
  x = jax.random.normal(ks[0], (t, D))
  weights = jax.random.uniform(ks[2], (t, k))
  params = {"w_gate": jax.random.normal(ks[3], (e, D, F)) / np.sqrt(D),
            "w_up": jax.random.normal(ks[4], (e, D, F)) / np.sqrt(D),
            "w_down": jax.random.normal(ks[5], (e, F, D)) / np.sqrt(F)}
  params = experts_lib.fused_layout(params)
  valid = jnp.ones((t, k), bool).at[0, 0].set(False)

  def run(p, x, w, fused):
    return X.routed_ffn(p, x, ids, valid, w, num_experts=e, activation="swiglu",
                        backend="blocked", fused=fused)

  got, want = [jax.jit(jax.value_and_grad(
      lambda p, x, w, f=f: jnp.sum(run(p, x, w, f) * x), argnums=(0, 1, 2)))(
          params, x, weights) for f in (True, False)]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_fused_forward_alone_matches_the_differentiated_one(activation):
  # The undifferentiated forward skips saving the pre-activations; its
  # output must be the vjp primal's and the naive loop's.
  params, x, result, mask = _setup(activation, seed=4)
  fast, slow = _loss_fns(activation, mask, result.expert_ids, result.valid,
                         CONFIGS["blocked_fused_classes"])
  y = jax.jit(fast)(params, x, result.weights)
  y_vjp = jax.jit(lambda p, x, w: jax.vjp(fast, p, x, w)[0])(params, x, result.weights)
  np.testing.assert_array_equal(y, y_vjp)
  np.testing.assert_allclose(y, slow(params, x, result.weights), rtol=1e-5, atol=1e-5)
