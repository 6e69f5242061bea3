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


BACKEND = gmm_lib.Backend(
    name="blocked", gmm=blocked_gmm, tgmm=blocked_tgmm,
    needs="nothing (portable XLA; tuned for CPU)",
    # auto's choice on CPU: docs/execution.md's grouped-matmul suite measures it
    # ~46x faster than ragged_dot's dense masked matmul there; exact everywhere.
    auto_on=("cpu",))
