"""pallas_gpu's folded (Triton) kernels, in interpret mode, against the blocked backend's.

Legend: T tokens, m layout rows, G groups, k contraction width, n output
width; (bm, bk, bn) the tile. Interpret mode and lowering for ``cuda`` only:
no GPU runs here.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import blocked as blocked_lib
from moejax.execution import folded_gmm as F
from moejax.execution import gmm as gmm_lib
from moejax.execution import grouped_ffn as X
from moejax.execution import pallas_gpu
from moejax.execution import pallas_gpu_folded as PF
from moejax.topology import experts as experts_lib

T, M, K, N, N2, G = 10, 24, 20, 18, 5, 4
SIZES = [5, 0, 9, 6]  # an empty group; 20 of 24 rows used
# 16-row tiles: tile 0 holds groups 0, 2 and the start of 3 (visited three
# times), tile 1 the rest of 3; k = 20 and n = 18 span two blocks each.
TILING = (16, 16, 16)
BLOCKED = dict(tile_m=4, tile_small=3)
# The row map, cleaned as the entry points clean it (absent: T): duplicated
# tokens inside one group (3 in group 0, 2 in group 3) and across groups,
# absent rows inside the groups and past them.
ROWS = np.array([0, 3, 3, T, 7,                    # group 0
                 1, 2, 3, 4, 5, 6, 8, 9, 0,        # group 2
                 0, 9, T, 2, 2, 5,                 # group 3
                 T, T, T, T], np.int32)            # past the groups
USED = np.arange(M) < sum(SIZES)


def _normal(seed, shape, dtype):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _close(got, want, dtype, rows=None):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if rows is not None:  # rows past the groups are unspecified
    got, want = got[rows], want[rows]
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _both(name, *args, **kw):
  """(pallas_gpu kernel, blocked kernel) results of one folded kernel."""
  got = getattr(pallas_gpu.BACKEND, name)(*args, interpret=True, tiling=TILING, **kw)
  want = getattr(blocked_lib.BACKEND, name)(*args, **BLOCKED, **kw)
  return got, want


def test_backend_now_folds_and_stays_off_auto():
  assert pallas_gpu.BACKEND.folds_permute
  assert pallas_gpu.BACKEND.auto_on == ()  # nothing has run on a GPU


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gather_gmm_matches_blocked(dtype, transpose_rhs):
  x = _normal(0, (T, K), dtype)
  shape = lambda n: (G, n, K) if transpose_rhs else (G, K, n)
  rhs = (_normal(1, shape(N), dtype), _normal(2, shape(N2), dtype))  # two widths, one gather
  scale = jax.random.uniform(jax.random.PRNGKey(3), (M,))
  gs, rows = jnp.asarray(SIZES, jnp.int32), jnp.asarray(ROWS)
  for row_scale in (None, scale):
    got, want = _both("gather_gmm", x, rows, rhs, gs, out_dtype=jnp.float32,
                      transpose_rhs=transpose_rhs, row_scale=row_scale)
    assert [g.shape for g in got] == [(M, N), (M, N2)]
    for a, b in zip(got, want):
      _close(a, b, jnp.float32, USED)  # 16-bit products are exact in f32
  # Absent rows inside the groups come out zero.
  assert not np.any(np.asarray(got[0])[USED & (ROWS == T)])


def test_gather_gmm_hand_computed_rows_and_out_dtype():
  # rhs[g] = (g + 1) * identity: each used row is its token's row times g + 1.
  x = jnp.arange(T * 16, dtype=jnp.float32).reshape(T, 16).astype(jnp.bfloat16)
  rhs = (jnp.arange(1, G + 1, dtype=jnp.float32)[:, None, None] * jnp.eye(16)).astype(
      jnp.bfloat16)
  out, = PF.gpu_gather_gmm(x, jnp.asarray(ROWS), (rhs,), jnp.asarray(SIZES, jnp.int32),
                           out_dtype=jnp.bfloat16, interpret=True, tiling=TILING)
  assert out.dtype == jnp.bfloat16
  group = np.repeat(np.arange(G), SIZES)
  xs = np.concatenate([np.asarray(x, np.float32), np.zeros((1, 16))])[ROWS[:len(group)]]
  want = (xs * (group + 1)[:, None]).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out[:len(group)]), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_scatter_gmm_matches_blocked(dtype, transpose_rhs):
  # Two lhs of different widths summed into one output (gate + up style).
  h = (_normal(4, (M, K), dtype), _normal(5, (M, 7), dtype))
  shape = lambda k: (G, N, k) if transpose_rhs else (G, k, N)
  rhs = (_normal(6, shape(K), dtype), _normal(7, shape(7), dtype))
  scale = jax.random.uniform(jax.random.PRNGKey(8), (M,))
  gs, rows = jnp.asarray(SIZES, jnp.int32), jnp.asarray(ROWS)
  for row_scale in (None, scale):
    got, want = _both("scatter_gmm", h, rhs, gs, rows, row_scale, T, out_dtype=jnp.float32,
                      transpose_rhs=transpose_rhs)
    assert got.shape == (T, N) and got.dtype == jnp.float32
    _close(got, want, jnp.float32)
  out = pallas_gpu.BACKEND.scatter_gmm(h[:1], rhs[:1], gs, rows, scale, T, out_dtype=dtype,
                                       transpose_rhs=transpose_rhs, interpret=True,
                                       tiling=TILING)
  assert out.dtype == dtype  # f32 sums, one rounding at the end
  _close(out, blocked_lib.BACKEND.scatter_gmm(h[:1], rhs[:1], gs, rows, scale, T,
                                              out_dtype=dtype, transpose_rhs=transpose_rhs),
         dtype)


def test_scatter_gmm_adds_duplicates_and_drops_absent_rows():
  # Hand-made: rhs = identity, h row r = r + 1 in every column, scale 1.
  h = (jnp.broadcast_to(jnp.arange(1.0, M + 1)[:, None], (M, 16)),)
  rhs = (jnp.broadcast_to(jnp.eye(16), (G, 16, 16)),)
  y = PF.gpu_scatter_gmm(h, rhs, jnp.asarray(SIZES, jnp.int32), jnp.asarray(ROWS), None, T,
                         out_dtype=jnp.float32, interpret=True, tiling=TILING)
  want = np.zeros(T)
  for r in np.flatnonzero(USED & (ROWS < T)):
    want[ROWS[r]] += r + 1
  np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(want[:, None], (T, 16)))
  assert want[3] == 2 + 3 + 8  # token 3: twice in group 0, once in group 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_tgmm_matches_blocked(dtype):
  gs, rows = jnp.asarray(SIZES, jnp.int32), jnp.asarray(ROWS)
  scale = jax.random.uniform(jax.random.PRNGKey(9), (M,))
  nonempty = np.asarray(SIZES) > 0  # empty groups are unspecified
  cases = {  # (lhs, grads, keyword arguments)
      # d_rhs of a gathered gmm: lhs = x gathered, two grads (widths N, N2).
      "lhs_rows": (_normal(10, (T, K), dtype), (_normal(11, (M, N), dtype),
                                                _normal(12, (M, N2), dtype)),
                   dict(lhs_rows=rows)),
      # d_rhs of a scatter gmm: the grad gathered and scaled by the weight.
      "grad_rows": (_normal(13, (M, K), dtype), (_normal(14, (T, N), dtype),),
                    dict(grad_rows=rows, grad_scale=scale)),
      "neither": (_normal(15, (M, K), dtype), (_normal(16, (M, N), dtype),), {}),
  }
  for name, (lhs, grads, kw) in cases.items():
    got, want = _both("gather_tgmm", lhs, grads, gs, out_dtype=jnp.float32, **kw)
    for a, b in zip(got, want):
      assert a.shape == (G, K, b.shape[2])
      _close(np.asarray(a)[nonempty], np.asarray(b)[nonempty], jnp.float32)


def test_empty_operands_give_zeros():
  gs = jnp.zeros((G,), jnp.int32)
  out, = PF.gpu_gather_gmm(jnp.ones((0, K)), jnp.zeros((0,), jnp.int32), (jnp.ones((G, K, N)),),
                           gs, out_dtype=jnp.float32, interpret=True)
  assert out.shape == (0, N)
  y = PF.gpu_scatter_gmm((jnp.ones((M, K)),), (jnp.ones((G, K, N)),), gs,
                         jnp.zeros((M,), jnp.int32), None, 0, out_dtype=jnp.float32,
                         interpret=True)
  assert y.shape == (0, N)
  # Every group empty: every visit is dead, nothing is added.
  y = PF.gpu_scatter_gmm((jnp.ones((M, K)),), (jnp.ones((G, K, N)),), gs, jnp.asarray(ROWS),
                         jnp.ones((M,)), T, out_dtype=jnp.float32, interpret=True,
                         tiling=TILING)
  np.testing.assert_array_equal(y, np.zeros((T, N)))


def test_bad_tiling_names_the_field():
  with pytest.raises(gmm_lib.GmmError, match=r"tiling=\(64, 48, 64\) is not three powers"):
    PF.gpu_gather_gmm(jnp.ones((T, K)), jnp.asarray(ROWS), (jnp.ones((G, K, N)),),
                      jnp.asarray(SIZES, jnp.int32), out_dtype=jnp.float32, interpret=True,
                      tiling=(64, 48, 64))


# --- Gradients through the public entry points. ------------------------------

def _ffn(backend, gs, rows, **kw):
  """gate / up share one gathered gmm, down scatter-adds times the weights."""
  def fn(x, w_gate, w_up, w_down, weights):
    a, b = F.gather_gmm(x, rows, (w_gate, w_up), gs, backend=backend, **kw)
    h = (jax.nn.silu(a) * b).astype(x.dtype)
    return F.scatter_gmm(h, w_down, gs, rows, weights, T, backend=backend, **kw)
  return fn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_folded_entry_point_gradients_match_blocked(dtype):
  gs = jnp.asarray(SIZES, jnp.int32)
  # Raw rows: -1 and 99 out of range, junk past the groups (the entry points clean them).
  rows = jnp.asarray(np.where(ROWS == T, -1, ROWS)).at[3].set(99).at[21].set(4)
  args = (_normal(20, (T, K), dtype), _normal(21, (G, K, N), dtype) * 0.3,
          _normal(22, (G, K, N), dtype) * 0.3, _normal(23, (G, N, K), dtype) * 0.3,
          jax.random.uniform(jax.random.PRNGKey(24), (M,)))
  cot = _normal(25, (T, K), dtype)

  def value_and_grads(fn):
    y, vjp = jax.vjp(fn, *args)
    return (y,) + vjp(cot)

  got = jax.jit(lambda: value_and_grads(_ffn("pallas_gpu", gs, rows, interpret=True,
                                             tiling=TILING)))()
  want = jax.jit(lambda: value_and_grads(_ffn("blocked", gs, rows, **BLOCKED)))()
  for name, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down", "dweights"), got, want):
    assert a.dtype == b.dtype, name
    _close(a, b, dtype)  # bf16: the same rounding points, other summation orders
  # Rows without a token (absent, past the groups) get no weight gradient.
  live = USED & (ROWS < T)
  assert not np.any(np.asarray(got[5])[~live]) and np.all(np.asarray(got[5])[live] != 0)
  assert not np.any(np.asarray(got[2][1]))  # the empty group's weights: zero gradient


# --- The layer path: routed_ffn takes the folded Triton kernels. -------------

def _route(seed=0, t=7, e=3, k=2):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  x = jax.random.normal(ks[0], (t, 16))
  ids = jax.random.choice(ks[1], jnp.array([0, 0, 2, 2, 2, e]), (t, k)).astype(jnp.int32)
  valid = jax.random.uniform(ks[2], (t, k)) > 0.2
  w = jax.random.uniform(ks[3], (t, k))
  p = {n: jax.random.normal(kk, (e, 24, 16) if n == "w_down" else (e, 16, 24)) * 0.3
       for n, kk in zip(("w_gate", "w_up", "w_down"), jax.random.split(ks[4], 3))}
  return experts_lib.fused_layout(p), x, ids, valid, w, e


def test_routed_ffn_pallas_gpu_matches_ragged_dot():
  # routed_ffn refuses backend='reference' (the layer's own loop); ragged_dot is
  # the reference grouped matmul, through the permute path.
  p, x, ids, valid, w, e = _route()

  def loss(backend, **kw):
    def fn(p, x, w):
      y = X.routed_ffn(p, x, ids, valid, w, num_experts=e, activation="swiglu",
                       backend=backend, **kw)
      return jnp.sum(jnp.sin(y))
    return fn

  gpu = loss("pallas_gpu", interpret=True, tiling=TILING)
  jaxpr = str(jax.make_jaxpr(jax.grad(gpu, (0, 1, 2)))(p, x, w))
  for kernel in ("moejax_gather_gmm_gpu", "moejax_scatter_gmm_gpu", "moejax_gather_tgmm_gpu"):
    assert kernel in jaxpr  # the folded path, forward and backward
  got = jax.jit(jax.value_and_grad(gpu, (0, 1, 2)))(p, x, w)
  want = jax.jit(jax.value_and_grad(loss("ragged_dot"), (0, 1, 2)))(p, x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --- Lowering for CUDA (no device: Pallas' Triton lowering, not Triton's compiler). ---

S = jax.ShapeDtypeStruct
LT, LM, LK, LN = 100, 256, 128, 192


def _triton_calls(fn, *specs) -> list[str]:
  """The Triton IR (TTIR) text of every Triton kernel call ``fn`` lowers to for cuda."""
  lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
  assert "custom_call @__gpu$xla.gpu.triton" in lowered.as_text()
  try:  # the kernels are serialised MLIR bytecode: parse it with the Triton dialect
    from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
    from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
    from jax._src.lib.triton import dialect as tt_dialect  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover
    pytest.skip(f"cannot read the Triton IR with this jax ({e}); the custom_call was checked")
  texts = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.operation.name == "stablehlo.custom_call":
            config = ir.DictAttr(o.operation.attributes["mhlo.backend_config"])
            with mlir.make_ir_context() as ctx:
              tt_dialect.register_dialect(ctx)
              texts.append(str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)))
          walk(o.operation)

  walk(lowered.compiler_ir("stablehlo").operation)
  return texts


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_for_cuda(dtype):
  dt = dtype
  i32, f32 = jnp.int32, jnp.float32
  name = "bf16" if dtype == jnp.bfloat16 else "f32"
  gather, = _triton_calls(
      lambda x, r, a, b, s, c: PF.gpu_gather_gmm(x, r, (a, b), s, out_dtype=dt, row_scale=c),
      S((LT, LK), dt), S((LM,), i32), S((G, LK, LN), dt), S((G, LK, 64), dt), S((G,), i32),
      S((LM,), f32))
  # x's rows gathered by one pointer-array load per k block, then the dot.
  assert re.search(rf"tt.load .*tensor<64x64x!tt.ptr<{name}>>", gather)
  dots = [line for line in gather.splitlines() if "tt.dot" in line]
  assert dots
  if dtype == jnp.float32:  # IEEE f32 (TTIR's default, not printed), never TF32
    assert not any("tf32" in line for line in dots), dots
  gather_t, = _triton_calls(
      lambda x, r, a, s: PF.gpu_gather_gmm(x, r, (a,), s, out_dtype=dt, transpose_rhs=True),
      S((LT, LK), dt), S((LM,), i32), S((G, LN, LK), dt), S((G,), i32))
  assert "tt.trans" in gather_t
  scatter, = _triton_calls(
      lambda h, a, s, r, c: PF.gpu_scatter_gmm((h,), (a,), s, r, c, LT, out_dtype=dt),
      S((LM, LK), dt), S((G, LK, LN), dt), S((G,), i32), S((LM,), i32), S((LM,), f32))
  # One masked [bm, bn] float32 atomic add, not the interpreter's row loop.
  assert re.search(r"tt.atomic_rmw fadd.*tensor<64x64x!tt.ptr<f32>>, tensor<64x64xf32>, "
                   r"tensor<64x64xi1>", scatter)
  for kw, specs in ((dict(lhs_rows=True), (S((LT, LK), dt), S((LM, LN), dt))),
                    (dict(grad_rows=True), (S((LM, LK), dt), S((LT, LN), dt)))):
    tgmm, = _triton_calls(
        lambda a, d, s, r, c, kw=kw: PF.gpu_gather_tgmm(
            a, (d,), s, out_dtype=f32, grad_scale=c,
            **{key: r for key in kw}), *specs, S((G,), i32), S((LM,), i32), S((LM,), f32))
    assert "scf.for" in tgmm and "tt.dot" in tgmm


def test_operands_past_int32_offsets_are_refused_off_interpret_mode():
  # Triton's pointer offsets are int32: 256 x 7168 x 2048 experts would wrap (traced only).
  big = S((256, 7168, 2048), jnp.bfloat16)
  with pytest.raises(gmm_lib.GmmError, match=r"rhs\[0\] has 3758096384 elements"):
    jax.jit(lambda x, r, w, s: PF.gpu_gather_gmm(x, r, (w,), s, out_dtype=jnp.bfloat16)).trace(
        S((LT, 7168), jnp.bfloat16), S((LM,), jnp.int32), big, S((256,), jnp.int32))
