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

The switch needs a runtime that issues a branch's collective in program
order. XLA:CPU's does not (:mod:`moejax.execution.collective_order`: the
next collective may start before the branch's on some devices, which
deadlocks or mixes up the rendezvous), so on CPU the transports are built
with ``bucket_switch=False`` (:func:`bucket_switch_for`): the whole [G, U]
buffer moves in one top-level all_to_all, rows past the bucket being empty
either way, so results are the same; the bucket is still chosen and
accounted (``wire_rows``).

The same bucket choice sizes the padded all_to_all of the emulated
``ragged_all_to_all`` (:class:`EmulatedRaggedTransport`).

The three transports are objects (:class:`PaddedTransport`,
:class:`NativeRaggedTransport`, :class:`EmulatedRaggedTransport`), registered
by name (``moejax.execution.registry.TRANSPORTS``) and held by the
expert-parallel executors: an executor asks its transport for a layout and
a round trip and never compares a transport name. One round trip moves rows
grouped by (member, sub-group): S sub-groups per member (the per-copy
dispatch's local experts of a destination device; 1 for a deduplicating
hop).

Groups (``axis_index_groups``) restrict one exchange to a subset of the
expert axis, in the order listed: the node-deduplicating dispatch first
exchanges among the devices with one index inside their nodes (one per
node), then inside each node.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, ClassVar, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp

from moejax.execution import permute as permute_lib
from moejax.execution import scopes
from moejax.execution.mesh import EXPERT
from moejax.execution.registry import register_transport

# Platforms whose XLA implements ragged-all-to-all (XLA:CPU does not).
NATIVE_RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")

# Platforms whose runtime runs a device's program in order (GPU streams, TPU
# cores), a conditional's collectives included. XLA:CPU's thunk runtime may
# start the collective after a conditional before the one inside it
# (moejax/execution/collective_order.py), so there the bucket switch is off.
ORDERED_BRANCH_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")

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


@jax.named_scope(scopes.ALL_TO_ALL)
def all_to_all(x: jax.Array, groups: Groups = None) -> jax.Array:
  """all_to_all over 'expert' of x[G, ...]: ``x[j]`` goes to member j, ``out[i]`` came from i."""
  return jax.lax.all_to_all(x, EXPERT, 0, 0, tiled=True,
                            axis_index_groups=None if groups is None else
                            [list(g) for g in groups])


def bucket_switch_for(platform: str) -> bool:
  """Whether transports on ``platform`` move only the bucket (a collective in a switch)."""
  return platform in ORDERED_BRANCH_PLATFORMS


def bucketed_all_to_all(arrays: Sequence[jax.Array], index: jax.Array,
                        sizes: Sequence[int], groups: Groups = None,
                        axis: int = 1, switch: bool = True) -> tuple[jax.Array, ...]:
  """:func:`all_to_all` of each [G, ..., U, ...] array, moving only ``sizes[index]`` along ``axis``.

  Rows at or past the bucket along ``axis`` must be empty (they are not
  moved and come back as zeros). Differentiable: the transpose of each
  branch is the same slice, all_to_all and pad. ``switch=False`` moves all
  U rows with one all_to_all outside any control flow (same result, since
  the rows past the bucket are empty): for runtimes that do not keep a
  branch's collective in program order (:data:`ORDERED_BRANCH_PLATFORMS`).
  """
  arrays = tuple(arrays)
  upper = arrays[0].shape[axis]
  if not switch:
    return tuple(all_to_all(a, groups) for a in arrays)

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


# --- Transport objects (one per ParallelConfig dispatch / ragged_impl). ----

# inner(received arrays, sub int32[n], filled bool[n]) -> out[n, d]: the work
# on the rows a member received (sub: their sub-group, filled: a real row).
Received = Callable[[tuple, jax.Array, jax.Array], jax.Array]


