"""Group and row-tile metadata shared by the grouped-matmul backends.

Legend: m rows of the grouped operand (token copies sorted by expert), G
groups (experts), NT a static bound on the number of row tiles, tm the row
tile.

A grouped matmul sees ``group_sizes int32[G]``: group g owns the contiguous
rows ``[starts[g], ends[g])``. Rows past ``sum(group_sizes)`` belong to no
group. Two tilings cover the groups with fixed-size row tiles, so that every
kernel works on static shapes while skipping the work of absent rows:

* :func:`group_tiles` starts each group on a fresh tile (tiles may spill into
  the next group and are masked there; the last tile of the operand is
  clamped back inside it): the XLA ``blocked`` backend.
* :func:`expert_tiles` gives each group its full tm-row tiles and *one*
  remainder tile whose size is the remainder rounded up to the next of a
  few static sizes (:func:`remainder_sizes`: grain multiples plus fine
  steps near the balanced group size), with the groups listed by size class
  so that one loop per class runs exactly its tiles: the fused FFN
  (``fused.py``), whose fixed per-tile cost makes a tile worth padding a
  few dozen rows.
* :func:`grid_tiles` keeps tiles on a fixed ``tm`` grid and visits a tile
  once per group that overlaps it (megablox): the Pallas kernels, whose
  BlockSpecs need tile-aligned row blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

# Row tiles of the blocked gmm (:func:`group_tiles`): full tm-row tiles, then
# the remainder of each group in ts-row tiles. Larger tiles run the matmul
# nearer its peak rate, smaller remainder tiles waste fewer padded rows; the
# gmm benchmark suite (``bench --suite=gmm``) chose the pair.
DEFAULT_TILE_M = 256
DEFAULT_TILE_SMALL = 64
# The fused FFN's tiles (:func:`expert_tiles`, sized by :func:`fused_tiles`):
# at least 512-row tiles, up to FUSED_TILE_MAX when the balanced group is that
# large, remainders in one tile of a multiple of the grain (64 rows, or tm/16).
# Each tile pays a fixed cost (weight-gradient accumulator adds, per-op
# dispatch) on top of its rows, so fewer, larger tiles win until the padding
# of the last tile outweighs it; the layer and scaling benchmark suites
# (``bench --suite=layer``, ``--suite=scaling``) chose these values.
FUSED_TILE_M = 512
FUSED_TILE_MAX = 2048
FUSED_TILE_GRAIN = 64
# Fine remainder sizes (:func:`remainder_sizes`): a 16-row step around the
# balanced group size, for operands of at least FINE_MIN_ROWS rows.
FUSED_TILE_FINE = 16
FINE_MIN_ROWS = 2048


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pow2_at_least(n: int) -> int:
  """The smallest power of two >= n, for n >= 1: Triton block sizes."""
  return 1 << max(0, (int(n) - 1).bit_length())


def clamp_group_sizes(group_sizes: jax.Array, m: int) -> jax.Array:
  """int32[G] sizes whose running sum never exceeds m.

  Under ``jit`` the sizes are traced and an overflow cannot raise, so every
  backend truncates the groups at row m (the later groups shrink, possibly to
  0) instead of reading past the operand.
  """
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32)).astype(jnp.int32)


def group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(starts int32[G], ends int32[G]): the row range of each group."""
  ends = jnp.cumsum(group_sizes).astype(jnp.int32)
  return ends - group_sizes, ends


@struct.dataclass
class GroupTiles:
  """Row tiles that start at group boundaries.

  Attributes:
    group: int32[NT] group of tile i (valid for i < num_tiles).
    row: int32[NT] first row read by tile i, clamped to m - tm so the tile
      stays inside the operand.
    lo: int32[NT] first row tile i owns (its unclamped start). A clamped tile
      re-reads rows the group's previous tile owns; accumulating kernels
      must skip them, so ownership is [lo, end of the group).
    num_tiles: int32[] tiles in use; sum_g ceil(size_g / tm) <= NT.
    ends: int32[G] end row of each group.
    offsets: int32[G + 1] the tiles of group g are
      ``[offsets[g], offsets[g + 1])`` (loops that walk one group at a time).
  """

  group: jax.Array
  row: jax.Array
  lo: jax.Array
  num_tiles: jax.Array
  ends: jax.Array
  offsets: jax.Array

  def owned(self, i: jax.Array, tm: int) -> jax.Array:
    """bool[tm]: which rows read by tile i it owns."""
    rows = self.row[i] + jnp.arange(tm, dtype=jnp.int32)
    return (rows >= self.lo[i]) & (rows < self.ends[self.group[i]])


