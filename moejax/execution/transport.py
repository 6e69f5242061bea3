"""Moving buffers over the ``expert`` mesh axis: padded all_to_all with size buckets, ragged.

Legend: G members of one exchange group (all D expert-axis devices, or the
devices of one node, or one device per node), U the static worst-case rows a
member may receive from one source, c a bucket (rows actually moved per
source and member), d model width.

The dropless worst case of a padded all_to_all is large (a token may send a
copy to every expert of one device, so U = T rows per source) while a
step's real maximum is usually a fraction of it. XLA needs static shapes,
so :func:`bucketed_all_to_all` compiles one all_to_all per *bucket*, a few
static sizes ``c_0 < ... < c_n = U`` (:func:`bucket_sizes`), and picks per
step the smallest bucket that holds the global maximum count (one scalar
``pmax`` over the mesh after routing). Only the collective is inside the
``jax.lax.switch``: the buffers before and after it keep their static [G, U]
shape (rows past the count are empty and cost nothing in the ``blocked``
grouped matmul), so compile time grows by a few collectives, not by a copy
of the layer per bucket. Every device takes the same branch (the index is a
global maximum), so the collectives match. Exact: the bucket always holds
every row, and the result is the same for every bucket.

The same bucket choice sizes the padded all_to_all of the emulated
``ragged_all_to_all`` (:func:`ragged_move`).

Groups (``axis_index_groups``) restrict one exchange to a subset of the
expert axis, in the order listed: the node-deduplicating dispatch first
exchanges among the devices with one index inside their nodes (one per
node), then inside each node.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from moejax.execution.mesh import EXPERT

# Consecutive buckets differ by this factor, so a step moves at most ~26% more
# rows than its maximum count (plus the spread of counts over devices); 8
# buckets reach down to U / 5.
BUCKET_RATIO = 2.0 ** (1.0 / 3.0)

Groups = Optional[tuple[tuple[int, ...], ...]]


def bucket_sizes(upper: int, count: int) -> tuple[int, ...]:
  """Ascending static sizes ``ceil(upper / BUCKET_RATIO**i)``, i < count, ending at ``upper``.

  ``count=1`` is the worst case alone (no bucketing). Sizes that round to
  the same integer are merged, so tiny shapes get fewer buckets.
  """
  if upper < 1 or count < 1:
    raise ValueError(f"bucket_sizes: upper={upper} and count={count} must be >= 1")
  sizes = {min(upper, max(1, math.ceil(upper / BUCKET_RATIO**i - 1e-9))) for i in range(count)}
  return tuple(sorted(sizes))


def choose_bucket(need: jax.Array, sizes: Sequence[int], axes: Sequence[str]) -> jax.Array:
  """int32[] index of the smallest size >= the global max of ``need`` (same on every device)."""
  need = jnp.asarray(need, jnp.int32)
  top = jax.lax.pmax(need, tuple(axes)) if axes else need
  return jnp.sum(jnp.asarray(sizes, jnp.int32) < top).astype(jnp.int32)


def all_to_all(x: jax.Array, groups: Groups = None) -> jax.Array:
  """all_to_all over 'expert' of x[G, ...]: ``x[j]`` goes to member j, ``out[i]`` came from i."""
  return jax.lax.all_to_all(x, EXPERT, 0, 0, tiled=True,
                            axis_index_groups=None if groups is None else
                            [list(g) for g in groups])


def bucketed_all_to_all(arrays: Sequence[jax.Array], index: jax.Array,
                        sizes: Sequence[int], groups: Groups = None,
                        axis: int = 1) -> tuple[jax.Array, ...]:
  """:func:`all_to_all` of each [G, ..., U, ...] array, moving only ``sizes[index]`` along ``axis``.

  Rows at or past the bucket along ``axis`` must be empty (they are not
  moved and come back as zeros). Differentiable: the transpose of each
  branch is the same slice, all_to_all and pad.
  """
  arrays = tuple(arrays)
  upper = arrays[0].shape[axis]

  def branch(c):
    def move(arrs):
      out = []
      for a in arrs:
        got = all_to_all(jax.lax.slice_in_dim(a, 0, c, axis=axis), groups)
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, upper - c)
        out.append(jnp.pad(got, pad))
      return tuple(out)
    return move

  if len(sizes) == 1:
    return branch(sizes[0])(arrays)
  return jax.lax.switch(index, [branch(c) for c in sizes], arrays)


def _segments_to_buffer(operand, input_offsets, send_sizes, max_rows: int):
  """[G, max_rows, ...]: segment j of ``operand`` (``send_sizes[j]`` rows at its offset), padded."""
  p = jnp.arange(max_rows, dtype=jnp.int32)
  take = jnp.where(p[None, :] < send_sizes[:, None], input_offsets[:, None] + p[None, :],
                   operand.shape[0])
  buf = jnp.take(operand, take.reshape(-1), axis=0, mode="fill", fill_value=0)
  return buf.reshape((send_sizes.shape[0], max_rows) + operand.shape[1:])


def _buffer_to_output(got, output, output_offsets, recv_sizes, groups: Groups):
  """``output`` with got[i, :recv_sizes[i]] written where source i's offsets say."""
  g, max_rows = got.shape[:2]
  p = jnp.arange(max_rows, dtype=jnp.int32)
  at = all_to_all(output_offsets, groups)                      # where source i writes here
  pos = jnp.where(p[None, :] < recv_sizes[:, None], at[:, None] + p[None, :],
                  output.shape[0])
  flat = got.reshape((g * max_rows,) + got.shape[2:])
  return output.at[pos.reshape(-1)].set(flat.astype(output.dtype), mode="drop")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, max_rows: int, groups: Groups = None):
  """``jax.lax.ragged_all_to_all`` over 'expert' built from a padded all_to_all.

  Same arguments and result as the native collective (``output`` with the
  received segments written at the senders' ``output_offsets``), for
  segments of at most ``max_rows`` rows. Differentiable (gather / scatter).
  """
  buf = _segments_to_buffer(operand, input_offsets, send_sizes, max_rows)
  return _buffer_to_output(all_to_all(buf, groups), output, output_offsets, recv_sizes,
                           groups)


def ragged_move(impl: str, sizes: Sequence[int], index: Optional[jax.Array],
                groups: Groups = None):
  """``move(operands, outputs, in_off, send_sizes, out_off, recv_sizes) -> outputs``.

  Moves every array of the tuple ``operands`` by the same segments (like
  ``jax.lax.ragged_all_to_all`` each). ``ragged_native``: the XLA collective
  (exact sizes on the wire). ``ragged_emulated``: a padded all_to_all of
  [G, U] buffers (U = ``sizes[-1]``) that moves only the bucket
  ``sizes[index]`` (every segment, over all devices, fits it); the
  gathers and scatters stay outside the bucket switch.
  """
  if impl == "ragged_native":
    native = functools.partial(jax.lax.ragged_all_to_all, axis_name=EXPERT,
                               axis_index_groups=None if groups is None else
                               [list(g) for g in groups])
    return lambda ops, outs, *args: tuple(native(a, o, *args) for a, o in zip(ops, outs))

  def move(ops, outs, in_off, send, out_off, recv):
    bufs = tuple(_segments_to_buffer(a, in_off, send, sizes[-1]) for a in ops)
    got = bucketed_all_to_all(bufs, index, sizes, groups)
    return tuple(_buffer_to_output(b, o, out_off, recv, groups) for b, o in zip(got, outs))
  return move
