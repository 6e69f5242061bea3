"""The expert-parallel executors: one class per dispatch unit, each holding its transport.

Legend: T tokens on one device, d model width, K slots per token, E logical
FFN experts, D devices on the ``expert`` axis, S_p physical expert slots per
device, E_p = D * S_p physical experts, C capacity per (device, expert), P
devices per node, L = T * min(K, S_p) most rows one device can send another.

Every class here is an :class:`~moejax.execution.executor.Executor` run
per device inside ``shard_map`` (:func:`moejax.layer.ep_moe_layer`)::

    y[T, d], extras = executor(experts, x[T, d], result, width_mask=m, capacity=C)

and registers itself under its dispatch unit (``ParallelConfig.
dispatch_unit``) with :func:`~moejax.execution.registry.register_dispatch`:

* :class:`CopyExecutor` (``copy``): one row per token copy, laid out by
  physical expert; a token with two experts on one device travels twice.
* :class:`TokenExecutor` (``token``): each token once per destination
  device, expanded to its experts there (:mod:`moejax.execution.dedup`).
* :class:`NodeExecutor` (``node``): once per destination node, then
  forwarded inside the node (two hops).

The wire is the executor's ``transport`` object
(:mod:`moejax.execution.transport`: padded bucketed all_to_all, native or
emulated ragged): an executor asks it for a layout and a round trip and
never compares a transport name. :func:`moejax.execution.parallel.prepare`
picks the class and the transport once from the config. A new strategy is a
new subclass of :class:`ExpertParallelExecutor` with a registered ``name``
and ``_exchange``, plus its agreement test (tests/parallel/test_executors.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moejax.balance import stats
from moejax.config import ParallelConfig
from moejax.execution import comm as comm_lib
from moejax.execution import dedup as dedup_lib
from moejax.execution import grouped_ffn
from moejax.execution import permute as permute_lib
from moejax.execution import placement as placement_lib
from moejax.execution import shape_choice
from moejax.execution import transport as transport_lib
from moejax.execution.mesh import EXPERT, FSDP
from moejax.execution.registry import register_dispatch
from moejax.routing.types import RoutingResult


def local_experts(params: dict, rows: jax.Array, slot: jax.Array, filled: jax.Array,
                  num_slots: int, *, activation: str, backend: str,
                  width_mask: Optional[jax.Array] = None,
                  weights: Optional[jax.Array] = None,
                  rule: Optional[shape_choice.ShapeRule] = None) -> jax.Array:
  """ys[R, d] = sum_k weights[r, k] FFN_{slot[r, k]}(rows[r]) over filled slots (grouped matmul).

  ``slot`` / ``filled`` / ``weights`` are [R, Kc] (a deduplicating dispatch:
  a row names its experts on this device) or [R] (per-copy: one expert per
  row, weight 1). rows[R, d] arrive in any order (by source device); a
  dropless sort by local expert gives the grouped-matmul layout, so empty
  buffer rows cost nothing in backends that skip rows past the groups
  (``blocked``).
  """
  if slot.ndim == 1:
    slot, filled = slot[:, None], filled[:, None]
    weights = None if weights is None else weights[:, None]
  w = filled.astype(jnp.float32) if weights is None else weights
  return grouped_ffn.routed_ffn(params, rows, slot.astype(jnp.int32), filled, w,
                                num_experts=num_slots, activation=activation,
                                backend=backend, width_mask=width_mask, rule=rule)


def _physical_ids(result: RoutingResult, sent: jax.Array, plc: placement_lib.Placement):
  """int32[T, K] physical expert of every slot (replica chosen by token index)."""
  logical = jnp.where(sent, result.expert_ids, 0)
  if int(plc.num_replicas.max()) == 1:
    return jnp.asarray(plc.replicas[:, 0], jnp.int32)[logical]
  reps = jnp.asarray(plc.replicas, jnp.int32)
  n = jnp.asarray(plc.num_replicas, jnp.int32)[logical]
  tok = jnp.arange(result.num_tokens, dtype=jnp.int32)[:, None]
  return reps[logical, tok % n]


def _gather_fsdp(experts: dict, has_fsdp: bool) -> dict:
  """Full-width local expert weights: the d axis was sharded over 'fsdp'."""
  if not has_fsdp:
    return experts
  # all_gather's transpose is a reduce-scatter: gradients come back sharded.
  return {k: jax.lax.all_gather(v, FSDP, axis=2 if k == "w_down" else 1, tiled=True)
          for k, v in experts.items()}


def node_size(node_of: np.ndarray) -> int:
  """P when the expert axis is N nodes of P consecutive positions; ValueError otherwise.

  The node dispatch exchanges among one device per node, then inside each
  node, which needs equal, contiguous nodes.
  """
  node_of = np.asarray(node_of)
  p = int(np.sum(node_of == node_of[0]))
  if len(node_of) % p or not np.array_equal(node_of, np.arange(len(node_of)) // p):
    raise ValueError(f"parallel.dispatch_unit='node' needs the expert axis split into equal "
                     f"nodes of consecutive devices; its nodes are {node_of.tolist()}. Fix: "
                     "set parallel.devices_per_node, or dispatch_unit='token'")
  return p


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertParallelExecutor:
  """The routed experts of one layer over the ``expert`` mesh axis (inside shard_map).

  The base of the registered dispatch units; built by
  :func:`moejax.execution.parallel.prepare` (:meth:`from_config`) and called
  by :func:`moejax.layer.moe_layer` like any executor. ``extras``:
  ``device_load`` f32[D] token copies each expert-axis position computed
  (summed over data groups) and ``comm`` (:mod:`moejax.execution.comm` byte
  counts, plus ``transport_dropped``, always 0 by construction).

  A subclass sets ``name`` and its capabilities and implements
  :meth:`_exchange`; the shared parts (FSDP gather, physical ids, local
  grouped matmul, statistics) stay here.
  """

  name: ClassVar[str] = ""
  expert_parallel: ClassVar[bool] = True
  deduplicates: ClassVar[bool] = False  # a token travels once per destination, not per copy
  needs_nodes: ClassVar[bool] = False   # needs equal nodes of consecutive devices

  num_experts: int
  activation: str
  placement: placement_lib.Placement
  backend: str                   # grouped-matmul backend of the local experts
  node_of: np.ndarray            # int[D] node of each expert-axis position
  axes: tuple                    # every mesh axis (the global statistics' scope)
  has_fsdp: bool
  transport: transport_lib.Transport
  buckets: int = 8               # ParallelConfig.capacity_buckets
  rule: Optional[shape_choice.ShapeRule] = None  # the local backend per shard shape

  @classmethod
  def options(cls, pcfg: ParallelConfig, node_of: np.ndarray) -> dict[str, Any]:
    """The class's own fields from the config (checked here: before any compute)."""
    del node_of
    return {"buckets": pcfg.capacity_buckets}

  @classmethod
  def from_config(cls, pcfg: ParallelConfig, node_of: np.ndarray, **common):
    return cls(node_of=node_of, **common, **cls.options(pcfg, node_of))

  def __call__(self, experts, x, result, *, width_mask=None, capacity=None):
    experts = _gather_fsdp(experts, self.has_fsdp)
    y, bytes_local, phys_rows, lost = self._dispatch_combine(experts, width_mask, x, result,
                                                             capacity)
    d, sp = self.placement.num_devices, self.placement.slots_per_device
    comm = comm_lib.summarize(bytes_local, self.axes)
    comm["transport_dropped"] = stats.psum(lost, self.axes)
    device_load = stats.psum(phys_rows.astype(jnp.float32), self.axes).reshape(d, sp).sum(-1)
    return y, {"device_load": device_load, "comm": comm}

  def _dispatch_combine(self, experts, width_mask, x, result, cap):
    """Routed-expert output y[T, d] plus (comm bytes, per-physical-expert rows, lost slots)."""
    plc = self.placement
    e, s, d = self.num_experts, plc.slots_per_device, plc.num_devices
    sent = result.valid & (result.expert_ids >= 0) & (result.expert_ids < e)
    phys = _physical_ids(result, sent, plc)
    weights = jnp.where(result.valid, result.weights, 0)
    ffn = functools.partial(local_experts, experts, num_slots=s, activation=self.activation,
                            backend=self.backend, width_mask=width_mask, rule=self.rule)
    me = jax.lax.axis_index(EXPERT)
    row_bytes = x.shape[-1] * x.dtype.itemsize
    y, bytes_local, dispatched, lost = self._exchange(x, phys, weights, sent, ffn, cap, me,
                                                      row_bytes)
    rows = jnp.bincount(jnp.where(dispatched & sent, phys, d * s).reshape(-1),
                        length=d * s + 1)[: d * s]
    return y, bytes_local, rows, lost

  def _exchange(self, x, phys, weights, sent, ffn, cap, me, row_bytes):
    """(y[T, d], bytes dict, dispatched bool[T, K], lost int32[]) for phys int32[T, K]."""
    raise NotImplementedError(f"{type(self).__name__} must implement _exchange")


