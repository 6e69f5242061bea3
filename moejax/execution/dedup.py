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
integers. The hops take their transport as an object
(:mod:`moejax.execution.transport`): the padded one picks a static bucket
per step from the global maximum count; the ragged ones move exact-size
segments (native) or emulate them. The hops of each unit are
:func:`token_hops` and :func:`node_hops`; the executors that run them are
in :mod:`moejax.execution.dispatch`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moejax.execution import comm as comm_lib
from moejax.execution import permute as permute_lib
from moejax.execution import transport as transport_lib

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
  groups: transport_lib.Groups = None
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


def _bound(rows: int, q: int, capacity: Optional[int], sources: int = 1) -> int:
  """U: rows one source may send one member; with capacity C, at most sources * Q * C."""
  return rows if capacity is None else max(1, min(rows, sources * q * capacity))


def token_hops(num_devices: int, slots: int, tokens: int,
               capacity: Optional[int]) -> tuple[Hop, ...]:
  """The ``token`` unit's one hop over the whole expert axis, for T = ``tokens`` rows.

  ``capacity``: the layer's per-expert capacity (None: dropless); a member
  then receives at most Q * C rows from one source, which bounds U.
  """
  return (Hop(num_devices, slots, _bound(tokens, slots, capacity)),)


def node_hops(num_devices: int, slots: int, per_node: int, tokens: int,
              capacity: Optional[int]) -> tuple[Hop, ...]:
  """The ``node`` unit's hops: across nodes (one peer per node), then inside the node.

  One node (P >= D) or one device per node (P = 1) has nothing to
  deduplicate twice: the single token hop.
  """
  d, p = num_devices, per_node
  if p >= d or p == 1:
    return token_hops(d, slots, tokens, capacity)
  n = d // p
  across = tuple(tuple(i + j * p for j in range(n)) for i in range(p))
  within = tuple(tuple(j * p + i for i in range(p)) for j in range(n))
  first = Hop(n, p * slots, _bound(tokens, p * slots, capacity), across, "across", p)
  return first, Hop(p, slots, _bound(n * first.upper, slots, capacity, n), within, "within", p)


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


def hop(x, tgt, w, valid, spec: Hop, inner: Inner, *, transport: transport_lib.Transport,
        buckets: int, axes, tally: Tally) -> jax.Array:
  """z[R, d]: sum over valid slots of w * (the inner stage's value of the slot), via one exchange.

  ``inner(rows[R', d], ids[R', Kc], weights[R', Kc], valid[R', Kc])`` returns
  the gate-weighted sum per received row; ``transport`` lays the rows out by
  member and moves them (one sub-group per member).
  """
  r, dm = x.shape
  g, q, u = spec.members, spec.targets, spec.upper
  hit, ids, wts, lost = _expand(tgt, w, valid, g, q)
  kc = ids.shape[-1]
  member_ids = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[None, :], (r, g))
  plan = transport.layout(member_ids, hit, g, u)
  xs = permute_lib.permute(x, plan)
  ms = jnp.take(ids.reshape(r * g, kc), plan.src_slot, axis=0, mode="fill", fill_value=q)
  mw = jnp.take(wts.reshape(r * g, kc), plan.src_slot, axis=0, mode="fill", fill_value=0)
  send = plan.group_sizes                                     # [G] rows per member

  def received(arrays, sub, filled):
    del sub  # one sub-group: the metadata names the slots
    rx, rs, rw = arrays
    return inner(rx, rs, rw, filled[:, None] & (rs < q))

  back, wire_rows = transport.round_trip((xs, ms, mw), send[:, None], received, capacity=u,
                                         max_rows=u, buckets=buckets, axes=axes,
                                         groups=spec.groups)
  kept = plan.dispatched()                                    # [R, G]
  member = jnp.clip(tgt // q, 0, g - 1)
  lost = lost + jnp.sum(valid & ~jnp.take_along_axis(kept, member, axis=1), dtype=jnp.int32)
  tally.add(spec, send, wire_rows, kc, lost)
  return permute_lib.unpermute(back, plan, jnp.ones((r, g), jnp.float32)).astype(x.dtype)


def dispatch_combine(x, phys, weights, sent, hops: tuple[Hop, ...], local: Inner, *,
                     transport: transport_lib.Transport, buckets: int, axes,
                     tally: Tally) -> jax.Array:
  """y[T, d] = sum_k weights * FFN_{phys}(x) over sent slots, through ``hops`` then ``local``."""
  def stage(i):
    if i == len(hops):
      return local
    return lambda rows, ids, w, v: hop(rows, ids, w, v, hops[i], stage(i + 1),
                                       transport=transport, buckets=buckets, axes=axes,
                                       tally=tally)
  return stage(0)(x, phys, weights, sent)
