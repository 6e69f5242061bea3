"""``pallas_gpu``'s folded grouped matmuls: the dispatch gather / scatter in the row loads and stores.

Legend: T rows of the token-side operand (tokens), m rows of the grouped
layout (token copies sorted by group), G groups (experts), k contraction
width, n output width, NV = m / bm + G - 1 row-tile visits; (bm, bk, bn) the
tile, powers of two >= 16.

    gather_gmm:  out_i[m, n_i] , out_i[r] = scale[r] * x[rows[r]] @ rhs_i[g(r)]
    scatter_gmm: y[T, n]       , y[rows[r]] += scale[r] * sum_i h_i[r] @ rhs_i[g(r)]
    gather_tgmm: out_i[G, k, n_i] = per group sum_r lhs(r)^T (scale[r] grad_i(r))

The contract is :class:`moejax.execution.gmm.Backend`'s (``gather_gmm``,
``scatter_gmm``, ``gather_tgmm``); ``rows`` arrives cleaned, every entry in
[0, T], T meaning "no row" (:mod:`moejax.execution.folded_gmm`). The
semantics are those of the ``blocked`` backend's versions.

Design:

* **Triton, not Mosaic GPU.** The point of folding is that a tile's rows come
  from scattered token rows. Mosaic GPU moves tiles with TMA, which copies
  rectangular boxes: a row gather would be bm one-row copies (or Blackwell's
  TMA gather) plus barriers. Pallas' Triton lowering turns ``x_ref[idx,
  pl.ds(k0, bk)]`` into one pointer-array load (coalesced along k), the form
  MegaBlocks and tokamax use on GPU and :func:`~moejax.execution.pallas_gather.
  gather_rows_gpu` already uses; it also runs on any CUDA GPU Triton
  supports, not only Hopper.
* **Visits.** As in the Mosaic ``gmm``: row tiles on a fixed bm grid, a tile
  that straddles groups visited once per group
  (:func:`moejax.execution.tiling.grid_tiles`); each visit owns the rows
  [lo, hi) of its group inside its tile. The grid is (visit, n tile); dead
  visits (past the used ones) have lo == hi and do nothing.
* **The scatter adds atomically.** A token's K copies sit in K different
  groups, i.e. in different programs, so ``scatter_gmm`` adds each program's
  float32 [bm, bn] tile into a float32 [T + 1, n] buffer with
  ``atomic_add`` (row T collects nothing: masked lanes). The order in which
  the K contributions to a row land is decided by the hardware scheduler:
  the float32 sums are **not bitwise deterministic** run to run (the
  ``blocked`` backend's loop order is). The buffer is cast to the output
  dtype once at the end.
* **f32 operands are accepted** (unlike the Mosaic GPU gmm / tgmm, whose
  wgmma takes 16-bit operands only): f32 dots run with
  ``precision=HIGHEST`` (Triton's IEEE f32 path, not TF32), so the f32
  contract of exact products and f32 accumulation holds; 16-bit operands
  use the tensor cores with an f32 accumulator.
* **int32 offsets.** Pallas' Triton lowering computes element offsets in
  int32, so no operand may reach 2^31 elements (a full DeepSeek-V3 expert
  stack, 256 x 7168 x 2048, does); the kernels refuse such operands off
  interpret mode rather than wrap around.
* **Several rhs.** All rhs_i are multiplied with the one gathered x tile
  (gate and up share the gather). The grid spans the widest rhs's n tiles;
  a narrower rhs_i recomputes its last tile there and skips the store.

Interpretability: ``interpret=True`` runs the same kernels through Pallas'
interpreter on any platform. One hardware form sits behind ``interpret``:
the interpreter's atomic add has no mask and, with index arrays, keeps only
one of duplicate indices, so there the [bm, bn] atomic becomes a loop of
one-row adds. **No GPU was available when this was written: only interpret
mode (CPU) and lowering for ``cuda`` have been run, never the kernels on
GPU hardware.**
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from moejax.execution import gmm as gmm_lib
from moejax.execution import tiling as tiling_lib

try:  # Pallas' Triton backend; absent from unusual jax builds.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

DEFAULT_TILING = (64, 64, 64)  # (bm, bk, bn); nothing measured on hardware
MIN_BLOCK = 16  # Triton's dot wants every block dimension >= 16
NUM_WARPS, NUM_STAGES = 4, 2


def _blocks(tiling, m: int, k: int, n: int) -> tuple[int, int, int]:
  """(bm, bk, bn): ``tiling`` shrunk to the operand (tiny test shapes stay
  one block), never below MIN_BLOCK."""
  tiling = tuple(DEFAULT_TILING if tiling is None else tiling)
  if len(tiling) != 3 or any(int(t) < MIN_BLOCK or int(t) & (int(t) - 1) for t in tiling):
    raise gmm_lib.GmmError(
        "pallas_gpu", f"tiling={tiling} is not three powers of two >= {MIN_BLOCK}",
        f"pass tiling=(bm, bk, bn) such as {DEFAULT_TILING} (Triton blocks are "
        "powers of two; its dot needs >= 16)")
  return tuple(max(MIN_BLOCK, min(int(t), tiling_lib.pow2_at_least(d)))
               for t, d in zip(tiling, (m, k, n)))


def _check_offsets(interpret: bool, **operands) -> None:
  """Pallas' Triton lowering computes element offsets in int32: an operand of
  2^31 or more elements would wrap around on hardware (the interpreter does
  not, so interpret mode is not checked)."""
  if interpret:
    return
  for label, shape in operands.items():
    size = 1
    for d in shape:
      size *= int(d)
    if size >= 2 ** 31:
      raise gmm_lib.GmmError(
          "pallas_gpu", f"{label} has {size} elements (shape {tuple(shape)}); the "
          "Triton kernels index with int32 offsets (< 2^31 elements)",
          "shard the experts (expert parallelism) or split the call, or use "
          "backend='ragged_dot'")


def _pad(a, axis: int, multiple: int, value=0):
  size = a.shape[axis]
  target = tiling_lib.cdiv(size, multiple) * multiple
  if target == size:
    return a
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, target - size)
  return jnp.pad(a, pad, constant_values=value)


def _pad_rhs(rhs, transpose_rhs: bool, bk: int, bn: int):
  """rhs [G, k, n] (or [G, n, k]) padded to whole (bk, bn) blocks."""
  k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
  return _pad(_pad(rhs, k_axis, bk), n_axis, bn)


def _precision(dtype):
  # Triton's default for f32 operands is TF32 (10-bit mantissa products);
  # HIGHEST keeps IEEE f32, which the backend contract promises.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _params(interpret: bool):
  if interpret or pltriton is None:
    return None
  return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _visits(group_sizes, m_pad: int, bm: int):
  """(group, row-tile start, lo, hi) int32[NV] each: visit v multiplies rows
  [lo, hi) of tile ``start`` by group's rhs; dead visits have lo == hi."""
  gt = tiling_lib.grid_tiles(group_sizes, m_pad, bm)
  g = gt.group_ids
  r0 = gt.m_tile_ids * bm
  lo = jnp.maximum(gt.group_offsets[g], r0)
  hi = jnp.minimum(gt.group_offsets[g + 1], r0 + bm)
  live = jnp.arange(g.shape[0], dtype=jnp.int32) < gt.num_tiles
  hi = jnp.where(live, jnp.maximum(hi, lo), lo)
  return tuple(a.astype(jnp.int32) for a in (g, r0, lo, hi))


