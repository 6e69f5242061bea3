"""Deduplicating expert-parallel dispatch: each token once per destination device (or node).

Legend: T tokens on one device, d model width, K slots per token, S_p
physical expert slots per device, D expert-axis devices, P devices per node,
N = D / P nodes, R rows entering one hop, G members of a hop's exchange
group, Q target ids per member, Kc = min(K, Q) metadata entries per row, U
static rows per (source, member) buffer.

The per-copy dispatch (``ParallelConfig.dispatch_unit='copy'``) sends a
token once per routed expert, so a token whose K experts share a device
travels K times. Here a token travels once per destination and is expanded
to its experts there (DeepSeek-V3's dispatch, arXiv 2412.19437 sec. 3.2.2):

* ``token``: one **hop** over the whole expert axis (G = D, Q = S_p): row
  (t, j) carries x[t] to device j once, with metadata naming its experts on
  j (local slot ids) and their gate weights; device j runs its local
  experts on the row's slots, sums them gate-weighted, and sends one row
  back; the source adds the rows of all destinations.
* ``node``: two hops. First across nodes, among the devices with the same
  index inside their nodes (G = N, Q = P * S_p): a token crosses to each
  remote node once, landing on its peer there; then inside the node (G = P,
  Q = S_p) the peer forwards it once per device holding its experts. The
  way back sums inside the node before the single return across nodes. So
  cross-node rows equal the analytic once-per-node minimum (``min_node``),
  and the forwarding is paid on the cheap intra-node links.

One hop (:func:`hop`), for rows x[R, d] with targets tgt[R, Kh] (ids in
[0, G * Q): member tgt // Q, its local id tgt % Q), weights and validity:

    hit[r, g]        row r has a valid slot on member g     (the dedup)
    meta[r, g, :Kc]  those slots' local ids and gate weights
    buffer           rows by member (capacity layout [G, U] or ragged segments)
    exchange         x rows and metadata, over the hop's group
    inner(...)       the next hop, or the local grouped matmul, gate-weighted
    exchange back    one row per (row, member)
    z[r]             sum over members (unit weights: the gates were applied)

Gate weights travel with the rows (4 bytes per slot, plus a 4-byte id),
so the gradient reaches them through the exchange; the expert ids are
integers. The capacity transport picks a static bucket per step from the
global maximum count (:mod:`moejax.execution.transport`); the ragged
transport moves exact-size segments (native) or emulates them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moejax.execution import comm as comm_lib
from moejax.execution import permute as permute_lib
from moejax.execution import transport

META_BYTES_PER_SLOT = 8  # int32 local id + f32 gate weight


@dataclasses.dataclass(frozen=True)
class Hop:
  """One exchange of a deduplicating dispatch.

  members: G; targets: Q ids per member; upper: U, rows one source may send
  one member (static); groups: ``axis_index_groups`` of the exchange over
  'expert' (None: the whole axis); span: ``all`` (member g is expert-axis
  position g), ``across`` (member g is position g * P + this device's index
  in its node) or ``within`` (member g is position node * P + g); per_node: P.
  """

  members: int
  targets: int
  upper: int
  groups: transport.Groups = None
  span: str = "all"
  per_node: int = 1

  def positions(self, me: jax.Array) -> jax.Array:
    """int32[G] expert-axis position of every member, seen from position ``me``."""
    g = jnp.arange(self.members, dtype=jnp.int32)
    if self.span == "across":
      return g * self.per_node + me % self.per_node
    if self.span == "within":
      return (me // self.per_node) * self.per_node + g
    return g


def make_hops(unit: str, num_devices: int, slots: int, per_node: Optional[int],
              tokens: int, capacity: Optional[int]) -> tuple[Hop, ...]:
  """The hops of ``unit`` ('token' or 'node') for T = ``tokens`` rows.

  ``capacity``: the layer's per-expert capacity (None: dropless); a member
  then receives at most Q * C rows from one source, which bounds U.
  """
  def bound(rows, q, sources=1):
    return rows if capacity is None else max(1, min(rows, sources * q * capacity))

  d, p = num_devices, per_node or num_devices
  if unit == "token" or p >= d or p == 1:
    return (Hop(d, slots, bound(tokens, slots)),)
  n = d // p
  across = tuple(tuple(i + j * p for j in range(n)) for i in range(p))
  within = tuple(tuple(j * p + i for i in range(p)) for j in range(n))
  first = Hop(n, p * slots, bound(tokens, p * slots), across, "across", p)
  return first, Hop(p, slots, bound(n * first.upper, slots, n), within, "within", p)


def _expand(tgt, w, valid, members: int, targets: int):
  """(hit bool[R, G], ids int32[R, G, Kc], weights f32[R, G, Kc], lost int32[]).

  Slot k of row r goes to entry rank(r, k) of its member's metadata, rank =
  the valid slots of r before k on the same member. A slot past Kc (only
  possible if a row names one expert twice) cannot be sent: counted lost.
  """
  r, k = tgt.shape
  kc = min(k, targets)
  member = jnp.where(valid, tgt // targets, members)
  same = (member[:, :, None] == member[:, None, :]) & valid[:, None, :]
  rank = jnp.sum(same & (jnp.arange(k)[None, :] < jnp.arange(k)[:, None])[None], axis=2)
  ok = valid & (rank < kc)
  rows = jnp.broadcast_to(jnp.arange(r)[:, None], (r, k))
  at = (rows, jnp.where(ok, member, members), jnp.where(ok, rank, 0))
  ids = jnp.full((r, members, kc), targets, jnp.int32).at[at].set(
      (tgt % targets).astype(jnp.int32), mode="drop")
  wts = jnp.zeros((r, members, kc), jnp.float32).at[at].set(
      w.astype(jnp.float32), mode="drop")
  hit = jnp.any(jax.nn.one_hot(member, members + 1, dtype=jnp.bool_), axis=1)[:, :members]
  return hit, ids, wts, jnp.sum(valid & ~ok, dtype=jnp.int32)


Inner = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass
class Tally:
  """Per-device byte counts (one direction) and lost slots, summed over the hops."""

  row_bytes: int
  node_of: np.ndarray
  me: jax.Array
  bytes: dict = dataclasses.field(default_factory=dict)
  lost: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))

  def add(self, hop: Hop, rows: jax.Array, wire_rows: jax.Array, meta_slots: int, lost):
    pos = hop.positions(self.me)
    got = comm_lib.transfer_bytes(pos, rows, wire_rows, self.me, self.node_of, self.row_bytes)
    remote = pos != self.me
    got["meta"] = jnp.sum(jnp.where(remote, wire_rows, 0)).astype(jnp.float32) * (
        meta_slots * META_BYTES_PER_SLOT)
    for key, v in got.items():
      self.bytes[key] = self.bytes.get(key, 0.0) + v
    self.lost = self.lost + lost


def hop(x, tgt, w, valid, spec: Hop, inner: Inner, *, impl: str, buckets: int, axes,
        tally: Tally) -> jax.Array:
  """z[R, d]: sum over valid slots of w * (the inner stage's value of the slot), via one exchange.

  ``inner(rows[R', d], ids[R', Kc], weights[R', Kc], valid[R', Kc])`` returns
  the gate-weighted sum per received row.
  """
  r, dm = x.shape
  g, q, u = spec.members, spec.targets, spec.upper
  hit, ids, wts, lost = _expand(tgt, w, valid, g, q)
  kc = ids.shape[-1]
  member_ids = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[None, :], (r, g))
  sizes = transport.bucket_sizes(u, buckets)
  if impl == "capacity":
    plan = permute_lib.capacity_layout(member_ids, hit, g, u)
  else:
    plan = permute_lib.sort_by_expert(member_ids, hit, g)
  xs = permute_lib.permute(x, plan)
  ms = jnp.take(ids.reshape(r * g, kc), plan.src_slot, axis=0, mode="fill", fill_value=q)
  mw = jnp.take(wts.reshape(r * g, kc), plan.src_slot, axis=0, mode="fill", fill_value=0)
  send = plan.group_sizes                                     # [G] rows per member
  index = transport.choose_bucket(jnp.max(send), sizes, axes)
  recv_counts = transport.all_to_all(send, spec.groups)       # [G] rows per source
  if impl == "capacity":
    rx, rs, rw = transport.bucketed_all_to_all(
        (xs.reshape(g, u, dm), ms.reshape(g, u, kc), mw.reshape(g, u, kc)), index, sizes,
        spec.groups)
    filled = jnp.arange(u)[None, :] < recv_counts[:, None]   # [G, U]
    rx, rs, rw, filled = (rx.reshape(g * u, dm), rs.reshape(g * u, kc), rw.reshape(g * u, kc),
                          filled.reshape(-1))
    out = inner(rx, rs, rw, filled[:, None] & (rs < q))
    (back,) = transport.bucketed_all_to_all((out.reshape(g, u, dm),), index, sizes,
                                            spec.groups)
    back = back.reshape(g * u, dm)
    wire_rows = jnp.full((g,), jnp.asarray(sizes, jnp.int32)[index])
  else:
    move = transport.ragged_move(impl, sizes, index, spec.groups)
    in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
    recv_off = (jnp.cumsum(recv_counts) - recv_counts).astype(jnp.int32)
    out_off = transport.all_to_all(recv_off, spec.groups)   # my segment's place on member j
    n_out = g * u
    args = (in_off, send, out_off, recv_counts)
    rx, rs, rw = move((xs, ms, mw), (jnp.zeros((n_out, dm), x.dtype),
                                     jnp.zeros((n_out, kc), jnp.int32),
                                     jnp.zeros((n_out, kc), jnp.float32)), *args)
    filled = jnp.arange(n_out) < jnp.sum(recv_counts)
    out = inner(rx, rs, rw, filled[:, None] & (rs < q))
    back_off = transport.all_to_all(in_off, spec.groups)     # my rows' place on each source
    (back,) = move((out,), (jnp.zeros((r * g, dm), out.dtype),), recv_off, recv_counts,
                   back_off, send)
    wire_rows = send if impl == "ragged_native" else jnp.full(
        (g,), jnp.asarray(sizes, jnp.int32)[index])
  kept = plan.dispatched()                                    # [R, G]
  member = jnp.clip(tgt // q, 0, g - 1)
  lost = lost + jnp.sum(valid & ~jnp.take_along_axis(kept, member, axis=1), dtype=jnp.int32)
  tally.add(spec, send, wire_rows, kc, lost)
  return permute_lib.unpermute(back, plan, jnp.ones((r, g), jnp.float32)).astype(x.dtype)


def dispatch_combine(x, phys, weights, sent, hops: tuple[Hop, ...], local: Inner, *,
                     impl: str, buckets: int, axes, tally: Tally) -> jax.Array:
  """y[T, d] = sum_k weights * FFN_{phys}(x) over sent slots, through ``hops`` then ``local``."""
  def stage(i):
    if i == len(hops):
      return local
    return lambda rows, ids, w, v: hop(rows, ids, w, v, hops[i], stage(i + 1), impl=impl,
                                       buckets=buckets, axes=axes, tally=tally)
  return stage(0)(x, phys, weights, sent)