class Transport(Protocol):
  """How an expert-parallel exchange lays rows out and moves them there and back.

  ``layout(ids[R, K], valid, groups, capacity)`` -> a
  :class:`~moejax.execution.permute.Dispatch` with rows by group;
  ``round_trip(arrays, counts[G, S], inner, *, capacity, max_rows, buckets,
  axes, groups)`` -> (the rows ``inner`` returned, back in the layout's
  order; wire_rows int32[G] rows on the wire per member). Class attributes:
  ``name`` (the registry key), ``ragged`` (segments, dropless), ``exact_wire``
  (the wire carries exactly the counts) and ``platforms`` (None: all).
  """

  name: ClassVar[str]
  ragged: ClassVar[bool]
  exact_wire: ClassVar[bool]
  platforms: ClassVar[Optional[tuple]]

  def layout(self, ids, valid, groups: int, capacity: int) -> permute_lib.Dispatch:
    ...

  def round_trip(self, arrays, counts, inner: Received, *, capacity: int, max_rows: int,
                 buckets: int, axes, groups: Groups = None):
    ...


@register_transport
@dataclasses.dataclass(frozen=True)
class PaddedTransport:
  """Static [G, S, C] buffers moved by a bucketed all_to_all (every backend, CPU included).

  ``layout`` is the capacity layout (C rows per (member, sub-group), slot-major
  priority); the bucket is chosen from the largest (member, sub-group) count.
  """

  name: ClassVar[str] = "capacity"
  ragged: ClassVar[bool] = False      # False: fixed-size buffers
  exact_wire: ClassVar[bool] = False  # the wire carries the chosen bucket, not the count
  platforms: ClassVar[Optional[tuple]] = None  # None: every platform
  # False: the bucket is chosen and accounted but the whole buffer moves, outside
  # any switch (XLA:CPU; bucket_switch_for).
  bucket_switch: bool = True

  def layout(self, ids, valid, groups: int, capacity: int) -> permute_lib.Dispatch:
    """Rows by group ([groups * capacity] rows, copies past ``capacity`` dropped)."""
    return permute_lib.capacity_layout(ids, valid, groups, capacity)

  def round_trip(self, arrays, counts, inner: Received, *, capacity: int, max_rows: int,
                 buckets: int, axes, groups: Groups = None):
    """(back[G * S * C, d] in the layout's order, wire_rows int32[G]).

    arrays: [G * S * C, ...] in the layout's order; counts: int32[G, S] filled
    rows per (member, sub-group). ``max_rows`` (the ragged bound) is unused.
    """
    del max_rows
    g, s = counts.shape
    c = capacity
    sizes = bucket_sizes(c, buckets)
    index = choose_bucket(jnp.max(counts), sizes, axes)
    bufs = tuple(a.reshape((g, s, c) + a.shape[1:]) for a in arrays)
    recv = bucketed_all_to_all(bufs, index, sizes, groups, axis=2,   # [G(src), S, C, ...]
                               switch=self.bucket_switch)
    recv_counts = all_to_all(counts, groups)                          # [G(src), S]
    filled = jnp.arange(c, dtype=jnp.int32)[None, None, :] < recv_counts[:, :, None]
    sub = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :, None], filled.shape)
    out = inner(tuple(r.reshape((g * s * c,) + r.shape[3:]) for r in recv), sub.reshape(-1),
                filled.reshape(-1))
    (back,) = bucketed_all_to_all((out.reshape((g, s, c) + out.shape[1:]),), index, sizes,
                                  groups, axis=2, switch=self.bucket_switch)
    wire_rows = jnp.full((g,), s, jnp.int32) * jnp.asarray(sizes, jnp.int32)[index]
    return back.reshape((g * s * c,) + back.shape[3:]), wire_rows