def _owned_rows(gid_ref, r0_ref, v, lo, hi, bm: int):
  """(g, r0, own) of visit v: its group, its tile's first row and bool[bm],
  which of the tile's rows the visit owns ([lo, hi))."""
  g, r0 = gid_ref[v], r0_ref[v]
  r = r0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)
  return g, r0, (r >= lo) & (r < hi)


def _rhs_block(rhs_ref, g, kk, nj, bk: int, bn: int, transpose_rhs: bool):
  """rhs[g]'s (bk, bn) block (k block kk, n block nj), [bn, bk] when transposed."""
  if transpose_rhs:
    return rhs_ref[g, pl.ds(nj * bn, bn), pl.ds(kk * bk, bk)]
  return rhs_ref[g, pl.ds(kk * bk, bk), pl.ds(nj * bn, bn)]


# --- gather_gmm: x's rows gathered in the lhs loads. -------------------------

def _gather_kernel(*refs, num_rhs: int, has_scale: bool, num_rows: int, tiles: tuple,
                   blocks: tuple, k_steps: int, transpose_rhs: bool, precision):
  bm, bk, bn = blocks
  gid_ref, r0_ref, lo_ref, hi_ref, rows_ref, *refs = refs
  scale_ref = refs.pop(0) if has_scale else None
  x_ref, rhs_refs, out_refs = refs[0], refs[1:1 + num_rhs], refs[1 + num_rhs:]
  v, j = pl.program_id(0), pl.program_id(1)
  lo, hi = lo_ref[v], hi_ref[v]

  @pl.when(hi > lo)
  def _():
    g, r0, own = _owned_rows(gid_ref, r0_ref, v, lo, hi, bm)
    src = rows_ref[pl.ds(r0, bm)]
    live = own & (src < num_rows)
    src = jnp.where(live, src, 0)  # row T ("no row") is never loaded
    cols = [jnp.minimum(j, t - 1) for t in tiles]

    def step(kk, accs):
      xa = x_ref[src, pl.ds(kk * bk, bk)]
      xa = jnp.where(live[:, None], xa, jnp.zeros_like(xa))
      return tuple(acc + pltriton.dot(xa, _rhs_block(w, g, kk, c, bk, bn, transpose_rhs),
                                trans_b=transpose_rhs, precision=precision)
                   for acc, w, c in zip(accs, rhs_refs, cols))

    accs = lax.fori_loop(0, k_steps, step,
                         tuple(jnp.zeros((bm, bn), jnp.float32) for _ in rhs_refs))
    if has_scale:
      scale = scale_ref[pl.ds(r0, bm)]
    for acc, o_ref, c, t in zip(accs, out_refs, cols, tiles):
      if has_scale:
        acc = acc * scale[:, None]
      mask = jnp.broadcast_to(own[:, None] & (j < t), (bm, bn))
      pltriton.store(o_ref.at[pl.ds(r0, bm), pl.ds(c * bn, bn)], acc.astype(o_ref.dtype),
                     mask=mask)


