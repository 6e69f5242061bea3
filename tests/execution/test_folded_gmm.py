"""The grouped matmuls with the dispatch folded in, against permute -> gmm -> unpermute.

Legend: T tokens, K slots, E experts, d width, f hidden width, M = T * K.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import blocked as blocked_lib
from moejax.execution import folded_gmm as F
from moejax.topology import experts as experts_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import grouped_ffn as X
from moejax.execution import permute as P

T, K, E, D, N = 9, 3, 5, 6, 7
M = T * K
# 4-row tiles, remainders in 3s: tiles straddle groups and the last is clamped.
TILES = dict(tile_m=4, tile_small=3)


def _routing(seed=0):
  """ids with zero-computation experts (id E) and an always-empty expert 3,
  some invalid slots; the plan has uneven groups, empty groups, trailing empty rows."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  ids = jax.random.choice(ks[0], jnp.array([0, 0, 0, 1, 2, 4, 4, E]), (T, K)).astype(jnp.int32)
  valid = jax.random.uniform(ks[1], (T, K)) > 0.2
  w = jnp.where(valid, jax.random.uniform(ks[2], (T, K)), 0.0)
  plan = P.sort_by_expert(ids, valid, E)
  sizes = np.asarray(plan.group_sizes)
  assert sizes[3] == 0 and sizes.sum() < M and len(set(sizes)) > 2  # the cases we want
  return plan, w


