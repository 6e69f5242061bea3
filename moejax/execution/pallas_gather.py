"""Pallas kernels for the permutation gather: out[r] = x[idx[r]] or 0.

Legend: T source rows, R output rows, d row width; (br, bd) a GPU block.

Indices are the row map of :mod:`moejax.execution.permute`: 0 <= idx < T
picks a row, idx >= T (the "no row" sentinel T) gives a zero row.

* TPU (:func:`gather_rows`): the indices arrive in SMEM by scalar prefetch;
  x stays in HBM (``memory_space=ANY``) and each grid step starts br row DMAs
  straight into its [br, d] output block, waits for them, and zeroes the
  rows whose index is out of range. A block of br (a multiple of 8) rows is
  a legal TPU tile; one squeezed row per step, the obvious form, is not
  (Mosaic wants the second-minor block dimension divisible by 8), which the
  lowering test catches on CPU.
* GPU (:func:`gather_rows_gpu`): Pallas' Triton lowering; each program loads
  br indices and gathers a [br, bd] block of rows with one pointer-array load
  (coalesced along d), zeroing the out-of-range rows. Triton blocks have
  power-of-two sizes, so R and d are padded to whole blocks (a copy only
  when they are not multiples already).

``interpret=True`` runs either on any platform (tests, the CPU dry run of
``experiments.device_check``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moejax.execution import tiling as tiling_lib

try:  # Pallas' Triton backend (GPU); absent from unusual jax builds.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

TPU_BLOCK_ROWS = 16
GPU_BLOCK_ROWS = 64
GPU_BLOCK_COLS = 256


def _tpu_kernel(idx_ref, x_hbm, out_ref, sems, *, num_rows: int, br: int):
  base = pl.program_id(0) * br

  def copy(j):
    src = jnp.clip(idx_ref[base + j], 0, num_rows - 1)
    return pltpu.make_async_copy(x_hbm.at[pl.ds(src, 1)], out_ref.at[pl.ds(j, 1)],
                                 sems.at[j])

  # All br row DMAs in flight at once, then wait for them; rows whose index is
  # the "no row" sentinel are overwritten with zeros.
  for j in range(br):
    copy(j).start()
  for j in range(br):
    copy(j).wait()
  for j in range(br):
    i = idx_ref[base + j]

    @pl.when((i < 0) | (i >= num_rows))
    def _():
      out_ref[pl.ds(j, 1), :] = jnp.zeros((1, out_ref.shape[1]), out_ref.dtype)


def gather_rows(x: jax.Array, idx: jax.Array, *, interpret: bool = False,
                block_rows: int = TPU_BLOCK_ROWS) -> jax.Array:
  """[R, d] rows of x[T, d] picked by idx int32[R]; out of range gives 0 (TPU)."""
  if x.ndim != 2 or idx.ndim != 1:
    raise ValueError(f"gather_rows wants x [T, d] and idx [R], got {x.shape} and {idx.shape}")
  t, d = x.shape
  r = idx.shape[0]
  if r == 0 or t == 0 or d == 0:
    return jnp.zeros((r, d), x.dtype)
  br = max(8, -(-int(block_rows) // 8) * 8)  # whole (8, 128) TPU tiles of rows
  r_pad = -(-r // br) * br
  idx = jnp.pad(idx.astype(jnp.int32), (0, r_pad - r), constant_values=t)
  out = pl.pallas_call(
      functools.partial(_tpu_kernel, num_rows=t, br=br),
      out_shape=jax.ShapeDtypeStruct((r_pad, d), x.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(r_pad // br,),
          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],  # x stays in HBM; rows by DMA
          out_specs=pl.BlockSpec((br, d), lambda i, ix: (i, 0)),
          scratch_shapes=[pltpu.SemaphoreType.DMA((br,))]),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="moejax_gather_rows",
  )(idx, x)
  return out if r_pad == r else out[:r]


def _gpu_kernel(idx_ref, x_ref, out_ref, *, num_rows: int, bd: int):
  idx = idx_ref[...]
  inside = (idx >= 0) & (idx < num_rows)
  rows = x_ref[jnp.where(inside, idx, 0), pl.ds(pl.program_id(1) * bd, bd)]
  out_ref[...] = jnp.where(inside[:, None], rows, jnp.zeros_like(rows))


def gather_rows_gpu(x: jax.Array, idx: jax.Array, *, interpret: bool = False,
                    block_rows: int = GPU_BLOCK_ROWS,
                    block_cols: int = GPU_BLOCK_COLS) -> jax.Array:
  """[R, d] rows of x[T, d] picked by idx int32[R]; out of range gives 0 (GPU)."""
  if x.ndim != 2 or idx.ndim != 1:
    raise ValueError(f"gather_rows_gpu wants x [T, d] and idx [R], got {x.shape} and "
                     f"{idx.shape}")
  t, d = x.shape
  r = idx.shape[0]
  if r == 0 or t == 0 or d == 0:
    return jnp.zeros((r, d), x.dtype)
  br = min(tiling_lib.pow2_at_least(block_rows), tiling_lib.pow2_at_least(r))
  bd = min(tiling_lib.pow2_at_least(block_cols), tiling_lib.pow2_at_least(d))
  r_pad, d_pad = -(-r // br) * br, -(-d // bd) * bd
  idx = jnp.pad(idx.astype(jnp.int32), (0, r_pad - r), constant_values=t)
  xp = x if d_pad == d else jnp.pad(x, ((0, 0), (0, d_pad - d)))
  params = None if pltriton is None else pltriton.CompilerParams(num_warps=4, num_stages=1)
  out = pl.pallas_call(
      functools.partial(_gpu_kernel, num_rows=t, bd=bd),
      out_shape=jax.ShapeDtypeStruct((r_pad, d_pad), x.dtype),
      grid=(r_pad // br, d_pad // bd),
      in_specs=[pl.BlockSpec((br,), lambda i, j: (i,)),
                pl.BlockSpec((t, d_pad), lambda i, j: (0, 0))],  # rows picked in-kernel
      out_specs=pl.BlockSpec((br, bd), lambda i, j: (i, j)),
      compiler_params=params,
      interpret=interpret,
      name="moejax_gather_rows_gpu",
  )(idx, xp)
  return out if (r_pad, d_pad) == (r, d) else out[:r, :d]