@dataclasses.dataclass(frozen=True)
class _RaggedTransport:
  """Exact-size segments, one per member, rows sorted by (member, sub-group); dropless.

  Subclasses say how segments move (:meth:`_move`) and what the wire
  carries (:meth:`_wire_rows`); the offsets bookkeeping is shared, so the
  emulation exercises it on CPU.
  """

  ragged: ClassVar[bool] = True
  bucket_switch: bool = True  # as PaddedTransport's (the emulation's padded all_to_all)

  def layout(self, ids, valid, groups: int, capacity: int) -> permute_lib.Dispatch:
    """Rows sorted by group, dropless (``capacity`` does not apply)."""
    del capacity
    return permute_lib.sort_by_expert(ids, valid, groups)

  def _move(self, sizes, index, groups: Groups):
    raise NotImplementedError

  def _wire_rows(self, send, sizes, index):
    raise NotImplementedError

  def round_trip(self, arrays, counts, inner: Received, *, capacity: int, max_rows: int,
                 buckets: int, axes, groups: Groups = None):
    """(back[R, d] in the layout's order, wire_rows int32[G]); see PaddedTransport.

    arrays: [R, ...] sorted by (member, sub-group); counts: int32[G, S];
    ``max_rows``: most rows one source sends one member (the bucket bound).
    """
    del capacity
    g, s = counts.shape
    send = jnp.sum(counts, axis=1).astype(jnp.int32)                  # [G] rows per member
    sizes = bucket_sizes(max_rows, buckets)
    index = choose_bucket(jnp.max(send), sizes, axes)
    move = self._move(sizes, index, groups)
    in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
    recv_counts = all_to_all(counts, groups)                          # [G(src), S]
    recv_sizes = jnp.sum(recv_counts, axis=1).astype(jnp.int32)
    recv_off = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    out_off = all_to_all(recv_off, groups)           # my segment's place on member j
    n_out = g * max_rows
    recv = move(arrays, tuple(jnp.zeros((n_out,) + a.shape[1:], a.dtype) for a in arrays),
                in_off, send, out_off, recv_sizes)
    if s == 1:
      filled = jnp.arange(n_out) < jnp.sum(recv_sizes)
      sub = jnp.zeros((n_out,), jnp.int32)
    else:
      # Received rows: by source, then by sub-group. Row r's sub-group comes
      # from the (source, sub) segment ends, which never decrease in r.
      ends = (recv_off[:, None] + jnp.cumsum(recv_counts, axis=1)).reshape(-1)
      seg = jnp.searchsorted(ends, jnp.arange(n_out, dtype=jnp.int32), side="right")
      filled = seg < g * s
      sub = jnp.where(filled, seg % s, 0)
    out = inner(recv, sub, filled)
    back_off = all_to_all(in_off, groups)             # my rows' place on each source
    (back,) = move((out,), (jnp.zeros((arrays[0].shape[0],) + out.shape[1:], out.dtype),),
                   recv_off, recv_sizes, back_off, send)
    return back, self._wire_rows(send, sizes, index)


@register_transport
@dataclasses.dataclass(frozen=True)
class NativeRaggedTransport(_RaggedTransport):
  """``jax.lax.ragged_all_to_all``: exact sizes on the wire (GPU/TPU)."""

  name: ClassVar[str] = "ragged_native"
  exact_wire: ClassVar[bool] = True
  platforms: ClassVar[Optional[tuple]] = NATIVE_RAGGED_PLATFORMS

  def _move(self, sizes, index, groups: Groups):
    del sizes, index
    native = jax.named_scope(scopes.ALL_TO_ALL)(functools.partial(
        jax.lax.ragged_all_to_all, axis_name=EXPERT,
        axis_index_groups=None if groups is None else [list(g) for g in groups]))
    return lambda ops, outs, *args: tuple(native(a, o, *args) for a, o in zip(ops, outs))

  def _wire_rows(self, send, sizes, index):
    del sizes, index
    return send


@register_transport
@dataclasses.dataclass(frozen=True)
class EmulatedRaggedTransport(_RaggedTransport):
  """The native collective's segments and offsets over a bucketed padded all_to_all.

  A [G, U] buffer per array (U = ``sizes[-1]``) of which only the bucket
  ``sizes[index]`` moves (every segment, over all devices, fits it); the
  gathers and scatters stay outside the bucket switch. Same results as
  native; the wire carries the bucket.
  """

  name: ClassVar[str] = "ragged_emulated"
  exact_wire: ClassVar[bool] = False
  platforms: ClassVar[Optional[tuple]] = None

  def _move(self, sizes, index, groups: Groups):
    def move(ops, outs, in_off, send, out_off, recv):
      bufs = tuple(_segments_to_buffer(a, in_off, send, sizes[-1]) for a in ops)
      got = bucketed_all_to_all(bufs, index, sizes, groups, switch=self.bucket_switch)
      return tuple(_buffer_to_output(b, o, out_off, recv, groups) for b, o in zip(got, outs))
    return move

  def _wire_rows(self, send, sizes, index):
    return jnp.full(send.shape, jnp.asarray(sizes, jnp.int32)[index])