def _arrays(seed=1, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(ks[0], (T, D)).astype(dtype)
  w1 = (jax.random.normal(ks[1], (E, D, N)) / np.sqrt(D)).astype(dtype)
  w2 = (jax.random.normal(ks[2], (E, N, D)) / np.sqrt(N)).astype(dtype)
  return x, w1, w2


def _folded(plan, backend="blocked", **kw):
  def fn(x, w1, w2, w):
    h = jnp.tanh(F.gather_gmm(x, plan.src_token, w1, plan.group_sizes, backend=backend, **kw))
    w_rows = jnp.take(w.reshape(-1), plan.src_slot, mode="fill", fill_value=0)
    return F.scatter_gmm(h.astype(x.dtype), w2, plan.group_sizes, plan.src_token, w_rows, T,
                         backend=backend, **kw)
  return fn


def _composed(plan, backend, **kw):
  def fn(x, w1, w2, w):
    h = jnp.tanh(gmm_lib.gmm(P.permute(x, plan), w1, plan.group_sizes, backend=backend, **kw))
    ys = gmm_lib.gmm(h.astype(x.dtype), w2, plan.group_sizes, backend=backend, **kw)
    return P.unpermute(ys, plan, w)
  return fn


def _value_and_grads(fn, args, cot):
  y, vjp = jax.vjp(fn, *args)
  return (y,) + vjp(cot.astype(y.dtype))


@pytest.mark.parametrize("ref_backend,kw", [("ragged_dot", {}), ("blocked", TILES)])
def test_gather_then_scatter_equals_the_composition(ref_backend, kw):
  plan, w = _routing()
  x, w1, w2 = _arrays()
  cot = jax.random.normal(jax.random.PRNGKey(7), (T, D))
  got = jax.jit(lambda *a: _value_and_grads(_folded(plan, **TILES), a, cot))(x, w1, w2, w)
  want = jax.jit(lambda *a: _value_and_grads(_composed(plan, ref_backend, **kw), a, cot))(
      x, w1, w2, w)
  for name, a, b in zip(("y", "dx", "dw1", "dw2", "dweights"), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
  # Slots with no row (invalid, zero-computation) get no weight gradient.
  assert not np.any(np.asarray(got[4])[~np.asarray(plan.dispatched())])
  # The always-empty expert 3 gets zero gradients.
  assert not np.any(np.asarray(got[2][3])) and not np.any(np.asarray(got[3][3]))


def test_bf16_agrees_with_the_float32_composition():
  plan, w = _routing(seed=2)
  x, w1, w2 = _arrays(seed=3, dtype=jnp.bfloat16)
  cot = jax.random.normal(jax.random.PRNGKey(8), (T, D))
  got = jax.jit(lambda *a: _value_and_grads(_folded(plan, **TILES), a, cot))(x, w1, w2, w)
  f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
  want = jax.jit(lambda *a: _value_and_grads(_composed(plan, "ragged_dot"), a, cot))(*f32, w)
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
  assert got[4].dtype == w.dtype
  for name, a, b in zip(("y", "dx", "dw1", "dw2", "dweights"), got, want):
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=5e-2, atol=5e-2, err_msg=name)


def test_out_of_range_rows_gather_zeros_and_scatter_nowhere():
  # Hand-made: 2 groups over 5 layout rows (4 used), T = 3 tokens, rhs = identity * (g + 1).
  x = jnp.array([[1., 2.], [3., 4.], [5., 6.]])
  rows = jnp.array([2, 7, 0, -1, 1], jnp.int32)  # 7 and -1 out of range; row 4 past the groups
  gs = jnp.array([2, 2], jnp.int32)
  rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
  out = F.gather_gmm(x, rows, rhs, gs, backend="blocked", tile_m=2, tile_small=1)
  np.testing.assert_array_equal(out, [[5, 6], [0, 0], [2, 4], [0, 0], [0, 0]])
  w = jnp.array([1., 1., 0.5, 1., 1.])
  h = jnp.arange(10, dtype=jnp.float32).reshape(5, 2)
  y = F.scatter_gmm(h, rhs, gs, rows, w, 3, backend="blocked", tile_m=2, tile_small=1)
  # Row 0 -> token 2 (x1); row 2 -> token 0 (x2, weight 0.5); rows 1, 3 out of range,
  # row 4 past the groups: dropped.
  np.testing.assert_array_equal(y, [[4, 5], [0, 0], [0, 1]])
  # Gradients: only live rows receive or send any.
  dx = jax.grad(lambda x: jnp.sum(F.gather_gmm(x, rows, rhs, gs, backend="blocked")))(x)
  np.testing.assert_array_equal(dx, [[2, 2], [0, 0], [1, 1]])
  dh, dw = jax.grad(lambda h, w: jnp.sum(F.scatter_gmm(h, rhs, gs, rows, w, 3,
                                                       backend="blocked")), (0, 1))(h, w)
  np.testing.assert_array_equal(dh, [[1, 1], [0, 0], [1, 1], [0, 0], [0, 0]])
  np.testing.assert_array_equal(dw, [1, 0, 18, 0, 0])  # <h[r] @ rhs[g], 1>


def test_transposed_rhs_and_its_gradients():
  plan, w = _routing(seed=4)
  x, w1, _ = _arrays(seed=5)
  w1t = jnp.swapaxes(w1, 1, 2)  # [E, N, D]: x @ w1t[g]^T; then h @ w1[g]^T back to D
  gs = plan.group_sizes

  def folded(x, a, b, w):
    h = jnp.tanh(F.gather_gmm(x, plan.src_token, a, gs, transpose_rhs=True, **TILES))
    w_rows = jnp.take(w.reshape(-1), plan.src_slot, mode="fill", fill_value=0)
    return F.scatter_gmm(h, b, gs, plan.src_token, w_rows, T, transpose_rhs=True, **TILES)

  def ref(x, a, b, w):
    kw = dict(transpose_rhs=True, backend="ragged_dot")
    h = jnp.tanh(gmm_lib.gmm(P.permute(x, plan), a, gs, **kw))
    return P.unpermute(gmm_lib.gmm(h, b, gs, **kw), plan, w)

  got, want = [jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a))),
                                          (0, 1, 2, 3)))(x, w1t, w1, w) for f in (folded, ref)]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_several_rhs_share_one_gather():
  plan, _ = _routing(seed=10)
  x, w1, _ = _arrays(seed=11)
  w1b = w1[:, :, :3] * 2.0  # another width, n = 3
  gs, tok = plan.group_sizes, plan.src_token

  def together(x, a, b):
    p, q = F.gather_gmm(x, tok, (a, b), gs, **TILES)
    return jnp.sum(jnp.sin(p)) + jnp.sum(jnp.cos(q))

  def apart(x, a, b):
    return (jnp.sum(jnp.sin(F.gather_gmm(x, tok, a, gs, **TILES)))
            + jnp.sum(jnp.cos(F.gather_gmm(x, tok, b, gs, **TILES))))

  got, want = [jax.jit(jax.value_and_grad(f, (0, 1, 2)))(x, w1, w1b) for f in (together, apart)]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --- The routed FFN: folded vs permute path, and who decides. ----------------

F_HID = 4  # f != d, so an [M, d] array in a jaxpr is the permuted copy


def _ffn_case(activation="swiglu"):
  plan, w = _routing(seed=6)
  ks = jax.random.split(jax.random.PRNGKey(9), 4)
  x = jax.random.normal(ks[0], (T, D))
  ids = jax.random.choice(ks[1], jnp.array([0, 1, 1, 2, 4, E]), (T, K)).astype(jnp.int32)
  valid = jax.random.uniform(ks[2], (T, K)) > 0.2
  p = {n: jax.random.normal(k, (E, F_HID, D) if n == "w_down" else (E, D, F_HID))
       for n, k in zip(("w_gate", "w_up", "w_down"), jax.random.split(ks[3], 3))}
  if activation == "gelu":
    del p["w_gate"]
  return experts_lib.fused_layout(p), x, ids, valid, w