def gpu_gather_gmm(x, rows, rhs: tuple, group_sizes, *, out_dtype, transpose_rhs=False,
                   row_scale=None, interpret=False, tiling=None) -> tuple:
  """(out_i[m, n_i]): row r is scale[r] * x[rows[r]] @ rhs_i[g(r)], x [T, k].

  rows int32[m] in [0, T]; rows past the groups are left for the caller.
  """
  (t, k), m = x.shape, rows.shape[0]
  widths = [r.shape[1] if transpose_rhs else r.shape[2] for r in rhs]
  if m == 0 or t == 0:
    return tuple(jnp.zeros((m, w), out_dtype) for w in widths)
  bm, bk, bn = _blocks(tiling, m, k, max(widths))
  m_pad = tiling_lib.cdiv(m, bm) * bm
  rhs = [_pad_rhs(r, transpose_rhs, bk, bn) for r in rhs]
  tiles = tuple(tiling_lib.cdiv(w, bn) for w in widths)
  xp = _pad(x, 1, bk)
  _check_offsets(interpret, x=xp.shape, **{f"rhs[{i}]": r.shape for i, r in enumerate(rhs)},
                 out=(m_pad, max(tiles) * bn))
  args = [*_visits(group_sizes, m_pad, bm), _pad(rows, 0, bm, value=t)]
  if row_scale is not None:
    args.append(_pad(row_scale.astype(jnp.float32), 0, bm))
  kernel = functools.partial(
      _gather_kernel, num_rhs=len(rhs), has_scale=row_scale is not None, num_rows=t,
      tiles=tiles, blocks=(bm, bk, bn), k_steps=xp.shape[1] // bk,
      transpose_rhs=transpose_rhs, precision=_precision(x.dtype))
  outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((m_pad, nt * bn), out_dtype) for nt in tiles],
      grid=(args[0].shape[0], max(tiles)),
      compiler_params=_params(interpret), interpret=interpret,
      name="moejax_gather_gmm_gpu",
  )(*args, xp, *rhs)
  return tuple(o[:m, :w] for o, w in zip(outs, widths))


# --- scatter_gmm: output rows scatter-added in the stores. -------------------