def group_tiles(group_sizes: jax.Array, m: int, tm: int,
                ts: int | None = None) -> list[tuple[int, GroupTiles]]:
  """[(tile rows, tiles)]: each group cut into tiles from its first row.

  With ``ts`` (< tm), a group gets size // tm full tm-row tiles and its
  remainder ceil((size mod tm) / ts) tiles of ts rows, so the rows read past
  a group are < ts per group while the bulk runs in tm-row matmuls. Without
  it every tile has tm rows (waste < tm per group).

  Static bounds: sum_g ceil(size_g / t) <= m / t + G tiles of t rows; the
  loops run only ``num_tiles`` of them.
  """
  if tm > m:
    raise ValueError(f"row tile tm={tm} exceeds m={m}; use tm <= m")
  starts, ends = group_bounds(group_sizes)
  if ts is None or ts >= tm:
    bound = cdiv(m, tm) + group_sizes.shape[0]
    return [(tm, _tiles(starts, ends, (group_sizes + tm - 1) // tm, m, tm, bound))]
  big = group_sizes // tm
  rest = group_sizes - big * tm
  num_groups = group_sizes.shape[0]
  nt_small = min(cdiv(m, ts) + num_groups, num_groups * cdiv(tm, ts))
  return [(tm, _tiles(starts, ends, big, m, tm, m // tm)),
          (ts, _tiles(starts + big * tm, ends, (rest + ts - 1) // ts, m, ts, nt_small))]


def _tiles(first, ends, per_group, m, t, bound) -> GroupTiles:
  """Tiles of t rows from row first[g], per_group[g] of them per group."""
  num_groups = first.shape[0]
  tile_end = jnp.cumsum(per_group).astype(jnp.int32)
  tile_begin = tile_end - per_group
  i = jnp.arange(max(bound, 1), dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), num_groups - 1).astype(jnp.int32)
  lo = (first[g] + (i - tile_begin[g]) * t).astype(jnp.int32)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), tile_end])
  return GroupTiles(group=g, row=jnp.minimum(lo, m - t), lo=lo,
                    num_tiles=tile_end[-1], ends=ends, offsets=offsets)


@struct.dataclass
class ExpertTiles:
  """Per group: ``full[g]`` tm-row tiles from its first row, then at most one
  remainder tile of ``sizes[c]`` rows.

  Attributes:
    starts, ends: int32[G] the row range of each group.
    full: int32[G] full tiles of group g (rows ``starts[g] + i * tm``); they
      lie inside the group, so they need no row mask.
    rest_lo: int32[G] first row of the remainder (``starts + full * tm``).
    size_class: int32[G] index into ``sizes`` of the remainder tile; -1 when
      the size is a multiple of tm (no remainder tile).
    by_class: int32[G] the groups with a remainder tile, sorted by size class
      (groups in order inside a class); class c's are
      ``by_class[class_start[c]:class_start[c + 1]]``. A loop per class runs
      exactly its tiles, so a size class costs compile time, not run time.
    class_start: int32[C + 1] offsets into ``by_class``.
    with_full: int32[G] the groups with full tiles first (in order), then the
      rest; ``num_with_full`` of them.
    num_with_full: int32[] groups with at least one full tile.
    sizes: static tile sizes of the remainder classes (ascending; tm and
      below, then any fold sizes above tm), clamped to m.
    tm: static full-tile rows; m: static operand rows.
  """

  starts: jax.Array
  ends: jax.Array
  full: jax.Array
  rest_lo: jax.Array
  size_class: jax.Array
  by_class: jax.Array
  class_start: jax.Array
  with_full: jax.Array
  num_with_full: jax.Array
  sizes: tuple = struct.field(pytree_node=False)
  tm: int = struct.field(pytree_node=False)
  m: int = struct.field(pytree_node=False)

  def rest_tile(self, g: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """(first row read, bool[size] rows owned) of group g's remainder tile of
    ``size`` rows; clamped back inside the operand like :class:`GroupTiles`."""
    r0 = jnp.minimum(self.rest_lo[g], self.m - size)
    rows = r0 + jnp.arange(size, dtype=jnp.int32)
    return r0, (rows >= self.rest_lo[g]) & (rows < self.ends[g])


def remainder_sizes(m: int, num_groups: int, tm: int, grain: int,
                    fine: int = 0) -> tuple[int, ...]:
  """The static remainder-tile sizes: multiples of ``grain`` up to tm, plus,
  with ``fine`` (< grain) and an operand of >= FINE_MIN_ROWS rows, four
  multiples of ``fine`` around the remainder a balanced group would have.

  Why the fine sizes: with many small experts every group is one remainder
  tile and the grain's rounding is the waste (E=512 at T=8192, K=8: groups of
  128 +- 11 rows, half of them run as 192-row tiles, 23% padding). Balanced
  routing puts the remainders near (m / G) mod tm, so a few sizes there cut
  the padding to < ``fine`` rows for most groups; any other remainder still
  has its grain size. Each size compiles its own tile loop, hence the few
  sizes and none for small operands, where compile time dominates.

  When the balanced remainder is small (< tm / 4: groups of ~tm, 2 tm, ...
  rows), the sizes sit just above tm instead (``tm + r``): a group with a
  few rows past a multiple of tm runs its last full tile and those rows as
  one tile rather than paying a near-empty tile's fixed cost
  (:func:`expert_tiles` folds them; sizes > tm are the fold's).
  """
  sizes = {min(k * grain, tm) for k in range(1, cdiv(tm, grain) + 1)}
  mean = m / max(num_groups, 1)
  if 0 < fine < grain and m >= FINE_MIN_ROWS and num_groups:
    centre = cdiv(round(mean) % tm, fine) * fine
    if mean >= tm and centre < tm // 4:
      centre += tm
    sizes |= {s for s in (centre + fine * j for j in (-1, 0, 1, 2)) if 0 < s != tm}
  return tuple(sorted({min(s, m) for s in sizes}))


def expert_tiles(group_sizes: jax.Array, m: int, tm: int, grain: int,
                 fine: int = 0) -> ExpertTiles:
  """Full tm-row tiles per group, the remainder in one tile rounded up to the
  next of :func:`remainder_sizes`.

  Waste < grain rows per group (< fine near the balanced size) and at most
  one partial tile per group, so a group of n rows costs n // tm + 1 tiles
  (n < tm: one tile). With sizes above tm (``tm + X`` the largest), a group
  whose rows past a multiple of tm are at most X runs its last full tile and
  those rows as one remainder tile: n // tm tiles.
  """
  if not 1 <= grain <= tm <= max(m, 1):
    raise ValueError(f"tiles need 1 <= grain <= tm <= m; got grain={grain}, tm={tm}, "
                     f"m={m}. Fix: use fit_tiles")
  num_groups = group_sizes.shape[0]
  starts, ends = group_bounds(group_sizes)
  sizes = remainder_sizes(m, num_groups, tm, grain, fine)
  full = (group_sizes // tm).astype(jnp.int32)
  rest = group_sizes - full * tm
  fold = (full > 0) & (rest > 0) & (rest <= max(sizes) - tm)
  full, rest = full - fold, rest + fold * tm
  # First size >= rest: rest < tm or rest <= max(sizes) (folded), so in range.
  cls = jnp.sum(jnp.asarray(sizes, jnp.int32)[None, :] < rest[:, None], axis=1)
  cls = jnp.where(rest > 0, cls, -1).astype(jnp.int32)
  # Groups without a remainder sort last (key C), past class_start[C].
  by_class = jnp.argsort(jnp.where(cls < 0, len(sizes), cls), stable=True).astype(jnp.int32)
  counts = jnp.sum(cls[None, :] == jnp.arange(len(sizes), dtype=jnp.int32)[:, None], axis=1)
  class_start = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                 jnp.cumsum(counts).astype(jnp.int32)])
  with_full = jnp.argsort(full == 0, stable=True).astype(jnp.int32)
  return ExpertTiles(starts=starts, ends=ends, full=full,
                     rest_lo=(starts + full * tm).astype(jnp.int32), size_class=cls,
                     by_class=by_class, class_start=class_start, with_full=with_full,
                     num_with_full=jnp.sum(full > 0).astype(jnp.int32),
                     sizes=sizes, tm=tm, m=m)


def fit_tiles(m: int, tile_m: int | None = None, tile_small: int | None = None,
              defaults: tuple[int, int] = (DEFAULT_TILE_M, DEFAULT_TILE_SMALL)
              ) -> tuple[int, int]:
  """(tm, ts) for an operand of m rows: the defaults or the given sizes,
  clamped to 1 <= ts <= tm <= max(m, 1)."""
  tm = max(1, min(int(defaults[0] if tile_m is None else tile_m), m))
  ts = max(1, min(int(defaults[1] if tile_small is None else tile_small), tm))
  return tm, ts


def fused_tiles(m: int, num_groups: int, tile_m: int | None = None,
                tile_small: int | None = None) -> tuple[int, int]:
  """(tm, grain) of the fused FFN for m rows in num_groups groups.

  Unless given, tm is the largest power of two <= the balanced group size
  m / G, within [FUSED_TILE_M, FUSED_TILE_MAX], and the grain is
  max(FUSED_TILE_GRAIN, tm / 16). Why: a tile's fixed cost (its
  weight-gradient accumulator adds and per-op dispatch) is paid per tile, so
  groups of >= 1024 rows (few experts, or many tokens) run fewer, larger
  tiles (the layer suite's coarse shape, E=8, K=2, chose the upper bound).
  The grain grows with tm because every multiple of it up to tm is a
  remainder size with its own compiled loop: a fixed 64-row grain would
  give 32 loops at tm = 2048 and so much longer compiles.
  """
  tm = tile_m
  if tm is None:
    mean, tm = m // max(num_groups, 1), FUSED_TILE_M
    while tm * 2 <= min(mean, FUSED_TILE_MAX):
      tm *= 2
  grain = max(FUSED_TILE_GRAIN, int(tm) // 16) if tile_small is None else tile_small
  return fit_tiles(m, tm, grain)


@struct.dataclass
class GridTiles:
  """Megablox-style visit list over a fixed grid of tm-row tiles.

  Attributes:
    group_offsets: int32[G + 1] start row of each group, then the total.
    group_ids: int32[NT] group handled at visit i.
    m_tile_ids: int32[NT] row tile (in units of tm) read at visit i.
    num_tiles: int32[] visits in use; NT = m / tm + G - 1 bounds it. Visits
      past it repeat the last real visit so no new block is fetched.
  """

  group_offsets: jax.Array
  group_ids: jax.Array
  m_tile_ids: jax.Array
  num_tiles: jax.Array


def grid_tiles(group_sizes: jax.Array, m: int, tm: int,
               visit_empty_groups: bool = False) -> GridTiles:
  """Visits (group, row tile) in row order; a straddled tile is visited once
  per group it holds, consecutively, so an output block can stay resident.

  ``visit_empty_groups`` gives empty groups one visit (tgmm must write their
  zero gradient); it sits on the tile where the group would start.
  """
  if m % tm:
    raise ValueError(f"m={m} must be a multiple of the row tile tm={tm}")
  num_groups = group_sizes.shape[0]
  starts, ends = group_bounds(group_sizes)
  first = starts // tm
  last = jnp.maximum(cdiv_arr(ends, tm), first)  # exclusive
  visits = jnp.where(group_sizes > 0, last - first, 0)
  if visit_empty_groups:
    visits = jnp.where(group_sizes > 0, visits, 1)
  # Non-empty groups need at most m / tm + (#non-empty - 1) visits, and each
  # empty group one more, so the bound holds either way.
  nt = m // tm + num_groups - 1
  visit_end = jnp.cumsum(visits).astype(jnp.int32)
  visit_begin = visit_end - visits
  num_tiles = visit_end[-1]
  i = jnp.minimum(jnp.arange(nt, dtype=jnp.int32), jnp.maximum(num_tiles - 1, 0))
  g = jnp.minimum(jnp.searchsorted(visit_end, i, side="right"),
                  num_groups - 1).astype(jnp.int32)
  tile = jnp.minimum(first[g] + (i - visit_begin[g]), m // tm - 1)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  return GridTiles(group_offsets=offsets, group_ids=g,
                   m_tile_ids=tile.astype(jnp.int32), num_tiles=num_tiles)


def cdiv_arr(a: jax.Array, b: int) -> jax.Array:
  return (a + b - 1) // b
