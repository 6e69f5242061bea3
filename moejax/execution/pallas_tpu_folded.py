"""``pallas_tpu`` with the dispatch permutation folded into the row loads and stores.

Legend: T rows of the token-side operand (tokens), m = len(rows) rows of the
grouped layout, k contraction width, n output width, G groups (experts);
(tm, tk, tn) the tile; NT = m / tm + G - 1 the static bound on (group, row
tile) visits (:func:`moejax.execution.tiling.grid_tiles`).

The three kernels of ``Backend.gather_gmm`` / ``scatter_gmm`` /
``gather_tgmm`` (contract in :class:`moejax.execution.gmm.Backend`; the
entry points with their custom VJPs are :mod:`moejax.execution.folded_gmm`,
the CPU reference semantics :mod:`moejax.execution.blocked`). Grids, visit
lists and the f32 VMEM accumulators are those of :mod:`pallas_tpu`'s
megablox-style gmm / tgmm; only where a tile's rows come from or go to
changes:

* gathered rows (``gather_gmm``'s x, ``gather_tgmm``'s lhs / grads): the
  token-side operand stays in HBM (``memory_space=ANY``), ``rows`` arrives in
  SMEM by scalar prefetch, and each grid step starts one row DMA per tile row
  (x[rows[r], k block] -> row r of a [tm, tk] VMEM scratch, as
  :mod:`pallas_gather`'s kernel does), waits for them, and zeroes the rows
  whose entry is T (absent) with a vector mask from the same rows as a
  [tm, 1] VMEM block. The DMA source of an absent row is clamped to row
  T - 1, so no copy of x padded with a zero row is needed. Traffic is
  pallas_gmm's: it also reloads the lhs block once per (n tile, visit).
  Several rhs (gate and up) are multiplied by the one gathered tile in the
  same grid step (outputs padded to one common width).
* ``scatter_gmm``: a visit computes its [tm, tn] f32 tile sum_i h_i @
  rhs_i[g] (the k tiles of every h_i run one after the other on the k grid
  axis), scales it by ``row_scale`` and read-add-writes it into the f32
  [T, n] output, which lives in HBM (ANY, aliased to a zeros input): per row
  a DMA of y[rows[r], n block] into VMEM, the add, a DMA back. The visit
  grid axis is sequential ("arbitrary") and each visit waits for its writes
  before the next one reads, so two visits never update the same output
  rows concurrently; only the n-tile axis is "parallel" (megacore), and its
  steps write disjoint columns. Rows of one visit that hit the same token
  (a token twice in one group) would race on one row, so they are split
  into rounds: ``rank[r]`` (computed outside the kernel) counts the earlier
  rows of the same tile and group with the same token, and round q moves
  the rows of rank q; a routing that never repeats a token inside a group
  runs one round. Foreign rows of a straddled tile and rows mapped to T
  issue no DMA.
* ``gather_tgmm``: pallas_tgmm's grid (k tiles, n tiles, visits) with the lhs
  and / or grad tiles gathered by DMA as above and the grad scaled by
  ``grad_scale`` (rounded to the grad dtype, as ``blocked`` does).

Row DMAs are not double-buffered: a step waits for its own rows before the
MXU work (the BlockSpec operands still pipeline). Prefetching the next
visit's rows during this visit's dot is the obvious next step once a TPU
can measure it.

Status: run in interpret mode (``interpret=True``, CPU) against the
``blocked`` backend and lowered for TPU (``lowering_platforms=("tpu",)``)
only; nothing here has run on TPU hardware. That lowering emits the Mosaic
kernel but does not run Mosaic's own compiler, whose layout rules (single
row DMAs into packed bf16 VMEM tiles, dynamic row offsets) are checked only
on a TPU; the interpreter runs the DMAs synchronously, so it checks the
round logic of the scatter but cannot show a race.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moejax.execution import gmm as gmm_lib
from moejax.execution import tiling as tiling_lib
from moejax.execution import tpu_blocks

DEFAULT_TILING = tpu_blocks.DEFAULT_TILING


def _tiles(interpret, tiling, m, k, n):
  """(tm, mp), (tk, kp), (tn, np_): TPU tiles are (8, 128)-aligned; the
  interpreter takes any size, so tiny test shapes are not padded there."""
  tm, tk, tn = tiling or DEFAULT_TILING
  lane = 1 if interpret else 128
  fits = tpu_blocks.fit(m, tm, 8), tpu_blocks.fit(k, tk, lane), tpu_blocks.fit(n, tn, lane)
  (tm, _), (tk, _), (tn, _) = fits
  if tm % 8 or tk % lane or tn % lane:
    raise gmm_lib.GmmError("pallas_tpu", f"tiling={tuple(tiling)} gives tiles (tm, tk, tn)="
                           f"{(tm, tk, tn)}, not multiples of (8, {lane}, {lane})",
                           "pass tiling=(tm, tk, tn) with tm a multiple of 8 and tk, tn "
                           "multiples of 128 (default (128, 128, 128))")
  return fits




def _layout_rows(rows, mp, num_rows):
  """int32[mp] rows padded with the absent row T; its [mp, 1] column too
  (the vector mask of the absent rows)."""
  rows = jnp.pad(rows.astype(jnp.int32), (0, mp - rows.shape[0]), constant_values=num_rows)
  return rows, rows[:, None]


def _scale_col(scale, mp):
  return jnp.pad(scale.astype(jnp.float32), (0, mp - scale.shape[0]))[:, None]


def _row_copies(hbm_ref, rows_ref, base, col0, width, vmem_ref, sems, num_rows, tm,
                when=None, to_hbm=False):
  """One DMA per tile row r < tm between hbm_ref[rows[base + r], col0:col0 +
  width] and vmem_ref[r] (into VMEM, or back with ``to_hbm``), all started
  before any is waited for; ``when(r)`` (a scalar bool) skips rows.

  An absent row (entry T) copies row T - 1 instead (reads only; the scatter
  never moves one): the caller masks it, which is cheaper than a copy of
  the operand padded with a zero row.
  """
  def copy(r):
    hbm = hbm_ref.at[pl.ds(jnp.minimum(rows_ref[base + r], num_rows - 1), 1),
                     pl.ds(col0, width)]
    vmem = vmem_ref.at[pl.ds(r, 1)]
    return pltpu.make_async_copy(*((vmem, hbm) if to_hbm else (hbm, vmem)), sems.at[r])

  def each(action):
    def body(r, carry):
      if when is None:
        action(copy(r))
      else:
        pl.when(when(r))(lambda: action(copy(r)))  # runs it under the condition
      return carry
    # A loop, not tm unrolled copies: the kernel body stays small at tm = 128.
    lax.fori_loop(0, tm, body, 0)

  each(lambda c: c.start())
  each(lambda c: c.wait())


def _dot(a, b, contract):
  return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


# --- gather_gmm: out_i[r] = scale[r] * x[rows[r]] @ rhs_i[g(r)]. ---------------

def _gather_gmm_kernel(offsets_ref, gids_ref, tids_ref, nt_ref, rows_ref, x_hbm, col_ref,
                       *refs, tm, tk, k_tiles, num_rhs, has_scale, transpose_rhs,
                       num_rows):
  scale_ref, refs = (refs[0], refs[1:]) if has_scale else (None, refs)
  rhs_refs, out_refs = refs[:num_rhs], refs[num_rhs:2 * num_rhs]
  xg_ref, sems, acc_ref = refs[2 * num_rhs:]
  i, kk = pl.program_id(1), pl.program_id(2)
  live = i < nt_ref[0]

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(live)
  def _():
    _row_copies(x_hbm, rows_ref, tids_ref[i] * tm, kk * tk, tk, xg_ref, sems, num_rows, tm)
    xt = jnp.where(col_ref[...] < num_rows, xg_ref[...], 0)
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    for a, w_ref in enumerate(rhs_refs):  # one gathered tile for every rhs
      acc_ref[a] += _dot(xt, w_ref[...], contract)

  @pl.when(live & (kk == k_tiles - 1))
  def _():
    keep = tpu_blocks.row_mask(offsets_ref, gids_ref[i], tids_ref[i], tm)
    for a, o_ref in enumerate(out_refs):
      y = acc_ref[a] if scale_ref is None else acc_ref[a] * scale_ref[...]
      o_ref[...] = jnp.where(keep, y.astype(o_ref.dtype), o_ref[...])


def gather_gmm(x, rows, rhs: tuple, group_sizes, *, out_dtype, transpose_rhs=False,
               row_scale=None, interpret=False, tiling=None) -> tuple:
  """(out_i[m, n_i]): row r is scale[r] * x[rows[r]] @ rhs_i[g(r)], x [T, k].

  rows int32[m] in [0, T] (T: absent, a zero row); rhs_i [G, k, n_i] ([G,
  n_i, k] with ``transpose_rhs``); rows past the groups hold anything.
  """
  num_rows, k = x.shape
  m, num_rhs, num_groups = rows.shape[0], len(rhs), group_sizes.shape[0]
  widths = [r.shape[1] if transpose_rhs else r.shape[2] for r in rhs]
  if m == 0 or num_rows == 0:
    return tuple(jnp.zeros((m, w), out_dtype) for w in widths)
  (tm, mp), (tk, kp), (tn, np_) = _tiles(interpret, tiling, m, k, max(widths))
  x = tpu_blocks.pad2(x, num_rows, kp)
  rhs = [tpu_blocks.pad2(r, np_, kp) if transpose_rhs else tpu_blocks.pad2(r, kp, np_)
         for r in rhs]
  rows, col = _layout_rows(rows, mp, num_rows)
  visits = tiling_lib.grid_tiles(group_sizes, mp, tm)
  k_tiles = kp // tk
  row_block = pl.BlockSpec((tm, 1), lambda j, i, kk, o, g, t, c, r: (t[i], 0))
  if transpose_rhs:
    rhs_spec = pl.BlockSpec((None, tn, tk), lambda j, i, kk, o, g, t, c, r: (g[i], j, kk))
  else:
    rhs_spec = pl.BlockSpec((None, tk, tn), lambda j, i, kk, o, g, t, c, r: (g[i], kk, j))
  scale = [] if row_scale is None else [_scale_col(row_scale, mp)]
  out_spec = pl.BlockSpec((tm, tn), lambda j, i, kk, o, g, t, c, r: (t[i], j))
  call = pl.pallas_call(
      functools.partial(_gather_gmm_kernel, tm=tm, tk=tk, k_tiles=k_tiles, num_rhs=num_rhs,
                        has_scale=bool(scale), transpose_rhs=transpose_rhs,
                        num_rows=num_rows),
      out_shape=[jax.ShapeDtypeStruct((mp, np_), out_dtype)] * num_rhs,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=5,
          grid=(np_ // tn, mp // tm + num_groups - 1, k_tiles),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY), row_block]
          + [row_block] * len(scale) + [rhs_spec] * num_rhs,
          out_specs=[out_spec] * num_rhs,
          scratch_shapes=[pltpu.VMEM((tm, tk), x.dtype), pltpu.SemaphoreType.DMA((tm,)),
                          pltpu.VMEM((num_rhs, tm, tn), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name="moejax_gather_gmm")
  outs = call(visits.group_offsets, visits.group_ids, visits.m_tile_ids,
              visits.num_tiles.reshape(1), rows, x, col, *scale, *rhs)
  return tuple(o[:m, :w] for o, w in zip(outs, widths))


# --- scatter_gmm: y[rows[r]] += scale[r] * sum_i h_i[r] @ rhs_i[g(r)]. ---------

def _dup_rank(rows, group_sizes, tm, num_rows):
  """int32[mp]: for each live row, how many earlier rows of its tm-row tile
  and group hold the same token (0 unless a token repeats inside a group);
  -1 for absent rows. The scatter moves rank q in its round q."""
  mp = rows.shape[0]
  group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(mp), side="right")
  rt, gt = rows.reshape(-1, tm), group.reshape(-1, tm)
  earlier = jnp.arange(tm)[None, :] < jnp.arange(tm)[:, None]  # [r, s]: s < r
  same = ((rt[:, :, None] == rt[:, None, :]) & (gt[:, :, None] == gt[:, None, :])
          & earlier[None])
  rank = jnp.sum(same, axis=2).reshape(mp).astype(jnp.int32)
  return jnp.where(rows < num_rows, rank, -1)


def _scatter_gmm_kernel(offsets_ref, gids_ref, tids_ref, nt_ref, rows_ref, rank_ref,
                        rounds_ref, *refs, tm, tn, k_spans, has_scale, transpose_rhs,
                        num_rows):
  num_h = len(k_spans)
  h_refs, rhs_refs = refs[:num_h], refs[num_h:2 * num_h]
  refs = refs[2 * num_h:]
  scale_ref, refs = (refs[0], refs[1:]) if has_scale else (None, refs)
  _, y_hbm, acc_ref, buf_ref, sems = refs  # y_in (aliased to y_hbm) is unused
  j, i, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  live = i < nt_ref[0]
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  for (lo, count), h_ref, w_ref in zip(k_spans, h_refs, rhs_refs):
    # The k tiles of h_0, h_1, ... follow each other on the k axis.
    @pl.when(live & (kk >= lo) & (kk < lo + count))
    def _(h_ref=h_ref, w_ref=w_ref):
      acc_ref[...] += _dot(h_ref[...], w_ref[...], contract)

  @pl.when(live & (kk == k_spans[-1][0] + k_spans[-1][1] - 1))
  def _():
    g, base = gids_ref[i], tids_ref[i] * tm
    tile = acc_ref[...] if scale_ref is None else acc_ref[...] * scale_ref[...]
    first, end = offsets_ref[g], offsets_ref[g + 1]

    def round_(q, carry):
      def mine(r):  # this visit's group, a live row, this round
        return (base + r >= first) & (base + r < end) & (rank_ref[base + r] == q)
      cols = pl.multiple_of(j * tn, tn)
      _row_copies(y_hbm, rows_ref, base, cols, tn, buf_ref, sems, num_rows, tm, when=mine)
      buf_ref[...] += tile  # rows not in this round are not written back
      _row_copies(y_hbm, rows_ref, base, cols, tn, buf_ref, sems, num_rows, tm, when=mine,
                  to_hbm=True)
      return carry

    lax.fori_loop(0, rounds_ref[0], round_, 0)


def scatter_gmm(h: tuple, rhs: tuple, group_sizes, rows, row_scale, num_out: int, *,
                out_dtype, transpose_rhs=False, interpret=False, tiling=None):
  """y[T, n]: y[rows[r]] += scale[r] * sum_i h_i[r] @ rhs_i[g(r)] (f32, one
  rounding to out_dtype); h_i [m, k_i], rhs_i [G, k_i, n] ([G, n, k_i]
  transposed), rows int32[m] in [0, T] (T adds nothing)."""
  m, num_groups = rows.shape[0], group_sizes.shape[0]
  n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
  if m == 0 or num_out == 0:
    return jnp.zeros((num_out, n), out_dtype)
  (tm, mp), _, (tn, np_) = _tiles(interpret, tiling, m, 1, n)
  k_spans, hs, ws, lo = [], [], [], 0
  for a, w in zip(h, rhs):
    _, (tk, kp), _ = _tiles(interpret, tiling, m, a.shape[1], n)
    hs.append(tpu_blocks.pad2(a, mp, kp))
    ws.append(tpu_blocks.pad2(w, np_, kp) if transpose_rhs else tpu_blocks.pad2(w, kp, np_))
    k_spans.append((lo, kp // tk, tk))
    lo += kp // tk
  rows, _ = _layout_rows(rows, mp, num_out)
  rank = _dup_rank(rows, group_sizes, tm, num_out)
  rounds = (jnp.max(rank) + 1).astype(jnp.int32).reshape(1)
  visits = tiling_lib.grid_tiles(group_sizes, mp, tm)

  def span(lo_, count):
    return lambda kk: jnp.clip(kk - lo_, 0, count - 1)  # held outside its span: no refetch

  h_specs, w_specs = [], []
  for lo_, count, tk in k_spans:
    at = span(lo_, count)
    h_specs.append(pl.BlockSpec((tm, tk), lambda j, i, kk, *s, at=at: (s[2][i], at(kk))))
    if transpose_rhs:
      w_specs.append(pl.BlockSpec((None, tn, tk),
                                  lambda j, i, kk, *s, at=at: (s[1][i], j, at(kk))))
    else:
      w_specs.append(pl.BlockSpec((None, tk, tn),
                                  lambda j, i, kk, *s, at=at: (s[1][i], at(kk), j)))
  scale = [] if row_scale is None else [_scale_col(row_scale, mp)]
  scale_specs = [pl.BlockSpec((tm, 1), lambda j, i, kk, *s: (s[2][i], 0))] * len(scale)
  operands = [*hs, *ws, *scale, jnp.zeros((num_out, np_), jnp.float32)]
  call = pl.pallas_call(
      functools.partial(_scatter_gmm_kernel, tm=tm, tn=tn,
                        k_spans=tuple((a, b) for a, b, _ in k_spans), has_scale=bool(scale),
                        transpose_rhs=transpose_rhs, num_rows=num_out),
      out_shape=jax.ShapeDtypeStruct((num_out, np_), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=7,
          grid=(np_ // tn, mp // tm + num_groups - 1, lo),
          in_specs=h_specs + w_specs + scale_specs + [pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec(memory_space=pl.ANY),  # rows read-add-written by DMA
          scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32),
                          pltpu.VMEM((tm, tn), jnp.float32), pltpu.SemaphoreType.DMA((tm,))]),
      # The visit axis must stay sequential: visits read-add-write the same
      # output rows (a token's copies in several groups), see the docstring.
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      input_output_aliases={7 + len(operands) - 1: 0},
      interpret=interpret,
      name="moejax_scatter_gmm")
  y = call(visits.group_offsets, visits.group_ids, visits.m_tile_ids,
           visits.num_tiles.reshape(1), rows, rank, rounds, *operands)
  return y[:, :n].astype(out_dtype)


# --- gather_tgmm: out_i[g] = sum_{r in g} lhs(r)^T (scale[r] grad_i(r)). -----

def _gather_tgmm_kernel(offsets_ref, gids_ref, tids_ref, nt_ref, lrows_ref, grows_ref,
                        *refs, tm, tk, tn, num_grads, num_visits, lhs_rows, grad_rows,
                        has_scale):
  lhs_ref, refs = refs[0], refs[1:]
  lcol_ref, refs = (refs[0], refs[1:]) if lhs_rows else (None, refs)
  grad_refs, refs = refs[:num_grads], refs[num_grads:]
  gcol_ref, refs = (refs[0], refs[1:]) if grad_rows else (None, refs)
  scale_ref, refs = (refs[0], refs[1:]) if has_scale else (None, refs)
  out_refs, refs = refs[:num_grads], refs[num_grads:]
  xg_ref, gg_ref, sems, acc_ref = refs
  a, b, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  g = gids_ref[i]
  live = i < nt_ref[0]
  first = (i == 0) | (g != gids_ref[jnp.maximum(i - 1, 0)])
  last = (i + 1 >= nt_ref[0]) | (g != gids_ref[jnp.minimum(i + 1, num_visits - 1)])

  @pl.when(first)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(live)
  def _():
    base = tids_ref[i] * tm
    keep = tpu_blocks.row_mask(offsets_ref, g, tids_ref[i], tm)
    if lhs_rows:
      _row_copies(lhs_ref, lrows_ref, base, a * tk, tk, xg_ref, sems, lhs_rows, tm)
      keep &= lcol_ref[...] < lhs_rows
    x_ref = xg_ref if lhs_rows else lhs_ref
    if grad_rows:
      keep &= gcol_ref[...] < grad_rows
    # Zeroing lhs's foreign and absent rows removes them from every sum.
    x = jnp.where(keep, x_ref[...], 0)
    for c, (d_ref, o_ref) in enumerate(zip(grad_refs, out_refs)):
      if grad_rows:
        _row_copies(d_ref, grows_ref, base, b * tn, tn, gg_ref.at[c], sems, grad_rows, tm)
        dy = gg_ref[c]
      else:
        dy = d_ref[...]
      if scale_ref is not None:
        dy = (dy.astype(jnp.float32) * scale_ref[...]).astype(dy.dtype)
      acc_ref[c] += _dot(x, dy, ((0,), (0,)))

  @pl.when(live & last)
  def _():
    for c, o_ref in enumerate(out_refs):
      o_ref[...] = acc_ref[c].astype(o_ref.dtype)


def gather_tgmm(lhs, grad: tuple, group_sizes, *, out_dtype, lhs_rows=None, grad_rows=None,
                grad_scale=None, interpret=False, tiling=None) -> tuple:
  """(out_i[G, k, n_i]) = per group sum_r lhs(r)^T (scale[r] grad_i(r)).

  lhs(r) = lhs[lhs_rows[r]] (lhs [T, k]) with ``lhs_rows``, else lhs[r]
  (lhs [m, k]); the same for the grads [T or m, n_i] with ``grad_rows``;
  row entries in [0, T] (T: absent, adds nothing). Groups without rows hold
  anything.
  """
  m = next(a for a in (lhs_rows, grad_rows, lhs) if a is not None).shape[0]
  k, num_groups, num_grads = lhs.shape[1], group_sizes.shape[0], len(grad)
  widths = [d.shape[1] for d in grad]
  if m == 0:
    return tuple(jnp.zeros((num_groups, k, w), out_dtype) for w in widths)
  (tm, mp), (tk, kp), (tn, np_) = _tiles(interpret, tiling, m, k, max(widths))
  # Gathered operands keep their T rows (padding columns only); the others
  # are padded to the layout's mp rows. 0 in the kernel's flags: not gathered.
  t_lhs = 0 if lhs_rows is None else lhs.shape[0]
  t_grad = 0 if grad_rows is None else grad[0].shape[0]
  if (t_lhs == 0 and lhs_rows is not None) or (t_grad == 0 and grad_rows is not None):
    return tuple(jnp.zeros((num_groups, k, w), out_dtype) for w in widths)  # no token rows
  lhs = tpu_blocks.pad2(lhs, t_lhs or mp, kp)
  grad = [tpu_blocks.pad2(d, t_grad or mp, np_) for d in grad]
  visits = tiling_lib.grid_tiles(group_sizes, mp, tm)
  nt = mp // tm + num_groups - 1
  prefetch = [visits.group_offsets, visits.group_ids, visits.m_tile_ids,
              visits.num_tiles.reshape(1)]
  col_spec = pl.BlockSpec((tm, 1), lambda a, b, i, *s: (s[2][i], 0))
  operands, specs = [lhs], []
  if lhs_rows is not None:
    lrows, lcol = _layout_rows(lhs_rows, mp, t_lhs)
    operands.append(lcol)
    specs += [pl.BlockSpec(memory_space=pl.ANY), col_spec]
  else:
    lrows = jnp.zeros((1,), jnp.int32)
    specs.append(pl.BlockSpec((tm, tk), lambda a, b, i, *s: (s[2][i], a)))
  operands += grad
  if grad_rows is not None:
    grows, gcol = _layout_rows(grad_rows, mp, t_grad)
    operands.append(gcol)
    specs += [pl.BlockSpec(memory_space=pl.ANY)] * num_grads + [col_spec]
  else:
    grows = jnp.zeros((1,), jnp.int32)
    specs += [pl.BlockSpec((tm, tn), lambda a, b, i, *s: (s[2][i], b))] * num_grads
  if grad_scale is not None:
    operands.append(_scale_col(grad_scale, mp))
    specs.append(col_spec)
  out_spec = pl.BlockSpec((None, tk, tn), lambda a, b, i, *s: (s[1][i], a, b))
  call = pl.pallas_call(
      functools.partial(_gather_tgmm_kernel, tm=tm, tk=tk, tn=tn, num_grads=num_grads,
                        num_visits=nt, lhs_rows=t_lhs, grad_rows=t_grad,
                        has_scale=grad_scale is not None),
      out_shape=[jax.ShapeDtypeStruct((num_groups, kp, np_), out_dtype)] * num_grads,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=6,
          grid=(kp // tk, np_ // tn, nt),
          in_specs=specs,
          out_specs=[out_spec] * num_grads,
          scratch_shapes=[pltpu.VMEM((tm, tk), lhs.dtype),
                          pltpu.VMEM((num_grads, tm, tn), grad[0].dtype),
                          pltpu.SemaphoreType.DMA((tm,)),
                          pltpu.VMEM((num_grads, tk, tn), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="moejax_gather_tgmm")
  outs = call(*prefetch, lrows, grows, *operands)
  return tuple(o[:, :k, :w] for o, w in zip(outs, widths))
