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
on device e // E_loc and node (e // E_loc) // P. :func:`limited_moe_config`
turns that map into DeepSeek's node-limited (V3: M nodes) or device-limited
(V2: M devices) routing, which is group-limited routing with one group per
node or device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.config import ConfigError, MoEConfig, check_choice, check_positive

DATA, FSDP, EXPERT = "data", "fsdp", "expert"
AXES = (DATA, FSDP, EXPERT)
DISPATCHES = ("capacity", "ragged")
RAGGED_IMPLS = ("auto", "native", "emulated")
ROUTE_LIMITS = ("none", "nodes", "devices")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How the layer is laid out over devices and how tokens travel.

  data / fsdp / expert: mesh axis sizes; ``data=-1`` takes every device the
    other two leave. Their product must equal the device count.
  devices_per_node: P, expert-axis devices per node for node-limited routing
    and the cross-node byte count; None: one node per process (from the
    devices' ``process_index``).
  dispatch: ``capacity`` (padded [D, E_loc, C, d] all_to_all; runs
    everywhere) or ``ragged`` (dropless, exact-size segments with
    ``jax.lax.ragged_all_to_all``).
  ragged_impl: for ``ragged``: ``native`` (the XLA collective; GPU/TPU),
    ``emulated`` (the same segments moved by a padded all_to_all; exact, for
    platforms without the collective, CPU among them) or ``auto`` (native on
    GPU/TPU, emulated elsewhere).
  route_limit / route_limit_count: limit each token's experts to M =
    route_limit_count ``nodes`` (DeepSeek-V3) or ``devices`` (DeepSeek-V2);
    ``none`` keeps the router's own grouping.
  gmm_backend: grouped-matmul backend for the local experts; None follows
    ``moe.backend`` (``reference`` maps to ``ragged_dot``).
  """

  data: int = -1
  fsdp: int = 1
  expert: int = 1
  devices_per_node: Optional[int] = None
  dispatch: str = "capacity"
  ragged_impl: str = "auto"
  route_limit: str = "none"
  route_limit_count: int = 1
  gmm_backend: Optional[str] = None

  def __post_init__(self):
    p = "parallel"
    check_choice(f"{p}.dispatch", self.dispatch, DISPATCHES)
    check_choice(f"{p}.ragged_impl", self.ragged_impl, RAGGED_IMPLS)
    check_choice(f"{p}.route_limit", self.route_limit, ROUTE_LIMITS)
    if self.data != -1:
      check_positive(f"{p}.data", self.data)
    check_positive(f"{p}.fsdp", self.fsdp)
    check_positive(f"{p}.expert", self.expert)
    check_positive(f"{p}.route_limit_count", self.route_limit_count)
    if self.devices_per_node is not None:
      check_positive(f"{p}.devices_per_node", self.devices_per_node)
      big, small = max(self.expert, self.devices_per_node), min(self.expert,
                                                                self.devices_per_node)
      if big % small:
        raise ConfigError(f"{p}.devices_per_node", self.devices_per_node,
                          f"neither divides nor is a multiple of {p}.expert={self.expert}, "
                          "so nodes would cut expert-parallel groups unevenly",
                          f"use a divisor or a multiple of {self.expert}")
    if self.gmm_backend is not None:
      from moejax.execution import gmm as gmm_lib
      check_choice(f"{p}.gmm_backend", self.gmm_backend, gmm_lib.BACKENDS)

  def axis_sizes(self, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, expert) for ``num_devices``; ConfigError if they do not divide."""
    other = self.fsdp * self.expert
    if self.data == -1:
      if num_devices % other:
        raise ConfigError("parallel.expert", self.expert,
                          f"fsdp * expert = {self.fsdp} * {self.expert} = {other} does "
                          f"not divide the {num_devices} devices",
                          f"pick fsdp * expert among the divisors of {num_devices}")
      return num_devices // other, self.fsdp, self.expert
    if self.data * other != num_devices:
      raise ConfigError("parallel.data", self.data,
                        f"data * fsdp * expert = {self.data} * {self.fsdp} * {self.expert}"
                        f" = {self.data * other} but there are {num_devices} devices",
                        "make the product equal the device count, or set data=-1")
    return self.data, self.fsdp, self.expert


def check_experts(pcfg: ParallelConfig, cfg: MoEConfig) -> None:
  """ConfigError when the experts do not split evenly over the expert axis."""
  if cfg.kind != "sparse":
    raise ConfigError("moe.kind", cfg.kind,
                      "expert parallelism moves routed tokens; soft and PEER layers "
                      "have no per-token expert assignment", "use moe.kind='sparse'")
  if cfg.num_experts % pcfg.expert:
    raise ConfigError("parallel.expert", pcfg.expert,
                      f"does not divide moe.num_experts={cfg.num_experts}",
                      f"pick expert among the divisors of {cfg.num_experts}")


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


def limited_moe_config(cfg: MoEConfig, pcfg: ParallelConfig,
                       num_nodes: Optional[int] = None) -> MoEConfig:
  """``cfg`` with routing limited to M nodes or M devices of the expert axis.

  Node-limited routing is group-limited routing (moejax.routing.groups)
  whose groups are the experts of one node (``nodes``, DeepSeek-V3: the sum
  of the top-2 biased scores ranks nodes) or one device (``devices``,
  DeepSeek-V2: the max score), with ``topk_groups`` = M. The group score
  convention follows ``moe.router.group_score`` (``auto``: top2_sum with a
  bias, max without). The single-device layer run with the returned config
  makes exactly the routing decisions of the expert-parallel layer.

  Args:
    num_nodes: nodes on the expert axis; default D / devices_per_node (needs
      ``pcfg.devices_per_node``).
  """
  if pcfg.route_limit == "none":
    return cfg
  check_experts(pcfg, cfg)
  if pcfg.route_limit == "devices":
    groups = pcfg.expert
  elif num_nodes is not None:
    groups = num_nodes
  elif pcfg.devices_per_node is not None:
    groups = max(1, pcfg.expert // pcfg.devices_per_node)
  else:
    raise ConfigError("parallel.devices_per_node", None,
                      "node-limited routing needs the node count",
                      "set parallel.devices_per_node (or pass num_nodes)")
  m = pcfg.route_limit_count
  r = cfg.router
  if cfg.num_zero_compute:
    raise ConfigError("parallel.route_limit", pcfg.route_limit,
                      "zero-computation experts are router columns without a device, so "
                      "node groups over all router outputs would be misaligned",
                      "use zero_experts=copy_experts=constant_experts=0 or route_limit='none'")
  if r.kind != "topk":
    raise ConfigError("parallel.route_limit", pcfg.route_limit,
                      f"node/device limits are a token-choice top-k rule, not {r.kind!r}",
                      "use moe.router.kind='topk' or route_limit='none'")
  if m > groups:
    raise ConfigError("parallel.route_limit_count", m,
                      f"exceeds the {groups} {pcfg.route_limit} of the expert axis",
                      f"use at most {groups}")
  if r.n_groups > 1 and (r.n_groups, r.topk_groups) != (groups, m):
    raise ConfigError("moe.router.n_groups", r.n_groups,
                      f"conflicts with parallel.route_limit={pcfg.route_limit!r}, which "
                      f"sets n_groups={groups}, topk_groups={m}",
                      "set moe.router.n_groups=1 and let the mesh choose the groups")
  per = (cfg.num_experts // groups) * m
  if r.top_k > per:
    raise ConfigError("parallel.route_limit_count", m,
                      f"leaves {per} experts on {m} {pcfg.route_limit} of "
                      f"{cfg.num_experts // groups} experts, fewer than top_k={r.top_k}",
                      f"raise route_limit_count to {math.ceil(r.top_k * groups / cfg.num_experts)}")
  router = dataclasses.replace(r, n_groups=groups, topk_groups=m)
  return dataclasses.replace(cfg, router=router)
