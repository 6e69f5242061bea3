"""The expert-parallel executor: dispatch over the ``expert`` mesh axis, then back.

Legend: B batch, S sequence length, T tokens on one device, d model width,
K slots per token, E logical FFN experts, D devices on the ``expert`` axis,
S_p physical expert slots per device (E / D without a placement), E_p = D *
S_p physical experts, C capacity per (device, expert), f expert hidden width,
L = T * min(K, S_p) most rows one device can send to another.

The expert-parallel MoE layer is :func:`moejax.layer.ep_moe_layer`: the one
MoE layer (:func:`moejax.layer.moe_layer`) run under ``jax.shard_map`` with
the :class:`ExpertParallelExecutor` of this module and the mesh axes as
``axis_names`` (so loads, MaxVio and global-scope losses are reduced over
the whole mesh). Per device, the executor does::

    local permute -> all_to_all over 'expert' -> grouped matmul on the S_p
    local experts -> all_to_all back -> combine (unpermute, gate, sum)

Routing, capacity, zero-computation and shared experts, losses and metrics
stay in the layer. This module also prepares the inputs of that
``shard_map`` (:func:`prepare`: placement replicas, partition specs).

Dispatch paths (``ParallelConfig.dispatch``):

* ``capacity``: every device fills an [E_p, C] buffer (``permute.
  capacity_layout``) and the all_to_all moves fixed [S_p, C, d] slices;
  runs on every backend, CPU included. With ``moe.balance.capacity_factor``
  set, C is the layer's capacity; dropless layers use C = T (a token sends
  at most one copy to an expert), exact but padded: the padding shows in
  ``aux['execution']['comm']['padding_waste']``.
* ``ragged``: dropless and unpadded: rows sorted by expert
  (``permute.sort_by_expert``) travel in exact-size segments with
  ``jax.lax.ragged_all_to_all`` (``native``, GPU/TPU). XLA:CPU does not
  implement that collective; there ``emulated`` moves the same segments
  through a padded all_to_all of [D, L, d] and scatters them at the offsets
  the native collective would use, so the whole ragged bookkeeping is
  tested on CPU and the results are identical. ``native`` on a platform
  without the collective is refused before compiling.

**Capacity semantics** (GShard's groups): the global batch is split into
one group per device (its B / N sequences); the layer applies its capacity
rule per group, so the expert-parallel layer drops exactly what the
single-device layer drops when called on each device's shard.

A :class:`~moejax.execution.placement.Placement` moves and replicates
experts over devices without changing any routing decision (see that
module); the per-device work shows in ``aux['execution']['device_load']``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moejax.balance import stats
from moejax.config import MoEConfig, ParallelConfig, check_experts, check_route_limit
from moejax.execution import comm as comm_lib
from moejax.execution import grouped_ffn
from moejax.execution import mesh as mesh_lib
from moejax.execution import permute as permute_lib
from moejax.execution import placement as placement_lib
from moejax.execution.mesh import EXPERT, FSDP
from moejax.routing.types import RoutingResult

NATIVE_RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


class RaggedUnsupportedError(ValueError):
  """``ragged_all_to_all`` was asked for natively on a platform without it."""


def resolve_dispatch(pcfg: ParallelConfig, platform: str) -> str:
  """'capacity', 'ragged_native' or 'ragged_emulated' for ``platform``."""
  if pcfg.dispatch == "capacity":
    return "capacity"
  native = platform in NATIVE_RAGGED_PLATFORMS
  if pcfg.ragged_impl == "native" and not native:
    raise RaggedUnsupportedError(
        f"parallel.ragged_impl='native': jax.lax.ragged_all_to_all is not implemented on "
        f"{platform!r} (XLA:CPU has no ragged-all-to-all). Fix: ragged_impl='emulated' "
        "(same segments over a padded all_to_all, identical results) or 'auto', or "
        "dispatch='capacity'")
  if pcfg.ragged_impl == "emulated" or not native:
    return "ragged_emulated"
  return "ragged_native"


def gmm_backend_for(cfg: MoEConfig) -> str:
  """The local experts' grouped-matmul backend (the layer's ``reference`` -> ``ragged_dot``)."""
  return "ragged_dot" if cfg.execution.backend == "reference" else cfg.execution.backend


# --- Local pieces (run per device inside shard_map). ------------------------

def _a2a(x: jax.Array) -> jax.Array:
  """all_to_all over 'expert' of [D * n, ...]: chunk j goes to device j."""
  return jax.lax.all_to_all(x, EXPERT, 0, 0, tiled=True)


def local_experts(params: dict, rows: jax.Array, slot: jax.Array, filled: jax.Array,
                  num_slots: int, *, activation: str, backend: str,
                  width_mask: Optional[jax.Array] = None) -> jax.Array:
  """ys[R, d] = FFN_{slot[r]}(rows[r]) where filled, else 0 (grouped matmul).

  rows[R, d] arrive in any order (by source device); a dropless sort by
  local expert gives the grouped-matmul layout, so empty buffer rows cost
  nothing in backends that skip rows past the groups (``blocked``).
  """
  return grouped_ffn.routed_ffn(params, rows, slot[:, None].astype(jnp.int32),
                                filled[:, None], filled.astype(jnp.float32)[:, None],
                                num_experts=num_slots, activation=activation,
                                backend=backend, width_mask=width_mask)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                               output_offsets, recv_sizes, *, max_rows: int):
  """``jax.lax.ragged_all_to_all`` over 'expert' built from a padded all_to_all.

  Same arguments and result as the native collective (``output`` with the
  received segments written at the senders' ``output_offsets``), for
  segments of at most ``max_rows`` rows. Differentiable (gather / scatter).
  """
  p = jnp.arange(max_rows, dtype=jnp.int32)
  take = jnp.where(p[None, :] < send_sizes[:, None], input_offsets[:, None] + p[None, :],
                   operand.shape[0])
  buf = jnp.take(operand, take.reshape(-1), axis=0, mode="fill", fill_value=0)
  got = _a2a(buf)                                                # [D * max_rows, ...]
  at = _a2a(output_offsets)                                      # where source i writes here
  pos = jnp.where(p[None, :] < recv_sizes[:, None], at[:, None] + p[None, :],
                  output.shape[0])
  return output.at[pos.reshape(-1)].set(got.astype(output.dtype), mode="drop")


def _ragged(impl: str, max_rows: int):
  if impl == "ragged_native":
    return lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=EXPERT)
  return functools.partial(emulated_ragged_all_to_all, max_rows=max_rows)


def _physical_ids(result: RoutingResult, sent: jax.Array, plc: placement_lib.Placement):
  """int32[T, K] physical expert of every slot (replica chosen by token index)."""
  logical = jnp.where(sent, result.expert_ids, 0)
  if int(plc.num_replicas.max()) == 1:
    return jnp.asarray(plc.replicas[:, 0], jnp.int32)[logical]
  reps = jnp.asarray(plc.replicas, jnp.int32)
  n = jnp.asarray(plc.num_replicas, jnp.int32)[logical]
  tok = jnp.arange(result.num_tokens, dtype=jnp.int32)[:, None]
  return reps[logical, tok % n]


def _dispatch_combine(experts, width_mask, x, result, *, num_experts, activation, impl, plc,
                      cap, backend, node_of):
  """Routed-expert output y[T, d] plus (comm bytes, per-physical-expert rows, transport drops)."""
  t, dm = x.shape
  k = result.k
  e, s = num_experts, plc.slots_per_device
  d = plc.num_devices
  sent = result.valid & (result.expert_ids >= 0) & (result.expert_ids < e)
  phys = _physical_ids(result, sent, plc)
  weights = jnp.where(result.valid, result.weights, 0)
  ffn = functools.partial(local_experts, num_slots=s, activation=activation,
                          backend=backend, width_mask=width_mask)
  if impl == "capacity":
    c = t if cap is None else cap
    plan = permute_lib.capacity_layout(phys, sent, d * s, c)
    xs = permute_lib.permute(x, plan)                        # [E_p * C, d]
    recv = _a2a(xs)                                          # [D(src) * S_p * C, d]
    counts = _a2a(plan.group_sizes.reshape(d, s))            # [D(src), S_p]
    p = jnp.arange(c, dtype=jnp.int32)
    filled = p[None, None, :] < counts[:, :, None]           # [D, S_p, C]
    slot = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :, None], filled.shape)
    ys = ffn(experts, recv, slot.reshape(-1), filled.reshape(-1))
    back = _a2a(ys)                                          # [E_p * C, d]
    wire_rows = jnp.full((d,), s * c, jnp.int32)
  else:
    max_rows = t * min(k, s)
    move = _ragged(impl, max_rows)
    plan = permute_lib.sort_by_expert(phys, sent, d * s)
    xs = permute_lib.permute(x, plan)                        # [T K, d] by physical expert
    gs = plan.group_sizes.reshape(d, s)
    send_sizes = jnp.sum(gs, axis=1).astype(jnp.int32)
    in_off = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    counts = _a2a(gs)                                        # [D(src), S_p]
    recv_sizes = jnp.sum(counts, axis=1).astype(jnp.int32)
    recv_off = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    out_off = _a2a(recv_off)                                 # my segment's place on device j
    n_out = d * max_rows
    recv = move(xs, jnp.zeros((n_out, dm), x.dtype), in_off, send_sizes, out_off,
                recv_sizes)
    # Received rows: by source, then by local slot. Row r's slot comes from
    # the (source, slot) segment ends, which never decrease in r.
    ends = (recv_off[:, None] + jnp.cumsum(counts, axis=1)).reshape(-1)
    seg = jnp.searchsorted(ends, jnp.arange(n_out, dtype=jnp.int32), side="right")
    filled = seg < d * s
    ys = ffn(experts, recv, jnp.where(filled, seg % s, 0), filled)
    back_off = _a2a(in_off)                                  # my rows' place on each source
    back = move(ys, jnp.zeros((t * k, dm), x.dtype), recv_off, recv_sizes, back_off,
                send_sizes)
    wire_rows = send_sizes if impl == "ragged_native" else jnp.full((d,), max_rows,
                                                                     jnp.int32)
  y = permute_lib.unpermute(back, plan, weights).astype(x.dtype)
  dispatched = plan.dispatched()
  me = jax.lax.axis_index(EXPERT)
  bytes_local = comm_lib.local_dispatch_bytes(phys // s, dispatched, wire_rows, me,
                                              node_of, dm * x.dtype.itemsize)
  lost = jnp.sum(sent & ~dispatched, dtype=jnp.int32)
  return y, bytes_local, plan.group_sizes, lost


def _gather_fsdp(experts: dict, has_fsdp: bool) -> dict:
  """Full-width local expert weights: the d axis was sharded over 'fsdp'."""
  if not has_fsdp:
    return experts
  # all_gather's transpose is a reduce-scatter: gradients come back sharded.
  return {k: jax.lax.all_gather(v, FSDP, axis=2 if k == "w_down" else 1, tiled=True)
          for k, v in experts.items()}




def device_index(axes) -> jax.Array:
  """int32[] this device's position in the mesh (row-major over ``axes``), inside shard_map."""
  idx = jnp.zeros((), jnp.int32)
  for a in axes:
    idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
  return idx


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertParallelExecutor:
  """The routed experts of one layer over the ``expert`` mesh axis (inside shard_map).

  Built by :func:`prepare`; called by :func:`moejax.layer.moe_layer` like any
  executor. ``extras``: ``device_load`` f32[D] token copies each expert-axis
  position computed (summed over data groups) and ``comm``
  (:mod:`moejax.execution.comm` byte counts, plus ``transport_dropped``,
  always 0 by construction).
  """

  num_experts: int
  activation: str
  impl: str                      # capacity | ragged_native | ragged_emulated
  placement: placement_lib.Placement
  backend: str                   # grouped-matmul backend of the local experts
  node_of: np.ndarray            # int[D] node of each expert-axis position
  axes: tuple                    # every mesh axis (the global statistics' scope)
  has_fsdp: bool

  def __call__(self, experts, x, result, *, width_mask=None, capacity=None):
    experts = _gather_fsdp(experts, self.has_fsdp)
    y, bytes_local, phys_rows, lost = _dispatch_combine(
        experts, width_mask, x, result, num_experts=self.num_experts,
        activation=self.activation, impl=self.impl, plc=self.placement, cap=capacity,
        backend=self.backend, node_of=self.node_of)
    d, sp = self.placement.num_devices, self.placement.slots_per_device
    comm = comm_lib.summarize(bytes_local, self.axes)
    comm["transport_dropped"] = stats.psum(lost, self.axes)
    device_load = stats.psum(phys_rows.astype(jnp.float32), self.axes).reshape(d, sp).sum(-1)
    return y, {"device_load": device_load, "comm": comm}


def check_placement(plc: placement_lib.Placement, cfg: MoEConfig, pcfg: ParallelConfig,
                    node_of: np.ndarray) -> None:
  """ValueError when the placement does not fit the mesh or breaks a routing limit."""
  if plc.num_experts != cfg.num_experts or plc.num_devices != pcfg.expert:
    raise ValueError(f"placement covers {plc.num_experts} experts on {plc.num_devices} "
                     f"devices; the layer has moe.topology.num_experts={cfg.num_experts} on "
                     f"parallel.expert={pcfg.expert}. Fix: compute_placement(load, "
                     f"{pcfg.expert}, ...) with this config's load")
  if pcfg.route_limit == "none":
    return
  home = np.arange(cfg.num_experts) // (cfg.num_experts // pcfg.expert)
  where = plc.device_of_slot()
  home_of_slot = home[plc.phys_to_logical]
  if pcfg.route_limit == "devices":
    bad = where != home_of_slot
  else:
    bad = node_of[where] != node_of[home_of_slot]
  if bad.any():
    raise ValueError(f"the placement moves experts {sorted(set(plc.phys_to_logical[bad]))} "
                     f"off their {pcfg.route_limit[:-1]}, which breaks parallel.route_limit="
                     f"{pcfg.route_limit!r} (tokens are limited by the contiguous layout). "
                     "Fix: compute_placement(..., devices_per_node=P, keep_nodes=True) "
                     "with route_limit='nodes', or route_limit='none'")


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
  """What :func:`moejax.layer.ep_moe_layer` needs to run the layer under shard_map.

  params: the layer params with the routed experts in physical order (replica
  weights gathered from the logical ones, so every replica's gradient sums
  into its expert); param_specs / token_spec: their PartitionSpecs;
  width_mask: [E_p, f] or None; executor: the expert-parallel executor.
  """

  params: dict
  param_specs: Any
  token_spec: P
  width_mask: Optional[jax.Array]
  executor: ExpertParallelExecutor


def prepare(params: dict, cfg: MoEConfig, mesh: Mesh, pcfg: ParallelConfig, batch: int,
            d_model: int, *, width_mask: Optional[jax.Array] = None,
            placement: Optional[placement_lib.Placement] = None) -> Prepared:
  """Checks the layout and builds the executor and the shard_map inputs (no compute).

  Raises ValueError / ConfigError naming the mismatch (expert axis, batch
  divisibility, fsdp, placement, unresolved routing limit, native ragged
  dispatch on a platform without it).
  """
  axes = mesh_lib.mesh_axes(mesh)
  d = mesh_lib.axis_size(mesh, EXPERT)
  if d != pcfg.expert:
    raise ValueError(f"parallel.expert={pcfg.expert} but the mesh's 'expert' axis has "
                     f"{d} devices. Fix: build the mesh with make_mesh(pcfg)")
  check_experts(pcfg, cfg)
  check_route_limit(cfg, pcfg)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  if batch % n:
    raise ValueError(f"ep_moe_layer: batch B={batch} is not divisible by the {n} "
                     f"devices of mesh {dict(mesh.shape)}. Fix: use a multiple of {n}")
  has_fsdp = mesh_lib.axis_size(mesh, FSDP) > 1
  if has_fsdp and d_model % mesh_lib.axis_size(mesh, FSDP):
    raise ValueError(f"d_model={d_model} is not divisible by the fsdp axis "
                     f"({mesh_lib.axis_size(mesh, FSDP)}). Fix: parallel.fsdp must divide d")
  node_of = mesh_lib.nodes_of_expert_axis(mesh, pcfg.devices_per_node)
  plc = placement or placement_lib.identity_placement(cfg.num_experts, d)
  check_placement(plc, cfg, pcfg, node_of)
  impl = resolve_dispatch(pcfg, mesh.devices.flat[0].platform)
  params = dict(params)
  identity = plc.slots_per_device * d == cfg.num_experts and \
      np.array_equal(plc.phys_to_logical, np.arange(cfg.num_experts))
  if not identity:
    p2l = jnp.asarray(plc.phys_to_logical, jnp.int32)
    params["experts"] = jax.tree.map(lambda w: jnp.take(w, p2l, axis=0), params["experts"])
    if width_mask is not None:
      width_mask = jnp.take(width_mask, p2l, axis=0)
  executor = ExpertParallelExecutor(
      num_experts=cfg.num_experts, activation=cfg.topology.activation, impl=impl,
      placement=plc, backend=gmm_backend_for(cfg), node_of=node_of, axes=axes,
      has_fsdp=has_fsdp)
  return Prepared(params, mesh_lib.param_specs(params, mesh), mesh_lib.batch_spec(mesh),
                  width_mask, executor)
