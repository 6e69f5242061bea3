"""The cross-section rules of an MoE layer config, one small named function each.

Each rule takes a built :class:`~moejax.config.moe.MoEConfig` and raises
:class:`~moejax.config.core.ConfigError` (field, value, fix) or returns.
:func:`check_moe` runs :data:`RULES` in order. A rule states one fact about
the layer ("a selection bias needs a token-choice router"); the section
classes check only their own fields.

The first rule is the contract of the layer kinds: a field the chosen kind
cannot honour is refused, never silently ignored (Soft MoE has no per-token
routing, so a selection bias or a balance loss would do nothing).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from moejax.config.core import ConfigError

if TYPE_CHECKING:
  from moejax.config.moe import MoEConfig

# Fields each non-sparse layer kind reads; any other field of these sections
# set away from its default is refused for that kind.
_HONOURED = {
    "soft": {
        "topology": {"num_experts", "expert_width", "expert_widths", "activation",
                     "slots_per_expert", "granularity", "isolate_shared", "derived_from"},
        "routing": {"freeze", "router_dtype"},
        "balance": set(),
        "execution": {"interpret"},
    },
    "peer": {
        "topology": {"activation", "peer_num_keys", "peer_heads", "peer_top_k",
                     "peer_key_dim", "derived_from"},
        "routing": set(),
        "balance": set(),
        "execution": {"interpret"},
    },
    "sparse": {
        "topology": {f for f in (
            "num_experts", "expert_width", "expert_widths", "activation",
            "num_shared_experts", "shared_expert_width", "shared_expert_gate", "zero_experts",
            "copy_experts", "constant_experts", "granularity", "isolate_shared",
            "derived_from")},
        "routing": None,    # every field
        "balance": None,
        "execution": None,
    },
}
_WHY = {
    "soft": "Soft MoE mixes every token into every slot: there is no per-token routing, "
            "selection bias, balance loss, capacity or grouped-matmul backend",
    "peer": "PEER retrieves singleton experts by product keys: it has no router, balance "
            "loss, capacity or grouped-matmul backend, and only the peer_* topology fields",
    "sparse": "a routed (sparse) layer has no Soft MoE slots or PEER keys",
}


def honoured_by_kind(cfg: "MoEConfig") -> None:
  """Every non-default field is one the layer kind reads."""
  for section, allowed in _HONOURED[cfg.kind].items():
    if allowed is None:
      continue
    value = getattr(cfg, section)
    default = type(value)()
    for f in dataclasses.fields(value):
      if f.name in allowed:
        continue
      if getattr(value, f.name) != getattr(default, f.name):
        fix = f"remove moe.{section}.{f.name} (default {getattr(default, f.name)!r})"
        if cfg.kind != "sparse":
          fix += " or use moe.kind='sparse'"
        raise ConfigError(f"moe.{section}.{f.name}", getattr(value, f.name),
                          f"has no effect with moe.kind={cfg.kind!r}: {_WHY[cfg.kind]}", fix)


def peer_keys(cfg: "MoEConfig") -> None:
  """PEER takes top-k per sub-key set and splits the query in two halves."""
  if cfg.kind != "peer":
    return
  t = cfg.topology
  if t.peer_top_k > t.peer_num_keys:
    raise ConfigError("moe.topology.peer_top_k", t.peer_top_k,
                      f"exceeds moe.topology.peer_num_keys={t.peer_num_keys} "
                      "(top-k is taken per sub-key set)",
                      "set moe.topology.peer_top_k <= moe.topology.peer_num_keys")
  if t.peer_key_dim % 2:
    raise ConfigError("moe.topology.peer_key_dim", t.peer_key_dim,
                      "the query is split into two halves for product keys",
                      "use an even key dimension")


def top_k_within_experts(cfg: "MoEConfig") -> None:
  r, e = cfg.routing, cfg.num_routed
  if cfg.kind == "sparse" and r.kind in ("topk", "hierarchical", "top_p") and r.top_k > e:
    raise ConfigError("moe.routing.top_k", r.top_k,
                      f"exceeds moe.topology.num_experts={cfg.num_experts}"
                      + (f" + {cfg.num_zero_compute} zero-computation experts"
                         if cfg.num_zero_compute else ""),
                      f"set moe.routing.top_k <= {e}")


def groups_divide_experts(cfg: "MoEConfig") -> None:
  r, e = cfg.routing, cfg.num_routed
  if cfg.kind != "sparse" or r.n_groups == 1:
    return
  if e % r.n_groups:
    raise ConfigError("moe.routing.n_groups", r.n_groups,
                      f"does not divide the {e} router outputs (moe.topology.num_experts"
                      f"={cfg.num_experts} plus zero-computation experts)",
                      f"pick n_groups among the divisors of {e}")
  per = (e // r.n_groups) * r.topk_groups
  if r.top_k > per:
    raise ConfigError("moe.routing.top_k", r.top_k,
                      f"exceeds the {per} experts left in topk_groups={r.topk_groups} "
                      f"groups of {e // r.n_groups}", "raise topk_groups or lower top_k")


def families_divide_experts(cfg: "MoEConfig") -> None:
  r, e = cfg.routing, cfg.num_routed
  if cfg.kind != "sparse" or r.kind != "hierarchical":
    return
  if e % r.n_families:
    raise ConfigError("moe.routing.n_families", r.n_families,
                      f"does not divide the {e} router outputs",
                      f"pick n_families among the divisors of {e}")
  per = (e // r.n_families) * r.top_k_families
  if r.top_k > per:
    raise ConfigError("moe.routing.top_k", r.top_k,
                      f"exceeds the {per} experts inside top_k_families="
                      f"{r.top_k_families} families of {e // r.n_families}",
                      "raise top_k_families or lower top_k")


def shared_needs_token_choice(cfg: "MoEConfig") -> None:
  if cfg.topology.num_shared_experts and cfg.routing.kind == "expert_choice":
    raise ConfigError("moe.topology.num_shared_experts", cfg.topology.num_shared_experts,
                      "expert-choice routing already gives tokens a variable number of "
                      "experts; an always-on shared path is not defined for it here",
                      "set num_shared_experts=0 or use routing.kind='topk'")


def zero_compute_needs_scored_router(cfg: "MoEConfig") -> None:
  if cfg.num_zero_compute and cfg.routing.kind in ("expert_choice", "hash"):
    raise ConfigError("moe.routing.kind", cfg.routing.kind,
                      "zero-computation experts need a router that scores them",
                      "use routing.kind='topk' or 'top_p'")


def capacity_needs_token_choice(cfg: "MoEConfig") -> None:
  if cfg.balance.capacity_factor is not None and cfg.routing.kind == "expert_choice":
    raise ConfigError("moe.balance.capacity_factor", cfg.balance.capacity_factor,
                      "expert choice sets its own per-expert capacity",
                      "use moe.routing.expert_choice_capacity and capacity_factor=None")


def bias_needs_token_choice(cfg: "MoEConfig") -> None:
  r = cfg.routing
  if cfg.kind == "sparse" and r.use_bias and r.kind not in ("topk", "top_p"):
    raise ConfigError("moe.routing.use_bias", r.use_bias,
                      f"a selection bias is defined for token-choice routers, not {r.kind!r}",
                      "set use_bias=False or routing.kind='topk'")


def controller_needs_bias(cfg: "MoEConfig") -> None:
  b = cfg.balance
  if cfg.kind == "sparse" and b.bias_update != "none" and not cfg.routing.use_bias:
    raise ConfigError("moe.balance.bias_update", b.bias_update,
                      "the controller updates a bias the router does not use",
                      "set moe.routing.use_bias=True or bias_update='none'")


def hash_has_nothing_to_balance(cfg: "MoEConfig") -> None:
  b = cfg.balance
  if cfg.routing.kind == "hash" and (b.aux_loss_coef or b.z_loss_coef or b.entropy_loss_coef):
    raise ConfigError("moe.routing.kind", cfg.routing.kind,
                      "hash routing has no router parameters to balance",
                      "set balance.aux_loss_coef, z_loss_coef and entropy_loss_coef to 0")


def loss_devices_divide_experts(cfg: "MoEConfig") -> None:
  n = cfg.balance.loss_num_devices
  if n > 1 and cfg.num_experts % n:
    raise ConfigError("moe.balance.loss_num_devices", n,
                      f"does not divide moe.topology.num_experts={cfg.num_experts}",
                      "pick a divisor of num_experts")


def device_losses_need_devices(cfg: "MoEConfig") -> None:
  b = cfg.balance
  for name in ("device_loss_coef", "comm_loss_coef"):
    if getattr(b, name) and b.loss_num_devices == 1:
      raise ConfigError(f"moe.balance.{name}", getattr(b, name),
                        "a device-level loss over loss_num_devices=1 device is constant",
                        "set moe.balance.loss_num_devices to the expert-parallel degree")


RULES: tuple[Callable[["MoEConfig"], None], ...] = (
    honoured_by_kind,
    peer_keys,
    top_k_within_experts,
    groups_divide_experts,
    families_divide_experts,
    shared_needs_token_choice,
    zero_compute_needs_scored_router,
    capacity_needs_token_choice,
    bias_needs_token_choice,
    controller_needs_bias,
    hash_has_nothing_to_balance,
    loss_devices_divide_experts,
    device_losses_need_devices,
)


def check_moe(cfg: "MoEConfig") -> None:
  """Runs every rule; the first violated one raises."""
  for rule in RULES:
    rule(cfg)
