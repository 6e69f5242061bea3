"""``blocked``: the portable XLA grouped matmul, fast on CPU.

Legend: m rows, k contraction width, n output width, G groups, tm row tile,
NT = m / tm + G static bound on the tile count.

Why not the obvious formulations: ``jax.lax.ragged_dot`` lowers on CPU to a
dense masked matmul over all G groups (G times the FLOPs), and a GShard
one-hot dispatch einsum pays for an [m, G, C] mask. Here every group is cut
into tm-row tiles starting at the group's first row; a ``fori_loop`` with a
*data-dependent trip count* runs one dense [tm, k] x [k, n] matmul per used
tile, so the work is sum_g ceil(size_g / tm) * tm rows: the real rows plus at
most tm - 1 per group. The last tile of a group reads rows of the next group
(or is clamped back from the end of lhs, re-reading rows of the group's
previous tile); a row mask keeps only the rows the tile owns when it is
written or accumulated. Dropless and exact; no shape depends on the
routing.

The same tile loops also come with the dispatch permutation folded in
(``Backend.folds_permute``, entry points in ``folded_gmm.py``): a tile gathers
its lhs rows from the [T, k] token array through the layout's row -> token
map, or scatter-adds its output rows (times the combine weight, in float32)
into [T, n], instead of slicing a permuted [m, k] copy or writing an [m, n]
output for unpermute to read back.

The loop carries the full output, which XLA updates in place
(dynamic-update-slice on a loop carry). Tile defaults:
``tiling.DEFAULT_TILE_M`` / ``tiling.DEFAULT_TILE_SMALL``, shared with the
fused FFN (the gmm benchmark suite, ``bench --suite=gmm``, chose them).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from moejax.execution import fused as fused_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import tiling


def _plans(group_sizes, m: int, tile_m, tile_small):
  return tiling.group_tiles(group_sizes, m, *tiling.fit_tiles(m, tile_m, tile_small))


def blocked_gmm(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False,
                interpret=False, tile_m: int | None = None,
                tile_small: int | None = None):
  """out[m, n] = lhs[rows_g] @ rhs[g] per group (rows past the groups: 0)."""
  del interpret
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out = jnp.zeros((m, n), out_dtype)
  if m == 0:
    return out
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  def body(tm, tiles, i, out):
    g, r0 = tiles.group[i], tiles.row[i]
    x = lax.dynamic_slice(lhs, (r0, 0), (tm, k))
    w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)
    y = lax.dot_general(x, w, (contract, ((), ())),
                        preferred_element_type=jnp.float32).astype(out_dtype)
    keep = tiles.owned(i, tm)
    old = lax.dynamic_slice(out, (r0, 0), (tm, n))
    return lax.dynamic_update_slice(out, jnp.where(keep[:, None], y, old), (r0, 0))

  for tm, tiles in _plans(group_sizes, m, tile_m, tile_small):
    out = lax.fori_loop(0, tiles.num_tiles, functools.partial(body, tm, tiles), out)
  return out


def blocked_tgmm(lhs, grad, group_sizes, *, out_dtype, interpret=False,
                 tile_m: int | None = None, tile_small: int | None = None):
  """out[G, k, n] = lhs[rows_g]^T @ grad[rows_g] per group (empty: 0)."""
  del interpret
  m, k = lhs.shape
  n = grad.shape[1]
  num_groups = group_sizes.shape[0]
  acc = jnp.zeros((num_groups, k, n), jnp.float32)
  if m == 0:
    return acc.astype(out_dtype)
  def body(tm, tiles, i, acc):
    g, r0 = tiles.group[i], tiles.row[i]
    keep = tiles.owned(i, tm)
    # Zeroing the foreign rows of one operand removes them from the sum.
    x = jnp.where(keep[:, None], lax.dynamic_slice(lhs, (r0, 0), (tm, k)), 0)
    dy = lax.dynamic_slice(grad, (r0, 0), (tm, n))
    upd = lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
    cur = lax.dynamic_index_in_dim(acc, g, keepdims=False)
    return lax.dynamic_update_index_in_dim(acc, cur + upd, g, 0)

  for tm, tiles in _plans(group_sizes, m, tile_m, tile_small):
    acc = lax.fori_loop(0, tiles.num_tiles, functools.partial(body, tm, tiles), acc)
  return acc.astype(out_dtype)


# --- The permutation folded into the tile loads and stores. ------------------
#
# The same tiles as above; only where a tile's rows come from or go to
# changes: a gather x[rows[tile]] from the [T, k] token operand instead of a
# slice of a materialised [m, k] copy, or a scatter-add into [T, n] instead
# of a slice store. Foreign rows of a tile (another group's, or re-read by a
# clamped tile) are mapped to the out-of-range row T: they gather zeros and
# scatter nowhere, as in fused.py. ``rows`` holds only [0, T] (the entry
# point cleaned it).


def _take(a, idx):
  return jnp.take(a, idx, axis=0, mode="fill", fill_value=0)


def _scaled(y, scale, r0, tm):
  if scale is None:
    return y
  return y * lax.dynamic_slice_in_dim(scale, r0, tm)[:, None].astype(jnp.float32)


def _width(rhs, transpose_rhs):
  return rhs.shape[1] if transpose_rhs else rhs.shape[2]


def _dot_rhs(a, rhs, g, transpose_rhs):
  w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
  return lax.dot_general(a, w, (contract, ((), ())), preferred_element_type=jnp.float32)


def blocked_gather_gmm(x, rows, rhs: tuple, group_sizes, *, out_dtype, transpose_rhs=False,
                       row_scale=None, interpret=False, tile_m: int | None = None,
                       tile_small: int | None = None) -> tuple:
  """(out_i[m, n_i]): row r is scale[r] * x[rows[r]] @ rhs_i[g(r)], x [T, k].

  A tile's rows are gathered once and multiplied by every rhs_i (gate and up
  share one gather).
  """
  del interpret
  m = rows.shape[0]
  outs = tuple(jnp.zeros((m, _width(r, transpose_rhs)), out_dtype) for r in rhs)
  if m == 0:
    return outs

  def body(tm, tiles, i, outs):
    g, r0 = tiles.group[i], tiles.row[i]
    xt = _take(x, lax.dynamic_slice_in_dim(rows, r0, tm))  # the store drops foreign rows
    keep = tiles.owned(i, tm)[:, None]
    new = []
    for out, r in zip(outs, rhs):
      y = _scaled(_dot_rhs(xt, r, g, transpose_rhs), row_scale, r0, tm).astype(out_dtype)
      old = lax.dynamic_slice_in_dim(out, r0, tm)
      new.append(lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), r0, 0))
    return tuple(new)

  for tm, tiles in _plans(group_sizes, m, tile_m, tile_small):
    outs = lax.fori_loop(0, tiles.num_tiles, functools.partial(body, tm, tiles), outs)
  return outs


def blocked_scatter_gmm(h: tuple, rhs: tuple, group_sizes, rows, row_scale, num_out: int, *,
                        out_dtype, transpose_rhs=False, interpret=False,
                        tile_m: int | None = None, tile_small: int | None = None):
  """y[T, n]: y[rows[r]] += scale[r] * sum_i h_i[r] @ rhs_i[g(r)], one float32
  scatter-add per tile (the sum over i before it)."""
  del interpret
  m = h[0].shape[0]
  y = jnp.zeros((num_out, _width(rhs[0], transpose_rhs)), jnp.float32)
  if m == 0:
    return y.astype(out_dtype)

  def body(tm, tiles, i, y):
    g, r0 = tiles.group[i], tiles.row[i]
    yt = sum(_dot_rhs(lax.dynamic_slice_in_dim(a, r0, tm), r, g, transpose_rhs)
             for a, r in zip(h, rhs))
    tok = jnp.where(tiles.owned(i, tm), lax.dynamic_slice_in_dim(rows, r0, tm), num_out)
    return y.at[tok].add(_scaled(yt, row_scale, r0, tm), mode="drop")

  for tm, tiles in _plans(group_sizes, m, tile_m, tile_small):
    y = lax.fori_loop(0, tiles.num_tiles, functools.partial(body, tm, tiles), y)
  return y.astype(out_dtype)


def _tile_rows(a, rows, r0, tm, keep):
  """[tm, *] rows r0.. of the layout: gathered through ``rows`` (foreign rows:
  zeros) or sliced from an [m, *] operand (foreign rows kept)."""
  if rows is None:
    return lax.dynamic_slice_in_dim(a, r0, tm), False
  idx = jnp.where(keep, lax.dynamic_slice_in_dim(rows, r0, tm), a.shape[0])
  return _take(a, idx), True


def blocked_gather_tgmm(lhs, grad: tuple, group_sizes, *, out_dtype, lhs_rows=None,
                        grad_rows=None, grad_scale=None, interpret=False,
                        tile_m: int | None = None, tile_small: int | None = None) -> tuple:
  """(out_i[G, k, n_i]) = per group sum_r lhs(r)^T (scale[r] grad_i(r)), lhs
  and/or the grads gathered through ``*_rows`` [m] from [T, *] arrays; a
  tile's lhs rows are loaded once for every grad_i."""
  del interpret
  m = (lhs_rows if lhs_rows is not None else grad_rows if grad_rows is not None
       else lhs).shape[0]
  accs = tuple(jnp.zeros((group_sizes.shape[0], lhs.shape[1], b.shape[1]), jnp.float32)
               for b in grad)
  if m == 0:
    return tuple(a.astype(out_dtype) for a in accs)

  def body(tm, tiles, i, accs):
    g, r0 = tiles.group[i], tiles.row[i]
    keep = tiles.owned(i, tm)
    x, x_masked = _tile_rows(lhs, lhs_rows, r0, tm, keep)
    new = []
    for acc, b in zip(accs, grad):
      dy, dy_masked = _tile_rows(b, grad_rows, r0, tm, keep)
      if grad_scale is not None:
        dy = _scaled(dy.astype(jnp.float32), grad_scale, r0, tm).astype(b.dtype)
      if not (x_masked or dy_masked):  # zeroing one operand's foreign rows suffices
        dy = jnp.where(keep[:, None], dy, 0)
      upd = lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
      cur = lax.dynamic_index_in_dim(acc, g, keepdims=False)
      new.append(lax.dynamic_update_index_in_dim(acc, cur + upd, g, 0))
    return tuple(new)

  for tm, tiles in _plans(group_sizes, m, tile_m, tile_small):
    accs = lax.fori_loop(0, tiles.num_tiles, functools.partial(body, tm, tiles), accs)
  return tuple(a.astype(out_dtype) for a in accs)


BACKEND = gmm_lib.Backend(
    name="blocked", gmm=blocked_gmm, tgmm=blocked_tgmm,
    needs="nothing (portable XLA; tuned for CPU)",
    # auto's choice on CPU, where ragged_dot is a dense masked matmul over all
    # G groups (G x the FLOPs); the gmm benchmark suite (bench --suite=gmm)
    # compares the two. Exact everywhere.
    auto_on=("cpu",),
    gather_gmm=blocked_gather_gmm, scatter_gmm=blocked_scatter_gmm,
    gather_tgmm=blocked_gather_tgmm,
    # fused.py imports only tiling, so this arrow runs one way.
    # No auto_large_groups (shape rule): the layer suite (bench --suite=layer
    # --shapes=coarse,e8k8,fine,e32k2) found whole_group's batched matmuls
    # slower than this tiled loop at every shape it measured on CPU, the
    # large-group ones included (docs/benchmarks.md).
    fused_ffn=fused_lib.blocked_ffn)

gmm_lib.register_backend(BACKEND)