def _scatter_kernel(*refs, num_lhs: int, has_scale: bool, num_out: int, blocks: tuple,
                    k_steps: tuple, transpose_rhs: bool, precision, interpret: bool):
  bm, bk, bn = blocks
  gid_ref, r0_ref, lo_ref, hi_ref, rows_ref, *refs = refs
  scale_ref = refs.pop(0) if has_scale else None
  h_refs, rhs_refs = refs[:num_lhs], refs[num_lhs:2 * num_lhs]
  y_ref = refs[-1]  # aliased to the zero-initialised input before it
  v, j = pl.program_id(0), pl.program_id(1)
  lo, hi = lo_ref[v], hi_ref[v]

  @pl.when(hi > lo)
  def _():
    g, r0, own = _owned_rows(gid_ref, r0_ref, v, lo, hi, bm)
    dst = rows_ref[pl.ds(r0, bm)]
    live = own & (dst < num_out)
    acc = jnp.zeros((bm, bn), jnp.float32)
    for h_ref, w_ref, steps in zip(h_refs, rhs_refs, k_steps):
      def step(kk, acc, h_ref=h_ref, w_ref=w_ref):
        a = h_ref[pl.ds(r0, bm), pl.ds(kk * bk, bk)]
        return acc + pltriton.dot(a, _rhs_block(w_ref, g, kk, j, bk, bn, transpose_rhs),
                            trans_b=transpose_rhs, precision=precision)
      acc = lax.fori_loop(0, steps, step, acc)
    if has_scale:
      acc = acc * scale_ref[pl.ds(r0, bm)][:, None]
    acc = jnp.where(live[:, None], acc, 0.0)
    dst = jnp.where(live, dst, num_out)  # the spare row T: masked lanes point there
    cols = pl.ds(j * bn, bn)
    if interpret:
      # The interpreter's atomic add takes no mask and, with an index array,
      # keeps one of duplicate rows: add one row at a time instead.
      def add_row(i, _):
        pltriton.atomic_add(y_ref, (dst[i], cols), lax.dynamic_index_in_dim(acc, i, 0, False))
      lax.fori_loop(0, bm, add_row, None)
    else:
      pltriton.atomic_add(y_ref, (dst, cols), acc,
                          mask=jnp.broadcast_to(live[:, None], (bm, bn)))


def gpu_scatter_gmm(h: tuple, rhs: tuple, group_sizes, rows, row_scale, num_out: int, *,
                    out_dtype, transpose_rhs=False, interpret=False, tiling=None):
  """y[T, n]: y[rows[r]] += scale[r] * sum_i h_i[r] @ rhs_i[g(r)], summed in
  float32 by atomic adds (order not deterministic), cast once."""
  m = h[0].shape[0]
  n = rhs[0].shape[1] if transpose_rhs else rhs[0].shape[2]
  if m == 0 or num_out == 0:
    return jnp.zeros((num_out, n), out_dtype)
  bm, bk, bn = _blocks(tiling, m, max(a.shape[1] for a in h), n)
  m_pad = tiling_lib.cdiv(m, bm) * bm
  h = [_pad(_pad(a, 0, bm), 1, bk) for a in h]
  rhs = [_pad_rhs(r, transpose_rhs, bk, bn) for r in rhs]
  n_pad = tiling_lib.cdiv(n, bn) * bn
  _check_offsets(interpret, **{f"h[{i}]": a.shape for i, a in enumerate(h)},
                 **{f"rhs[{i}]": r.shape for i, r in enumerate(rhs)}, y=(num_out + 1, n_pad))
  args = [*_visits(group_sizes, m_pad, bm), _pad(rows, 0, bm, value=num_out)]
  if row_scale is not None:
    args.append(_pad(row_scale.astype(jnp.float32), 0, bm))
  args += [*h, *rhs, jnp.zeros((num_out + 1, n_pad), jnp.float32)]
  kernel = functools.partial(
      _scatter_kernel, num_lhs=len(h), has_scale=row_scale is not None, num_out=num_out,
      blocks=(bm, bk, bn), k_steps=tuple(a.shape[1] // bk for a in h),
      transpose_rhs=transpose_rhs, precision=_precision(h[0].dtype), interpret=interpret)
  y = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_out + 1, n_pad), jnp.float32),
      grid=(args[0].shape[0], n_pad // bn),
      input_output_aliases={len(args) - 1: 0},
      compiler_params=_params(interpret), interpret=interpret,
      name="moejax_scatter_gmm_gpu",
  )(*args)
  return y[:num_out, :n].astype(out_dtype)


# --- gather_tgmm: per-group lhs^T grad, either side gathered. -----------------

def _gathered(ref, rows_ref, r, live, num_rows, cols):
  """[bm, width] rows r of the layout (zeros where not ``live``): through the
  row map ``rows_ref`` into a [T, *] ref, or straight from an [m, *] ref."""
  if rows_ref is not None:
    src = rows_ref[jnp.where(live, r, 0)]
    live = live & (src < num_rows)
    r = src
  a = ref[jnp.where(live, r, 0), cols]
  return jnp.where(live[:, None], a, jnp.zeros_like(a))


