"""ParallelConfig: the device layout, and node-limited routing resolved from it.

Legend: D expert-axis devices, E routed FFN experts, P devices per node, M
nodes (or devices) a token may reach.

A mesh has the axes ``('data', 'fsdp', 'expert')``; expert e lives on
expert-axis device e // (E / D) and node (e // (E / D)) // P. Node-limited
routing (DeepSeek-V3: M = 4 of 8 nodes) and device-limited routing
(DeepSeek-V2: M = 3 of 8 devices) are group-limited routing whose groups are
the experts of one node or one device; :func:`resolve_route_limit` writes
those groups into the routing section when the experiment config is built,
so the layer (single-device or expert-parallel) routes by its own config and
the execution plane never rewrites it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from moejax.config import registry as reg
from moejax.config.core import ConfigError, check_choice, check_count
from moejax.config.moe import MoEConfig


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How the model is laid out over devices and how tokens travel.

  data / fsdp / expert: mesh axis sizes; ``data=-1`` takes every device the
    other two leave. Their product must equal the device count. ``expert >
    1`` runs every MoE layer expert-parallel (the layer under
    ``jax.shard_map`` with the expert-parallel executor).
  devices_per_node: P, expert-axis devices per node, for node-limited routing
    and the cross-node byte count; None: one node per process (byte counts
    only; node-limited routing needs P).
  dispatch: ``capacity`` (padded all_to_all; runs everywhere) or ``ragged``
    (dropless, exact-size segments with ``jax.lax.ragged_all_to_all``).
  dispatch_unit: what one row on the wire is. ``token`` (default): a token
    once per destination device, expanded to its experts there and combined
    (gate-weighted) before the way back; ``node``: once per destination
    node across nodes, forwarded inside the node (DeepSeek-V3; cross-node
    rows at the once-per-node minimum); ``copy``: one row per token copy
    (the per-expert all_to_all, kept for comparison). Same results.
  capacity_buckets: static buffer sizes the padded all_to_all (``capacity``
    dispatch and the emulated ragged collective) picks from per step, by the
    global maximum count: geometric, ratio 2^(1/3), the largest the worst
    case (8 reach down to 1/5 of it). 1: always the worst case (a dropless layer then pads every buffer
    to T rows per source).
  ragged_impl: for ``ragged``: ``native`` (the XLA collective; GPU/TPU),
    ``emulated`` (the same segments moved by a padded all_to_all; exact, for
    platforms without the collective, CPU among them) or ``auto`` (native on
    GPU/TPU, emulated elsewhere).
  route_limit / route_limit_count: limit each token's experts to M =
    route_limit_count ``nodes`` (DeepSeek-V3) or ``devices`` (DeepSeek-V2);
    ``none`` keeps the router's own grouping. Resolved into
    ``moe.routing.n_groups / topk_groups`` when the experiment is built.
  """

  data: int = -1
  fsdp: int = 1
  expert: int = 1
  devices_per_node: Optional[int] = None
  dispatch: str = "capacity"
  dispatch_unit: str = "token"
  capacity_buckets: int = 8
  ragged_impl: str = "auto"
  route_limit: str = "none"
  route_limit_count: int = 1

  def __post_init__(self):
    p = "parallel"
    check_choice(f"{p}.dispatch", self.dispatch, reg.DISPATCHES)
    reg.check_executor(f"{p}.dispatch_unit", self.dispatch_unit, expert_parallel=True)
    check_choice(f"{p}.ragged_impl", self.ragged_impl, reg.RAGGED_IMPLS)
    check_choice(f"{p}.route_limit", self.route_limit, reg.ROUTE_LIMITS)
    if self.data != -1:
      check_count(f"{p}.data", self.data)
    check_count(f"{p}.fsdp", self.fsdp)
    check_count(f"{p}.expert", self.expert)
    check_count(f"{p}.route_limit_count", self.route_limit_count)
    check_count(f"{p}.capacity_buckets", self.capacity_buckets)
    if self.devices_per_node is not None:
      check_count(f"{p}.devices_per_node", self.devices_per_node)
      big, small = max(self.expert, self.devices_per_node), min(self.expert,
                                                                self.devices_per_node)
      if big % small:
        raise ConfigError(f"{p}.devices_per_node", self.devices_per_node,
                          f"neither divides nor is a multiple of {p}.expert={self.expert}, "
                          "so nodes would cut expert-parallel groups unevenly",
                          f"use a divisor or a multiple of {self.expert}")
    if self.route_limit == "nodes" and self.devices_per_node is None:
      raise ConfigError(f"{p}.devices_per_node", None,
                        "node-limited routing needs the node size to group the experts",
                        "set parallel.devices_per_node (e.g. the devices of one host)")

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

  def route_groups(self) -> int:
    """Groups of node/device-limited routing: D devices or D / P nodes (>= 1)."""
    if self.route_limit == "devices":
      return self.expert
    return max(1, self.expert // self.devices_per_node)


def check_experts(pcfg: ParallelConfig, cfg: MoEConfig) -> None:
  """ConfigError when the experts do not split evenly over the expert axis."""
  if not cfg.layer.expert_parallel:
    raise ConfigError("moe.kind", cfg.kind,
                      "expert parallelism moves routed tokens; this layer kind has no "
                      "per-token expert assignment", "use moe.kind='sparse'")
  why = cfg.router.why_not_expert_parallel
  if why:
    raise ConfigError("moe.routing.kind", cfg.routing.kind, why,
                      "use parallel.expert=1 or another router")
  if cfg.num_experts % pcfg.expert:
    raise ConfigError("parallel.expert", pcfg.expert,
                      f"does not divide moe.topology.num_experts={cfg.num_experts}",
                      f"pick expert among the divisors of {cfg.num_experts}")


def resolve_route_limit(cfg: MoEConfig, pcfg: ParallelConfig) -> MoEConfig:
  """``cfg`` with routing limited to M nodes or M devices of the expert axis.

  Node-limited routing is group-limited routing (moejax.routing.groups)
  whose groups are the experts of one node (``nodes``, DeepSeek-V3: the sum
  of the top-2 biased scores ranks nodes) or one device (``devices``,
  DeepSeek-V2: the max score), with ``topk_groups`` = M. The group score
  follows ``moe.routing.group_score`` (``auto``: top2_sum with a bias, max
  without). Idempotent: a config already limited this way is returned as is.
  """
  if pcfg.route_limit == "none":
    return cfg
  check_experts(pcfg, cfg)
  groups, m, r = pcfg.route_groups(), pcfg.route_limit_count, cfg.routing
  if cfg.num_zero_compute:
    raise ConfigError("parallel.route_limit", pcfg.route_limit,
                      "zero-computation experts are router columns without a device, so "
                      "node groups over all router outputs would be misaligned",
                      "use zero_experts=copy_experts=constant_experts=0 or route_limit='none'")
  if not cfg.router.supports_groups:
    raise ConfigError("parallel.route_limit", pcfg.route_limit,
                      f"node/device limits are group-limited token-choice routing, which "
                      f"routing.kind={r.kind!r} does not support",
                      "use moe.routing.kind='topk' or route_limit='none'")
  if m > groups:
    raise ConfigError("parallel.route_limit_count", m,
                      f"exceeds the {groups} {pcfg.route_limit} of the expert axis",
                      f"use at most {groups}")
  if r.n_groups > 1 and (r.n_groups, r.topk_groups) != (groups, m):
    raise ConfigError("moe.routing.n_groups", r.n_groups,
                      f"conflicts with parallel.route_limit={pcfg.route_limit!r}, which "
                      f"sets n_groups={groups}, topk_groups={m}",
                      "set moe.routing.n_groups=1 and let the mesh choose the groups")
  per = (cfg.num_experts // groups) * m
  if r.top_k > per:
    raise ConfigError("parallel.route_limit_count", m,
                      f"leaves {per} experts on {m} {pcfg.route_limit} of "
                      f"{cfg.num_experts // groups} experts, fewer than top_k={r.top_k}",
                      f"raise route_limit_count to "
                      f"{math.ceil(r.top_k * groups / cfg.num_experts)}")
  if groups == 1:
    return cfg
  routing = dataclasses.replace(r, n_groups=groups, topk_groups=m)
  return dataclasses.replace(cfg, routing=routing)


def check_route_limit(cfg: MoEConfig, pcfg: ParallelConfig) -> None:
  """ValueError when ``cfg`` was not resolved for ``pcfg``'s routing limit."""
  if resolve_route_limit(cfg, pcfg) != cfg:
    raise ValueError(f"parallel.route_limit={pcfg.route_limit!r} (M={pcfg.route_limit_count}) "
                     f"but moe.routing has n_groups={cfg.routing.n_groups}, topk_groups="
                     f"{cfg.routing.topk_groups}. Fix: build the layer config with "
                     "moejax.config.resolve_route_limit(cfg, pcfg) (ExperimentConfig does)")