def _ffn_fn(ids, valid, activation, **kw):
  def fn(p, x, w):
    return X.routed_ffn(p, x, ids, valid, w, num_experts=E, activation=activation,
                        backend="blocked", fused=False, **TILES, **kw)
  return fn


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_routed_ffn_folded_equals_permute_path(activation):
  p, x, ids, valid, w = _ffn_case(activation)
  mask = jnp.ones((E, F_HID)).at[1, 2:].set(0)
  got, want = [jax.jit(jax.value_and_grad(
      lambda p, x, w, fold=fold: jnp.sum(jnp.sin(_ffn_fn(
          ids, valid, activation, fold_permute=fold, width_mask=mask)(p, x, w))),
      (0, 1, 2)))(p, x, w) for fold in (True, False)]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # f32 rounding of sums whose terms reach the leaf's largest entry (unscaled weights
    # here: entries up to ~20); both paths are that close to a float64 loop.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, np.max(np.abs(b))))


def test_folded_path_writes_no_permuted_copy():
  """No [M, d] array in the forward or the backward (the permute path has several)."""
  p, x, ids, valid, w = _ffn_case()

  def jaxpr(fold):
    loss = lambda p, x, w: jnp.sum(_ffn_fn(ids, valid, "swiglu", fold_permute=fold)(p, x, w))
    return str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(p, x, w))

  permuted = f"f32[{M},{D}]"
  assert permuted in jaxpr(False)
  assert permuted not in jaxpr(True)


class _Spy:
  def __init__(self, fn):
    self.fn, self.calls = fn, 0

  def __call__(self, *a, **kw):
    self.calls += 1
    return self.fn(*a, **kw)


def test_the_backend_capabilities_decide_the_path(monkeypatch, swap_backend):
  p, x, ids, valid, w = _ffn_case()
  permute = _Spy(P.permute)
  monkeypatch.setattr(X.permute_lib, "permute", permute)
  fused = _Spy(blocked_lib.BACKEND.fused_ffn)
  full = dataclasses.replace(blocked_lib.BACKEND, fused_ffn=fused)
  bare = dataclasses.replace(full, gather_gmm=None, scatter_gmm=None, gather_tgmm=None,
                             fused_ffn=None)
  run = lambda **kw: X.routed_ffn(p, x, ids, valid, w, num_experts=E, activation="swiglu",
                                  backend="blocked", **TILES, **kw)
  outs = {}
  for name, be, kw, want in (("fused", full, {}, (1, 0)),
                             ("folded", full, dict(fused=False), (0, 0)),
                             ("forced_permute", full, dict(fused=False, fold_permute=False),
                              (0, 1)),
                             ("no_capability", bare, {}, (0, 1))):
    swap_backend(be)
    fused.calls = permute.calls = 0
    outs[name] = run(**kw)
    assert (fused.calls, permute.calls) == want, name
  for name, y in outs.items():
    np.testing.assert_allclose(y, outs["fused"], rtol=1e-5, atol=1e-5, err_msg=name)


def test_which_backends_fold():
  folding = {n for n in gmm_lib.BACKENDS if gmm_lib.get_backend(n).folds_permute}
  assert folding == {"blocked", "pallas_gpu", "pallas_tpu"}
  assert {n for n in gmm_lib.BACKENDS if gmm_lib.get_backend(n).fused_ffn} == {
      "blocked", "whole_group"}


@pytest.mark.parametrize("call,match", [
    (lambda x, r, w, gs: F.gather_gmm(x, r, w, gs, backend="ragged_dot"),
     "has no folded .* use one of blocked"),
    (lambda x, r, w, gs: F.gather_gmm(x, r.astype(jnp.float32), w, gs),
     r"rows must be int32\[m\], got float32\[6\]"),
    (lambda x, r, w, gs: F.gather_gmm(x, r, w, jnp.array([5, 3], jnp.int32)),
     "group_sizes sum to 8 > m=6"),
    (lambda x, r, w, gs: F.scatter_gmm(jnp.ones((5, 2)), w, gs, r, jnp.ones(6), 3),
     r"h must be \[m=6, k\], got \(5, 2\)"),
    (lambda x, r, w, gs: F.scatter_gmm(jnp.ones((6, 2)), w, gs, r, jnp.ones(5), 3),
     r"weights must be float\[m=6\], got float32\[5\]"),
])
def test_bad_inputs(call, match):
  x, rows = jnp.ones((3, 2)), jnp.zeros((6,), jnp.int32)
  rhs, gs = jnp.ones((2, 2, 2)), jnp.array([2, 3], jnp.int32)
  with pytest.raises(gmm_lib.GmmError, match=match):
    call(x, rows, rhs, gs)