def _tgmm_kernel(*refs, num_grads: int, gathered: tuple, has_scale: bool, num_rows: tuple,
                 tiles: tuple, blocks: tuple, precision):
  bm, bk, bn = blocks
  starts_ref, ends_ref, *refs = refs
  lhs_rows_ref = refs.pop(0) if gathered[0] else None
  grad_rows_ref = refs.pop(0) if gathered[1] else None
  scale_ref = refs.pop(0) if has_scale else None
  lhs_ref, grad_refs, out_refs = refs[0], refs[1:1 + num_grads], refs[1 + num_grads:]
  g, ki, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[g], ends_ref[g]
  cols = [jnp.minimum(j, t - 1) for t in tiles]

  def step(b, accs):
    r = start + b * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    live = r < end
    a = _gathered(lhs_ref, lhs_rows_ref, r, live, num_rows[0], pl.ds(ki * bk, bk))
    if has_scale:
      scale = scale_ref[jnp.where(live, r, 0)]
    new = []
    for acc, d_ref, c in zip(accs, grad_refs, cols):
      d = _gathered(d_ref, grad_rows_ref, r, live, num_rows[1], pl.ds(c * bn, bn))
      if has_scale:  # scaled in f32, rounded back to the operand dtype (as blocked)
        d = (d.astype(jnp.float32) * scale[:, None]).astype(d_ref.dtype)
      new.append(acc + pltriton.dot(a, d, trans_a=True, precision=precision))
    return tuple(new)

  accs = lax.fori_loop(0, lax.div(end - start + bm - 1, jnp.int32(bm)), step,
                       tuple(jnp.zeros((bk, bn), jnp.float32) for _ in grad_refs))
  for acc, o_ref, c, t in zip(accs, out_refs, cols, tiles):
    @pl.when(j < t)
    def _(acc=acc, o_ref=o_ref, c=c):
      o_ref[g, pl.ds(ki * bk, bk), pl.ds(c * bn, bn)] = acc.astype(o_ref.dtype)


def gpu_gather_tgmm(lhs, grad: tuple, group_sizes, *, out_dtype, lhs_rows=None,
                    grad_rows=None, grad_scale=None, interpret=False, tiling=None) -> tuple:
  """(out_i[G, k, n_i]) = per group sum_r lhs(r)^T (scale[r] grad_i(r)); lhs and/or
  the grads gathered through ``*_rows`` int32[m] from [T, *] operands."""
  m = next(a for a in (lhs_rows, grad_rows, lhs) if a is not None).shape[0]
  num_groups, k = group_sizes.shape[0], lhs.shape[1]
  widths = [b.shape[1] for b in grad]
  if m == 0 or lhs.shape[0] == 0 or grad[0].shape[0] == 0:
    return tuple(jnp.zeros((num_groups, k, w), out_dtype) for w in widths)
  bm, bk, bn = _blocks(tiling, m, k, max(widths))
  tiles = tuple(tiling_lib.cdiv(w, bn) for w in widths)
  starts, ends = tiling_lib.group_bounds(group_sizes)
  args = [starts.astype(jnp.int32), ends.astype(jnp.int32)]
  args += [r for r in (lhs_rows, grad_rows) if r is not None]
  if grad_scale is not None:
    args.append(grad_scale.astype(jnp.float32))
  lhs_p = _pad(lhs, 1, bk)
  grad = [_pad(b, 1, bn) for b in grad]
  _check_offsets(interpret, lhs=lhs_p.shape,
                 **{f"grad[{i}]": b.shape for i, b in enumerate(grad)},
                 out=(num_groups, lhs_p.shape[1], max(tiles) * bn))
  args += [lhs_p, *grad]
  kernel = functools.partial(
      _tgmm_kernel, num_grads=len(grad), gathered=(lhs_rows is not None, grad_rows is not None),
      has_scale=grad_scale is not None, num_rows=(lhs.shape[0], grad[0].shape[0]),
      tiles=tiles, blocks=(bm, bk, bn), precision=_precision(lhs.dtype))
  outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((num_groups, lhs_p.shape[1], t * bn), out_dtype)
                 for t in tiles],
      grid=(num_groups, lhs_p.shape[1] // bk, max(tiles)),
      compiler_params=_params(interpret), interpret=interpret,
      name="moejax_gather_tgmm_gpu",
  )(*args)
  return tuple(o[:, :k, :w] for o, w in zip(outs, widths))
