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

The loop carries the full output, which XLA updates in place
(dynamic-update-slice on a loop carry). Tile defaults:
``tiling.DEFAULT_TILE_M`` / ``tiling.DEFAULT_TILE_SMALL``, shared with the
fused FFN (docs/execution.md has the measurements).
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


def blocked_gather_gmm(x, rows, rhs, group_sizes, *, out_dtype, transpose_rhs=False,
                       row_scale=None, interpret=False, tile_m: int | None = None,
                       tile_small: int | None = None):
  """out[m, n]: row r is scale[r] * x[rows[r]] @ rhs[g(r)], x [T, k] gathered per tile."""
  del interpret
  m, k = rows.shape[0], x.shape[1]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out = jnp.zeros((m, n), out_dtype)
  if m == 0:
    return out
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  def body(tm, tiles, i, out):
    g, r0 = tiles.group[i], tiles.row[i]
    xt = _take(x, lax.dynamic_slice_in_dim(rows, r0, tm))  # the store drops foreign rows
    w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)
    y = lax.dot_general(xt, w, (contract, ((), ())), preferred_element_type=jnp.float32)
    y = _scaled(y, row_scale, r0, tm).astype(out_dtype)
    old = lax.dynamic_slice(out, (r0, 0), (tm, n))
    keep = tiles.owned(i, tm)
    return lax.dynamic_update_slice(out, jnp.where(keep[:, None], y, old), (r0, 0))

  for tm, tiles in _plans(group_sizes, m, tile_m, tile_small):
    out = lax.fori_loop(0, tiles.num_tiles, functools.partial(body, tm, tiles), out)
  return out


def blocked_scatter_gmm(h, rhs, group_sizes, rows, row_scale, num_out: int, *, out_dtype,
                        transpose_rhs=False, interpret=False, tile_m: int | None = None,
                        tile_small: int | None = None):
  """y[T, n]: y[rows[r]] += scale[r] * h[r] @ rhs[g(r)], a float32 scatter-add per tile."""
  del interpret
  m, k = h.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  y = jnp.zeros((num_out, n), jnp.float32)
  if m == 0:
    return y.astype(out_dtype)
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  def body(tm, tiles, i, y):
    g, r0 = tiles.group[i], tiles.row[i]
    ht = lax.dynamic_slice(h, (r0, 0), (tm, k))
    w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)
    yt = _scaled(lax.dot_general(ht, w, (contract, ((), ())),
                                 preferred_element_type=jnp.float32), row_scale, r0, tm)
    tok = jnp.where(tiles.owned(i, tm), lax.dynamic_slice_in_dim(rows, r0, tm), num_out)
    return y.at[tok].add(yt, mode="drop")

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


def blocked_gather_tgmm(lhs, grad, group_sizes, *, out_dtype, lhs_rows=None, grad_rows=None,
                        grad_scale=None, interpret=False, tile_m: int | None = None,
                        tile_small: int | None = None):
  """out[G, k, n] = sum over group g's rows r of lhs(r)^T (scale[r] grad(r)), either
  operand gathered through its ``*_rows`` [m] from a [T, *] array."""
  del interpret
  m = (lhs_rows if lhs_rows is not None else grad_rows if grad_rows is not None
       else lhs).shape[0]
  k, n = lhs.shape[1], grad.shape[1]
  acc = jnp.zeros((group_sizes.shape[0], k, n), jnp.float32)
  if m == 0:
    return acc.astype(out_dtype)

  def body(tm, tiles, i, acc):
    g, r0 = tiles.group[i], tiles.row[i]
    keep = tiles.owned(i, tm)
    x, x_masked = _tile_rows(lhs, lhs_rows, r0, tm, keep)
    dy, dy_masked = _tile_rows(grad, grad_rows, r0, tm, keep)
    if grad_scale is not None:
      dy = _scaled(dy.astype(jnp.float32), grad_scale, r0, tm).astype(grad.dtype)
    if not (x_masked or dy_masked):  # zeroing one operand's foreign rows suffices
      x = jnp.where(keep[:, None], x, 0)
    upd = lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    cur = lax.dynamic_index_in_dim(acc, g, keepdims=False)
    return lax.dynamic_update_index_in_dim(acc, cur + upd, g, 0)

  for tm, tiles in _plans(group_sizes, m, tile_m, tile_small):
    acc = lax.fori_loop(0, tiles.num_tiles, functools.partial(body, tm, tiles), acc)
  return acc.astype(out_dtype)


BACKEND = gmm_lib.Backend(
    name="blocked", gmm=blocked_gmm, tgmm=blocked_tgmm,
    needs="nothing (portable XLA; tuned for CPU)",
    # auto's choice on CPU: docs/execution.md's grouped-matmul suite measures it
    # ~46x faster than ragged_dot's dense masked matmul there; exact everywhere.
    auto_on=("cpu",),
    gather_gmm=blocked_gather_gmm, scatter_gmm=blocked_scatter_gmm,
    gather_tgmm=blocked_gather_tgmm,
    # fused.py imports only tiling, so this arrow runs one way.
    fused_ffn=fused_lib.blocked_ffn)
