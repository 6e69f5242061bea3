"""Preparing the expert-parallel layer: layout checks, the executor choice, shard_map inputs.

Legend: B batch, S sequence length, T tokens on one device, d model width,
K slots per token, E logical FFN experts, D devices on the ``expert`` axis,
S_p physical expert slots per device (E / D without a placement), E_p = D *
S_p physical experts, C capacity per (device, expert), f expert hidden width,
L = T * min(K, S_p) most rows one device can send to another.

The expert-parallel MoE layer is :func:`moejax.layer.ep_moe_layer`: the one
MoE layer (:func:`moejax.layer.moe_layer`) run under ``jax.shard_map`` with
an expert-parallel executor (:mod:`moejax.execution.dispatch`, one class
per ``ParallelConfig.dispatch_unit``) and the mesh axes as ``axis_names``
(so loads, MaxVio and global-scope losses are reduced over the whole mesh).
Per device, the executor does::

    local permute -> all_to_all over 'expert' -> grouped matmul on the S_p
    local experts -> all_to_all back -> combine (unpermute, gate, sum)

Routing, capacity, zero-computation and shared experts, losses and metrics
stay in the layer. This module prepares the inputs of that ``shard_map``
(:func:`prepare`: placement replicas, partition specs) and picks, once,
the executor class registered under ``dispatch_unit`` and the transport
object registered under :func:`resolve_dispatch`'s name (:func:`select`,
:mod:`moejax.execution.registry`).

Transports (``ParallelConfig.dispatch``, :mod:`moejax.execution.transport`):

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
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moejax.config import MoEConfig, ParallelConfig, check_experts, check_route_limit
from moejax.execution import dispatch as dispatch_lib
from moejax.execution import executor as executor_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import mesh as mesh_lib
from moejax.execution import placement as placement_lib
from moejax.execution import registry
from moejax.execution import shape_choice
from moejax.execution import transport
from moejax.execution.mesh import EXPERT, FSDP

# The executors live in moejax.execution.dispatch (kept importable here).
ExpertParallelExecutor = dispatch_lib.ExpertParallelExecutor
local_experts = dispatch_lib.local_experts
node_size = dispatch_lib.node_size
# The emulated collective lives in moejax.execution.transport.
emulated_ragged_all_to_all = transport.emulated_ragged_all_to_all

# Kept importable here; the platforms belong to the native transport.
NATIVE_RAGGED_PLATFORMS = transport.NATIVE_RAGGED_PLATFORMS


class RaggedUnsupportedError(ValueError):
  """``ragged_all_to_all`` was asked for natively on a platform without it."""


def resolve_dispatch(pcfg: ParallelConfig, platform: str) -> str:
  """'capacity', 'ragged_native' or 'ragged_emulated' for ``platform`` (a transport's name)."""
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


def select(pcfg: ParallelConfig, platform: str) -> tuple[type, transport.Transport]:
  """(executor class, transport object) the config names on ``platform``: the one choice.

  The class is the one registered under ``pcfg.dispatch_unit``, the
  transport the one registered under :func:`resolve_dispatch`'s name, with
  its bucket switch on where the runtime keeps a branch's collectives in
  order (:func:`moejax.execution.transport.bucket_switch_for`; off on CPU).
  Raises RaggedUnsupportedError (native ragged off GPU/TPU) or
  ``registry.RegistryError`` (a name nothing registered).
  """
  cls = registry.EXECUTORS.get(pcfg.dispatch_unit)
  wire = registry.TRANSPORTS.get(resolve_dispatch(pcfg, platform))
  return cls, wire(bucket_switch=transport.bucket_switch_for(platform))


def gmm_backend_for(cfg: MoEConfig, platform: Optional[str] = None) -> str:
  """The local experts' grouped-matmul backend on ``platform`` (default: JAX's).

  ``auto`` is resolved as the single-device layer resolves it
  (:func:`moejax.execution.gmm.resolve_backend`); the layer's ``reference``
  (a per-expert loop, not a grouped matmul) runs as ``ragged_dot``.
  """
  backend = gmm_lib.resolve_backend(cfg.execution.backend, platform)
  return "ragged_dot" if backend == "reference" else backend


def shape_rule_for(cfg: MoEConfig, platform: Optional[str] = None) -> shape_choice.ShapeRule:
  """The local experts' shape rule on ``platform``: :func:`gmm_backend_for`, with
  the large-group backend of ``cfg.execution`` (``auto``: the one it resolves to)."""
  ex = executor_lib.resolve_execution(cfg, platform).execution
  return shape_choice.ShapeRule.from_execution(ex, gmm_backend_for(cfg, platform))


def device_index(axes) -> jax.Array:
  """int32[] this device's position in the mesh (row-major over ``axes``), inside shard_map."""
  idx = jnp.zeros((), jnp.int32)
  for a in axes:
    idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
  return idx


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
  width_mask: [E_p, f] or None; executor: the expert-parallel executor (an
  instance of the registered class :func:`select` picked).
  """

  params: dict
  param_specs: Any
  token_spec: P
  width_mask: Optional[jax.Array]
  executor: dispatch_lib.ExpertParallelExecutor


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
  executor_cls, transport_obj = select(pcfg, mesh.devices.flat[0].platform)
  params = dict(params)
  identity = plc.slots_per_device * d == cfg.num_experts and \
      np.array_equal(plc.phys_to_logical, np.arange(cfg.num_experts))
  if not identity:
    p2l = jnp.asarray(plc.phys_to_logical, jnp.int32)
    params["experts"] = jax.tree.map(lambda w: jnp.take(w, p2l, axis=0), params["experts"])
    if width_mask is not None:
      width_mask = jnp.take(width_mask, p2l, axis=0)
  executor = executor_cls.from_config(
      pcfg, node_of, num_experts=cfg.num_experts, activation=cfg.topology.activation,
      placement=plc, backend=gmm_backend_for(cfg, mesh.devices.flat[0].platform), axes=axes,
      has_fsdp=has_fsdp, transport=transport_obj,
      rule=shape_rule_for(cfg, mesh.devices.flat[0].platform))
  return Prepared(params, mesh_lib.param_specs(params, mesh), mesh_lib.batch_spec(mesh),
                  width_mask, executor)
