"""The Pallas TPU folded kernels (interpret mode on CPU) against the blocked backend's.

Legend: T tokens, m layout rows, k contraction width, n output width, G
groups. Interpret mode only checks semantics; the lowering test checks that
Mosaic TPU lowering accepts the kernels. Nothing here runs on a TPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import blocked as blocked_lib
from moejax.execution import folded_gmm as F
from moejax.topology import experts as experts_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import grouped_ffn as X
from moejax.execution import pallas_tpu_folded as PF
from moejax.execution import permute as P

T, K_DIM, N = 11, 16, 24
# 8-row tiles, 8-wide k and n tiles: 2 k tiles, 3 n tiles, 3 row tiles.
TILING = (8, 8, 8)
PALLAS = dict(backend="pallas_tpu", interpret=True, tiling=TILING)
# Group 1 empty; group 2 (rows 5..13) straddles row tiles 0 and 1, group 3
# (rows 14..17) tiles 1 and 2; rows 18, 19 lie past the groups.
SIZES = [5, 0, 9, 4]
# Token 9 three times in group 2 inside tile 0 (the scatter's rounds), token 3
# twice in group 3 across tiles, an absent row (T) inside group 2.
ROWS = [3, 1, 4, 1, 5, 9, 9, 9, 5, 3, 5, 8, T, 7, 9, 3, 2, 3, 6, 0]
M = len(ROWS)
LIVE = np.array([r < T for r in ROWS]) & (np.arange(M) < sum(SIZES))


def _layout():
  gs = jnp.asarray(SIZES, jnp.int32)
  return F._clean_rows(jnp.asarray(ROWS, jnp.int32), gs, T), gs  # the kernels' contract


def _normal(seed, shape, dtype):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _close(a, b, dtype, **kw):
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                             rtol=tol, atol=tol, **kw)


DTYPES = [jnp.float32, jnp.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gather_gmm_matches_blocked(dtype, transpose_rhs):
  rows, gs = _layout()
  x = _normal(0, (T, K_DIM), dtype)
  shape = (lambda w: (4, w, K_DIM)) if transpose_rhs else (lambda w: (4, K_DIM, w))
  rhs = (_normal(1, shape(N), dtype), _normal(2, shape(8), dtype))  # two widths, one gather
  scale = jax.random.uniform(jax.random.PRNGKey(3), (M,))
  kw = dict(out_dtype=dtype, transpose_rhs=transpose_rhs, row_scale=scale)
  got = jax.jit(lambda *a: PF.gather_gmm(*a, interpret=True, tiling=TILING, **kw))(
      x, rows, rhs, gs)
  want = blocked_lib.blocked_gather_gmm(x, rows, rhs, gs, **kw)
  for a, b, w in zip(got, want, (N, 8)):
    assert a.shape == (M, w) and a.dtype == dtype
    _close(np.asarray(a, np.float32)[LIVE], np.asarray(b, np.float32)[LIVE], dtype)
    # Absent rows inside the groups gather a zero row (rows past them: anything).
    assert not np.any(np.asarray(a, np.float32)[12])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs,scaled", [(False, True), (True, False)])
def test_scatter_gmm_matches_blocked(dtype, transpose_rhs, scaled):
  rows, gs = _layout()
  h = (_normal(4, (M, N), dtype), _normal(5, (M, 8), dtype))  # two contraction widths
  shape = (lambda w: (4, K_DIM, w)) if transpose_rhs else (lambda w: (4, w, K_DIM))
  rhs = (_normal(6, shape(N), dtype), _normal(7, shape(8), dtype))
  scale = jax.random.uniform(jax.random.PRNGKey(8), (M,)) if scaled else None
  kw = dict(out_dtype=dtype, transpose_rhs=transpose_rhs)
  got = jax.jit(lambda *a: PF.scatter_gmm(*a, T, interpret=True, tiling=TILING, **kw))(
      h, rhs, gs, rows, scale)
  want = blocked_lib.blocked_scatter_gmm(h, rhs, gs, rows, scale, T, **kw)
  assert got.shape == (T, K_DIM) and got.dtype == dtype
  _close(got, want, dtype)
  # Token 10 has no row: nothing is added to it.
  assert not np.any(np.asarray(got, np.float32)[10])


def test_scatter_rounds_add_every_copy_of_a_repeated_token():
  """Hand-made: rows 0..3 of one tile all hold token 1; h = 1, rhs = identity:
  y[1] must count all four copies (a lost update would leave 1)."""
  rows = jnp.array([1, 1, 1, 1, 0, 2, 2, 3], jnp.int32)
  gs = jnp.array([8], jnp.int32)
  h, rhs = jnp.ones((8, 8)), jnp.eye(8)[None]
  y = PF.scatter_gmm((h,), (rhs,), gs, rows, None, 3, out_dtype=jnp.float32,
                     interpret=True, tiling=TILING)
  np.testing.assert_array_equal(y, np.array([[1.0] * 8, [4.0] * 8, [2.0] * 8]))
  assert int(jnp.max(PF._dup_rank(rows, gs, 8, 3))) == 3  # four rounds


def test_scatter_with_no_live_rows_is_zero():
  rows = jnp.full((8,), 3, jnp.int32)  # all absent (T = 3)
  y = PF.scatter_gmm((jnp.ones((8, 8)),), (jnp.ones((2, 8, 8)),), jnp.array([5, 3], jnp.int32),
                     rows, None, 3, out_dtype=jnp.float32, interpret=True, tiling=TILING)
  np.testing.assert_array_equal(y, np.zeros((3, 8)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gather_lhs,gather_grad,scaled", [
    (True, False, False),  # gather_gmm's d_rhs: x rows gathered, the dout tuple as is
    (False, True, True),   # scatter_gmm's d_rhs: dy rows gathered, scaled by the weights
    (True, True, True)])
def test_gather_tgmm_matches_blocked(dtype, gather_lhs, gather_grad, scaled):
  rows, gs = _layout()
  lhs = _normal(9, (T if gather_lhs else M, K_DIM), dtype)
  grads = tuple(_normal(10 + i, (T if gather_grad else M, w), dtype)
                for i, w in enumerate((N, 8)))
  kw = dict(out_dtype=jnp.float32, lhs_rows=rows if gather_lhs else None,
            grad_rows=rows if gather_grad else None,
            grad_scale=jax.random.uniform(jax.random.PRNGKey(12), (M,)) if scaled else None)
  got = jax.jit(lambda *a: PF.gather_tgmm(*a, interpret=True, tiling=TILING, **kw))(
      lhs, grads, gs)
  want = blocked_lib.blocked_gather_tgmm(lhs, grads, gs, **kw)
  nonempty = np.asarray(SIZES) > 0  # empty groups may hold anything (the caller masks)
  for a, b, w in zip(got, want, (N, 8)):
    assert a.shape == (4, K_DIM, w)
    _close(np.asarray(a)[nonempty], np.asarray(b)[nonempty], dtype)


# --- Gradients through the public entry points. ------------------------------

def _plan():
  """A routing with a token sent twice to one expert (a repeated row in a
  group), invalid slots, an always-empty expert 1 and trailing empty rows."""
  ids = jnp.array([[0, 2], [2, 2], [3, 0], [2, 3], [0, 0], [3, 2], [2, 0], [0, 3],
                   [2, 3], [3, 3], [2, 0]], jnp.int32)
  valid = jnp.ones(ids.shape, bool).at[4, 1].set(False).at[7, 0].set(False)
  plan = P.sort_by_expert(ids, valid, 4)
  assert np.asarray(plan.group_sizes)[1] == 0
  return plan


def _ffn(plan, **kw):
  def fn(x, wg, wu, wd, w):
    a, b = F.gather_gmm(x, plan.src_token, (wg, wu), plan.group_sizes, **kw)
    h = (jax.nn.silu(a.astype(jnp.float32)) * b).astype(x.dtype)
    w_rows = jnp.take(w.reshape(-1), plan.src_slot, mode="fill", fill_value=0)
    return F.scatter_gmm(h, wd, plan.group_sizes, plan.src_token, w_rows, T, **kw)
  return fn


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_entry_point_gradients_match_blocked(dtype):
  plan = _plan()
  args = (_normal(20, (T, K_DIM), dtype), _normal(21, (4, K_DIM, N), dtype) / 4,
          _normal(22, (4, K_DIM, N), dtype) / 4, _normal(23, (4, N, K_DIM), dtype) / 5,
          jax.random.uniform(jax.random.PRNGKey(24), (T, 2)))
  cot = _normal(25, (T, K_DIM), dtype)

  def run(**kw):
    y, vjp = jax.vjp(_ffn(plan, **kw), *args)
    return (y,) + vjp(cot)

  got = jax.jit(lambda: run(**PALLAS))()
  want = jax.jit(lambda: run(backend="blocked", tile_m=4, tile_small=3))()
  for name, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down", "dweights"), got, want):
    assert a.dtype == b.dtype, name
    _close(a, b, dtype, err_msg=name)
  assert not np.any(np.asarray(got[2], np.float32)[1])  # the empty expert: zero gradient


def test_routed_ffn_pallas_tpu_takes_the_folded_path_and_matches(monkeypatch):
  ks = jax.random.split(jax.random.PRNGKey(30), 5)
  x = jax.random.normal(ks[0], (T, K_DIM))
  ids = jax.random.randint(ks[1], (T, 2), 0, 5).astype(jnp.int32)  # id 4: zero-computation
  valid = jax.random.uniform(ks[2], (T, 2)) > 0.2
  w = jax.random.uniform(ks[3], (T, 2))
  p = {n: jax.random.normal(k, (4, N, K_DIM) if n == "w_down" else (4, K_DIM, N)) / 4
       for n, k in zip(("w_gate", "w_up", "w_down"), jax.random.split(ks[4], 3))}
  p = experts_lib.fused_layout(p)
  mask = jnp.ones((4, N)).at[2, 16:].set(0)
  calls, permute = [], P.permute
  monkeypatch.setattr(X.permute_lib, "permute", lambda *a, **k: calls.append(1) or permute(
      *a, **k))

  def loss(p, x, w, **kw):
    y = X.routed_ffn(p, x, ids, valid, w, num_experts=4, activation="swiglu",
                     width_mask=mask, **kw)
    return jnp.sum(jnp.sin(y)), y

  got, want = [jax.jit(jax.value_and_grad(lambda *a, kw=kw: loss(*a, **kw), (0, 1, 2),
                                          has_aux=True))(p, x, w)
               for kw in (PALLAS, dict(backend="ragged_dot"))]
  assert len(calls) == 1  # ragged_dot permutes; pallas_tpu folded it into the matmuls
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_pallas_tpu_folds_the_permutation():
  assert gmm_lib.get_backend("pallas_tpu").folds_permute
  assert gmm_lib.get_backend("pallas_tpu").auto_on == ()  # never run on a TPU


# --- Mosaic TPU lowering (no TPU needed, no interpret). ----------------------

S = jax.ShapeDtypeStruct
LT, LM, LK, LN, LG = 100, 256, 128, 256, 4
BF, I32, F32 = jnp.bfloat16, jnp.int32, jnp.float32
X_, ROWS_, GS_, W_ = S((LT, LK), BF), S((LM,), I32), S((LG,), I32), S((LM,), F32)
LOWER = [
    ("gather_gmm", lambda x, r, a, b, g, s: PF.gather_gmm(x, r, (a, b), g, out_dtype=BF,
                                                          row_scale=s),
     (X_, ROWS_, S((LG, LK, LN), BF), S((LG, LK, LN), BF), GS_, W_)),
    ("gather_gmm_t", lambda x, r, a, g: PF.gather_gmm(x, r, (a,), g, out_dtype=F32,
                                                      transpose_rhs=True),
     (X_, ROWS_, S((LG, LN, LK), BF), GS_)),
    ("scatter_gmm", lambda h, a, g, r, s: PF.scatter_gmm((h,), (a,), g, r, s, LT, out_dtype=BF),
     (S((LM, LN), BF), S((LG, LN, LK), BF), GS_, ROWS_, W_)),
    ("scatter_gmm_two_t", lambda h1, h2, a, b, g, r: PF.scatter_gmm(
        (h1, h2), (a, b), g, r, None, LT, out_dtype=BF, transpose_rhs=True),
     (S((LM, LN), BF), S((LM, LN), BF), S((LG, LK, LN), BF), S((LG, LK, LN), BF), GS_, ROWS_)),
    ("gather_tgmm_lhs", lambda x, d1, d2, g, r: PF.gather_tgmm(x, (d1, d2), g, out_dtype=F32,
                                                               lhs_rows=r),
     (X_, S((LM, LN), BF), S((LM, LN), BF), GS_, ROWS_)),
    ("gather_tgmm_grad", lambda h, d, g, r, s: PF.gather_tgmm(h, (d,), g, out_dtype=F32,
                                                              grad_rows=r, grad_scale=s),
     (S((LM, LK), BF), S((LT, LN), BF), GS_, ROWS_, W_)),
]


@pytest.mark.parametrize("name,fn,specs", LOWER, ids=[c[0] for c in LOWER])
def test_kernels_lower_for_tpu(name, fn, specs):
  text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
  assert "custom_call" in text, name  # the Mosaic kernel, not an XLA fallback


def test_unaligned_tiling_is_a_clear_error():
  rows, gs = _layout()
  with pytest.raises(gmm_lib.GmmError, match=r"tiling=\(8, 64, 8\).*multiples of 128"):
    PF.gather_gmm(jnp.ones((T, 256)), rows, (jnp.ones((4, 256, 256)),), gs,
                  out_dtype=jnp.float32, tiling=(8, 64, 8))
