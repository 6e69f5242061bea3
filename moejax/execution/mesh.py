"""Device meshes for expert parallelism, and the expert -> device -> node map.

Legend: N devices, D_d data replicas, D_f fsdp shards, D expert shards (the
``expert`` mesh axis), E routed FFN experts, E_loc = E / D experts per
device, P devices per node, B batch, d model width, f expert hidden width.

A mesh has the axes ``('data', 'fsdp', 'expert')`` in that order, so the
``expert`` axis is innermost: the D devices of one expert-parallel group
are consecutive devices (on one host where they fit, which is where the
all_to_all is cheapest). Layout contract of :mod:`moejax.execution.parallel`:

* activations [B, S, d]: the batch is split over every mesh axis
  (``P(('data', 'fsdp', 'expert'))``): each device holds B / N whole
  sequences, and the global batch is the concatenation in mesh order;
* routed expert weights [E, d, f] / [E, f, d]: the expert axis over
  ``expert`` (device j holds experts [j E_loc, (j+1) E_loc)), the d axis
  over ``fsdp`` (gathered inside the layer, FSDP style), replicated over
  ``data``;
* everything else (router, shared and zero-computation experts, router
  state) is replicated.

Nodes: expert-axis position j sits on node j // P (``devices_per_node``;
default: the devices of one process form one node). Expert e therefore lives
on device e // E_loc and node (e // E_loc) // P; node- and device-limited
routing over that map is resolved into the routing config when the
experiment config is built (:func:`moejax.config.resolve_route_limit`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.config import MoEConfig, ParallelConfig, check_experts

DATA, FSDP, EXPERT = "data", "fsdp", "expert"
AXES = (DATA, FSDP, EXPERT)


def make_mesh(pcfg: ParallelConfig, devices: Optional[Sequence[jax.Device]] = None,
              cfg: Optional[MoEConfig] = None) -> Mesh:
  """A ('data', 'fsdp', 'expert') mesh over ``devices`` (default: all).

  ``jax.sharding.Mesh`` keeps Auto axis types, so jit reshards inputs to the
  layer's specs by itself (``jax.make_mesh`` would default to Explicit axes).
  With ``cfg``, the expert count is checked against the expert axis too.
  """
  devs = list(jax.devices() if devices is None else devices)
  shape = pcfg.axis_sizes(len(devs))
  if cfg is not None:
    check_experts(pcfg, cfg)
  return Mesh(np.asarray(devs, dtype=object).reshape(shape), AXES)


def mesh_axes(mesh: Mesh) -> tuple[str, ...]:
  """The token axes of ``mesh`` (its axes, checked to be a subset of AXES with 'expert')."""
  names = tuple(mesh.axis_names)
  extra = [a for a in names if a not in AXES]
  if extra or EXPERT not in names:
    raise ValueError(f"mesh axes {names}: the expert-parallel layer needs an 'expert' "
                     f"axis and accepts only {AXES} (unknown: {extra}). Fix: build the "
                     "mesh with moejax.execution.mesh.make_mesh")
  return names


def axis_size(mesh: Mesh, name: str) -> int:
  return int(mesh.shape[name]) if name in mesh.axis_names else 1


def batch_spec(mesh: Mesh) -> P:
  """PartitionSpec of [B, ...] activations: B over every mesh axis."""
  return P(mesh_axes(mesh))


def expert_param_specs(expert_params: dict, mesh: Mesh) -> dict:
  """PartitionSpecs of the routed expert weights: E over 'expert', d over 'fsdp'."""
  fsdp = FSDP if FSDP in mesh.axis_names else None
  return {k: (P(EXPERT, None, fsdp) if k == "w_down" else P(EXPERT, fsdp, None))
          for k in expert_params}


def param_specs(params: dict, mesh: Mesh) -> dict:
  """PartitionSpecs for a :func:`moejax.layer.init_moe_params` tree."""
  specs = jax.tree.map(lambda _: P(), params)
  if "experts" in params:
    specs["experts"] = expert_param_specs(params["experts"], mesh)
  return specs


def shard_params(params: dict, mesh: Mesh) -> dict:
  """``params`` placed on ``mesh`` by :func:`param_specs`."""
  specs = param_specs(params, mesh)
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)


def shard_batch(x, mesh: Mesh):
  """A [B, ...] array placed on ``mesh`` with B over every axis."""
  return jax.device_put(x, NamedSharding(mesh, batch_spec(mesh)))


# --- Experts -> devices -> nodes. ------------------------------------------

def nodes_of_expert_axis(mesh: Mesh, devices_per_node: Optional[int]) -> np.ndarray:
  """int[D]: node of each expert-axis position (within one expert group).

  With ``devices_per_node`` P: position j is on node j // P (all on node 0
  when P >= D). Otherwise nodes are processes: positions whose devices (in the
  first data/fsdp row) belong to one process share a node, numbered in order.
  """
  d = axis_size(mesh, EXPERT)
  if devices_per_node is not None:
    return np.arange(d) // devices_per_node
  row = np.asarray(mesh.devices).reshape(-1, d)[0]
  procs = [dev.process_index for dev in row]
  _, node = np.unique(procs, return_inverse=True)
  return node.astype(np.int64)
