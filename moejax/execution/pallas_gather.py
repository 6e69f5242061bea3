"""A Pallas TPU kernel for the permutation gather: out[r] = x[idx[r]] or 0.

Legend: T source rows, R output rows, d row width.

The indices reach the BlockSpec index map by scalar prefetch, so each grid
step DMAs exactly the source row it needs (a squeezed (d,) block) while the
pipeline prefetches the next one; an out-of-range index (the "no row"
sentinel of :mod:`moejax.execution.permute`) reads row 0 and writes zeros.
One row per step keeps every block legal under TPU tiling (a squeezed
leading dimension, the full trailing one). ``interpret=True`` runs it on any
platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(idx_ref, x_ref, out_ref, *, num_rows: int):
  i = idx_ref[pl.program_id(0)]
  inside = (i >= 0) & (i < num_rows)
  out_ref[...] = jnp.where(inside, x_ref[...], jnp.zeros_like(x_ref[...]))


def gather_rows(x: jax.Array, idx: jax.Array, *, interpret: bool = False) -> jax.Array:
  """[R, d] rows of x[T, d] picked by idx int32[R]; out of range gives 0."""
  if x.ndim != 2 or idx.ndim != 1:
    raise ValueError(f"gather_rows wants x [T, d] and idx [R], got {x.shape} and {idx.shape}")
  t, d = x.shape
  r = idx.shape[0]
  if r == 0 or t == 0:
    return jnp.zeros((r, d), x.dtype)
  idx = idx.astype(jnp.int32)
  return pl.pallas_call(
      functools.partial(_kernel, num_rows=t),
      out_shape=jax.ShapeDtypeStruct((r, d), x.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(r,),
          in_specs=[pl.BlockSpec((None, d),
                                 lambda i, ix: (jnp.clip(ix[i], 0, t - 1), 0))],
          out_specs=pl.BlockSpec((None, d), lambda i, ix: (i, 0))),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="moejax_gather_rows",
  )(idx, x)