@register_dispatch
@dataclasses.dataclass(frozen=True, eq=False)
class CopyExecutor(ExpertParallelExecutor):
  """One row per token copy: [E_p]-grouped rows, S_p sub-groups per destination device.

  The padded transport fills [E_p, C] (C = T dropless: a token sends at
  most one copy to an expert); the ragged ones send L-bounded segments.
  """

  name: ClassVar[str] = "copy"

  def _exchange(self, x, phys, weights, sent, ffn, cap, me, row_bytes):
    t, dm = x.shape
    k = phys.shape[1]
    s, d = self.placement.slots_per_device, self.placement.num_devices
    c = t if cap is None else cap
    plan = self.transport.layout(phys, sent, d * s, c)
    xs = permute_lib.permute(x, plan)                         # rows by physical expert
    back, wire_rows = self.transport.round_trip(
        (xs,), plan.group_sizes.reshape(d, s), lambda rows, slot, filled: ffn(rows[0], slot,
                                                                               filled),
        capacity=c, max_rows=t * min(k, s), buckets=self.buckets, axes=self.axes)
    y = permute_lib.unpermute(back, plan, weights).astype(x.dtype)
    dispatched = plan.dispatched()
    bytes_local = comm_lib.local_dispatch_bytes(phys // s, dispatched, wire_rows, me,
                                                self.node_of, row_bytes)
    return y, bytes_local, dispatched, jnp.sum(sent & ~dispatched, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class _DedupExecutor(ExpertParallelExecutor):
  """A token once per destination, through the hops of :meth:`hops` (dedup.py)."""

  deduplicates: ClassVar[bool] = True

  def hops(self, tokens: int, cap: Optional[int]) -> tuple[dedup_lib.Hop, ...]:
    raise NotImplementedError(f"{type(self).__name__} must implement hops")

  def _exchange(self, x, phys, weights, sent, ffn, cap, me, row_bytes):
    tally = dedup_lib.Tally(row_bytes, self.node_of, me)
    local = lambda rows, ids, w, valid: ffn(rows, ids, valid, weights=w)
    y = dedup_lib.dispatch_combine(x, phys, weights, sent, self.hops(x.shape[0], cap), local,
                                   transport=self.transport, buckets=self.buckets,
                                   axes=self.axes, tally=tally)
    bytes_local = dict(tally.bytes)
    s = self.placement.slots_per_device
    bytes_local.update(comm_lib.minimum_bytes(phys // s, sent, me, self.node_of, row_bytes))
    return y, bytes_local, sent, tally.lost


@register_dispatch
@dataclasses.dataclass(frozen=True, eq=False)
class TokenExecutor(_DedupExecutor):
  """Each token once per destination device: one hop over the expert axis."""

  name: ClassVar[str] = "token"

  def hops(self, tokens, cap):
    plc = self.placement
    return dedup_lib.token_hops(plc.num_devices, plc.slots_per_device, tokens, cap)


@register_dispatch
@dataclasses.dataclass(frozen=True, eq=False)
class NodeExecutor(_DedupExecutor):
  """Each token once per destination node (across nodes), then forwarded inside it.

  ``per_node``: P devices per node (one node, or one device per node,
  degenerates to the token hop).
  """

  name: ClassVar[str] = "node"
  needs_nodes: ClassVar[bool] = True

  per_node: int = 1

  @classmethod
  def options(cls, pcfg, node_of):
    return {**super().options(pcfg, node_of), "per_node": node_size(node_of)}

  def hops(self, tokens, cap):
    plc = self.placement
    return dedup_lib.node_hops(plc.num_devices, plc.slots_per_device, self.per_node, tokens,
                               cap)
