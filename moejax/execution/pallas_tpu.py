"""``pallas_tpu``: megablox-style grouped matmul kernels for TPU (Pallas/Mosaic).

Legend: m rows, k contraction width, n output width, G groups; (tm, tk, tn)
the tile; NT = m / tm + G - 1 the static bound on (group, row tile) visits.

Written after the design of megablox (jax/experimental/pallas/ops/tpu/
megablox): the row tiles sit on a fixed tm grid; a tile that holds rows of
several groups is visited once per group, consecutively
(:func:`moejax.execution.tiling.grid_tiles`), so its output block stays in
VMEM across the visits and each visit merges only its own rows. The visit
list (group id and row tile per grid step) reaches the BlockSpec index maps
by scalar prefetch (``PrefetchScalarGridSpec``), which is how the rhs block of
the right expert is DMA'd without a data-dependent shape. Products
accumulate in an f32 VMEM scratch over the k tiles.

* ``gmm``: grid (n tiles, visits, k tiles); out[m, n].
* ``tgmm``: grid (k tiles, n tiles, visits); out[G, k, n] = lhs_g^T grad_g,
  the accumulator is reset on a group's first visit and stored on its last.
* ``gather_gmm`` / ``scatter_gmm`` / ``gather_tgmm`` (the permutation folded
  into the row loads and stores): :mod:`moejax.execution.pallas_tpu_folded`.

Grid steps past the real visit count repeat the last visit's blocks (no new
DMA) and do nothing. Operands are zero-padded to tile multiples (padding
rows/columns contribute zeros). ``interpret=True`` runs the kernels through
the Pallas interpreter on any platform; TPU tiling rules (tk, tn multiples of
128, tm of 8) are then not enforced, so the defaults keep to them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moejax.execution import gmm as gmm_lib
from moejax.execution import pallas_tpu_folded as folded
from moejax.execution import tiling as tiling_lib
from moejax.execution import tpu_blocks

DEFAULT_TILING = tpu_blocks.DEFAULT_TILING


def _gmm_kernel(offsets_ref, gids_ref, tids_ref, nt_ref, lhs_ref, rhs_ref, out_ref,
                acc_ref, *, tm: int, k_tiles: int, transpose_rhs: bool):
  i, kk = pl.program_id(1), pl.program_id(2)
  live = i < nt_ref[0]

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(live)
  def _():
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    acc_ref[...] += lax.dot_general(lhs_ref[...], rhs_ref[...], (contract, ((), ())),
                                    preferred_element_type=jnp.float32)

  @pl.when(live & (kk == k_tiles - 1))
  def _():
    keep = tpu_blocks.row_mask(offsets_ref, gids_ref[i], tids_ref[i], tm)
    out_ref[...] = jnp.where(keep, acc_ref[...].astype(out_ref.dtype), out_ref[...])


def pallas_gmm(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False,
               interpret=False, tiling=None):
  tm, tk, tn = tiling or DEFAULT_TILING
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  num_groups = rhs.shape[0]
  tm, mp = tpu_blocks.fit(m, tm, 8)
  tk, kp = tpu_blocks.fit(k, tk, 128 if not interpret else 1)
  tn, np_ = tpu_blocks.fit(n, tn, 128 if not interpret else 1)
  lhs = tpu_blocks.pad2(lhs, mp, kp)
  rhs = tpu_blocks.pad2(rhs, np_, kp) if transpose_rhs else tpu_blocks.pad2(rhs, kp, np_)
  visits = tiling_lib.grid_tiles(group_sizes, mp, tm)
  nt = mp // tm + num_groups - 1
  k_tiles = kp // tk
  if transpose_rhs:
    rhs_spec = pl.BlockSpec((None, tn, tk), lambda j, i, kk, o, g, t, c: (g[i], j, kk))
  else:
    rhs_spec = pl.BlockSpec((None, tk, tn), lambda j, i, kk, o, g, t, c: (g[i], kk, j))
  call = pl.pallas_call(
      functools.partial(_gmm_kernel, tm=tm, k_tiles=k_tiles, transpose_rhs=transpose_rhs),
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(np_ // tn, nt, k_tiles),
          in_specs=[pl.BlockSpec((tm, tk), lambda j, i, kk, o, g, t, c: (t[i], kk)),
                    rhs_spec],
          out_specs=pl.BlockSpec((tm, tn), lambda j, i, kk, o, g, t, c: (t[i], j)),
          scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name="moejax_gmm")
  out = call(visits.group_offsets, visits.group_ids, visits.m_tile_ids,
             visits.num_tiles.reshape(1), lhs, rhs)
  return out[:m, :n]


def _tgmm_kernel(offsets_ref, gids_ref, tids_ref, nt_ref, lhs_ref, grad_ref, out_ref,
                 acc_ref, *, tm: int, num_visits: int):
  i = pl.program_id(2)
  g = gids_ref[i]
  live = i < nt_ref[0]
  first = (i == 0) | (g != gids_ref[jnp.maximum(i - 1, 0)])
  last = ((i + 1 >= nt_ref[0]) | (g != gids_ref[jnp.minimum(i + 1, num_visits - 1)]))

  @pl.when(first)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(live)
  def _():
    keep = tpu_blocks.row_mask(offsets_ref, g, tids_ref[i], tm)
    x = jnp.where(keep, lhs_ref[...], 0)
    acc_ref[...] += lax.dot_general(x, grad_ref[...], (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)

  @pl.when(live & last)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def pallas_tgmm(lhs, grad, group_sizes, *, out_dtype, interpret=False,
                tiling=None):
  tm, tk, tn = tiling or DEFAULT_TILING
  m, k = lhs.shape
  n = grad.shape[1]
  num_groups = group_sizes.shape[0]
  tm, mp = tpu_blocks.fit(m, tm, 8)
  tk, kp = tpu_blocks.fit(k, tk, 128 if not interpret else 1)
  tn, np_ = tpu_blocks.fit(n, tn, 128 if not interpret else 1)
  lhs = tpu_blocks.pad2(lhs, mp, kp)
  grad = tpu_blocks.pad2(grad, mp, np_)
  visits = tiling_lib.grid_tiles(group_sizes, mp, tm)
  nt = mp // tm + num_groups - 1
  call = pl.pallas_call(
      functools.partial(_tgmm_kernel, tm=tm, num_visits=nt),
      out_shape=jax.ShapeDtypeStruct((num_groups, kp, np_), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(kp // tk, np_ // tn, nt),
          in_specs=[pl.BlockSpec((tm, tk), lambda a, b, i, o, g, t, c: (t[i], a)),
                    pl.BlockSpec((tm, tn), lambda a, b, i, o, g, t, c: (t[i], b))],
          out_specs=pl.BlockSpec((None, tk, tn), lambda a, b, i, o, g, t, c: (g[i], a, b)),
          scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="moejax_tgmm")
  out = call(visits.group_offsets, visits.group_ids, visits.m_tile_ids,
             visits.num_tiles.reshape(1), lhs, grad)
  return out[:, :k, :n]


BACKEND = gmm_lib.Backend(
    name="pallas_tpu",
    gmm=pallas_gmm,
    tgmm=pallas_tgmm, platforms=("tpu",), interpretable=True,
    # The permutation folded into the row loads / stores (row DMAs), so the
    # routed FFN takes folded_gmm's path: pallas_tpu_folded.py.
    gather_gmm=folded.gather_gmm, scatter_gmm=folded.scatter_gmm,
    gather_tgmm=folded.gather_tgmm,
    needs="a TPU (Pallas Mosaic TPU kernels)",
    # Not auto's choice anywhere yet: it has only run interpreted. Add "tpu"
    # once `python -m experiments.device_check` on a TPU reports
    # gmm_correctness ok and the kernel ahead of ragged_dot in gmm_timing.
    auto_on=())

gmm_lib.register_backend(BACKEND)
