"""Block shapes shared by the Pallas TPU kernels (``pallas_tpu``, ``pallas_tpu_folded``).

Legend: m grouped rows, k contraction width, n output width, tm / tk / tn
the block sizes, G groups.

Mosaic TPU blocks are (8, 128)-aligned (sublane x lane): a dimension that fits
in one block is padded to the alignment, a larger one to whole blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

DEFAULT_TILING = (128, 128, 128)  # (tm, tk, tn)


def fit(dim: int, tile: int, align: int) -> tuple[int, int]:
  """(tile, padded dim): the whole dim when it fits in one tile."""
  if dim <= tile:
    t = max(-(-dim // align) * align, align)
    return t, t
  return tile, -(-dim // tile) * tile


def pad2(a, rows, cols):
  """a [..., r, c] zero-padded to [..., rows, cols] (no copy when equal)."""
  r, c = a.shape[-2:]
  if (r, c) == (rows, cols):
    return a
  return jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, rows - r), (0, cols - c)])


def row_mask(offsets_ref, g, tile, tm):
  """bool[tm, 1]: which rows of row tile ``tile`` belong to group g
  (``offsets_ref`` int32[G + 1], the groups' start rows then the total)."""
  rows = tile * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
  return (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])
