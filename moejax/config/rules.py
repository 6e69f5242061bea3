"""The cross-section rules of an MoE layer config, one small named function each.

Each rule takes a built :class:`~moejax.config.moe.MoEConfig` and raises
:class:`~moejax.config.core.ConfigError` (field, value, fix) or returns.
:func:`check_moe` runs :data:`RULES` in order. A rule states one fact about
the layer ("a selection bias needs a token-choice router"); the section
classes check only their own fields.

The first rule is the contract of the layer kinds: a field the chosen kind
cannot honour is refused, never silently ignored (Soft MoE has no per-token
routing, so a selection bias or a balance loss would do nothing). The
others ask the registered objects (``cfg.layer``: the layer kind,
``cfg.router``: the router spec) what they can do; no rule compares a kind
with a name. A router's own cross-field rules are its spec's ``check``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from moejax.config.core import ConfigError


def honoured_by_kind(cfg) -> None:
  """Every non-default field is one the layer kind reads (its ``honoured`` table)."""
  kind = cfg.layer
  for section, allowed in kind.honoured.items():
    if allowed is None:
      continue
    value = getattr(cfg, section)
    default = type(value)()
    for f in dataclasses.fields(value):
      if f.name in allowed:
        continue
      if f.name == "options":  # set when it differs from its kind's defaults
        if value.opts != value.spec.Options():
          raise ConfigError("moe.routing.options", value.opts,
                            f"has no effect with moe.kind={cfg.kind!r}: {kind.why}",
                            "remove moe.routing.options or use moe.kind='sparse'")
        continue
      if getattr(value, f.name) != getattr(default, f.name):
        fix = f"remove moe.{section}.{f.name} (default {getattr(default, f.name)!r})"
        if not kind.routed:
          fix += " or use moe.kind='sparse'"
        raise ConfigError(f"moe.{section}.{f.name}", getattr(value, f.name),
                          f"has no effect with moe.kind={cfg.kind!r}: {kind.why}", fix)


def layer_kind_rules(cfg) -> None:
  """The layer kind's own rules tying its options to the other sections (its ``check``;
  rules within its options are the options' own, checked when they are built)."""
  cfg.layer.check(cfg)


def top_k_within_experts(cfg) -> None:
  r, e = cfg.routing, cfg.num_routed
  if cfg.layer.routed and cfg.router.token_choice and r.top_k > e:
    raise ConfigError("moe.routing.top_k", r.top_k,
                      f"exceeds moe.topology.num_experts={cfg.num_experts}"
                      + (f" + {cfg.num_zero_compute} zero-computation experts"
                         if cfg.num_zero_compute else ""),
                      f"set moe.routing.top_k <= {e}")


def groups_divide_experts(cfg) -> None:
  r, e = cfg.routing, cfg.num_routed
  if not cfg.layer.routed or r.n_groups == 1:
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


def router_rules(cfg) -> None:
  """The router spec's own cross-field rules (hierarchical: families divide experts)."""
  if cfg.layer.routed:
    cfg.router.check(cfg)


def shared_needs_token_choice(cfg) -> None:
  if cfg.topology.num_shared_experts and not cfg.router.token_choice:
    raise ConfigError("moe.topology.num_shared_experts", cfg.topology.num_shared_experts,
                      f"routing.kind={cfg.routing.kind!r} is not token choice: it already "
                      "gives tokens a variable number of experts; an always-on shared path "
                      "is not defined for it here",
                      "set num_shared_experts=0 or use routing.kind='topk'")


def zero_compute_needs_scored_router(cfg) -> None:
  spec = cfg.router
  if cfg.num_zero_compute and not (spec.token_choice and spec.scores_all_columns):
    raise ConfigError("moe.routing.kind", cfg.routing.kind,
                      "zero-computation experts need a token-choice router that scores them",
                      "use routing.kind='topk' or 'top_p'")


def capacity_needs_token_choice(cfg) -> None:
  if cfg.balance.capacity_factor is not None and not cfg.router.token_choice:
    raise ConfigError("moe.balance.capacity_factor", cfg.balance.capacity_factor,
                      f"routing.kind={cfg.routing.kind!r} sets its own per-expert capacity",
                      "use the router's options and capacity_factor=None")


def bias_needs_token_choice(cfg) -> None:
  r = cfg.routing
  if cfg.layer.routed and r.use_bias and not cfg.router.supports_bias:
    raise ConfigError("moe.routing.use_bias", r.use_bias,
                      f"routing.kind={r.kind!r} does not select on a bias (its spec has "
                      "supports_bias=False)",
                      "set use_bias=False or routing.kind='topk'")


def controller_needs_bias(cfg) -> None:
  b = cfg.balance
  if cfg.layer.routed and b.bias_update != "none" and not cfg.routing.use_bias:
    raise ConfigError("moe.balance.bias_update", b.bias_update,
                      "the controller updates a bias the router does not use",
                      "set moe.routing.use_bias=True or bias_update='none'")


def untrainable_router_has_nothing_to_balance(cfg) -> None:
  b = cfg.balance
  if (cfg.layer.routed and not cfg.router.trainable
      and (b.aux_loss_coef or b.z_loss_coef or b.entropy_loss_coef)):
    raise ConfigError("moe.routing.kind", cfg.routing.kind,
                      f"{cfg.routing.kind} routing has no router parameters to balance",
                      "set balance.aux_loss_coef, z_loss_coef and entropy_loss_coef to 0")


def loss_devices_divide_experts(cfg) -> None:
  n = cfg.balance.loss_num_devices
  if n > 1 and cfg.num_experts % n:
    raise ConfigError("moe.balance.loss_num_devices", n,
                      f"does not divide moe.topology.num_experts={cfg.num_experts}",
                      "pick a divisor of num_experts")


def device_losses_need_devices(cfg) -> None:
  b = cfg.balance
  for name in ("device_loss_coef", "comm_loss_coef"):
    if getattr(b, name) and b.loss_num_devices == 1:
      raise ConfigError(f"moe.balance.{name}", getattr(b, name),
                        "a device-level loss over loss_num_devices=1 device is constant",
                        "set moe.balance.loss_num_devices to the expert-parallel degree")


RULES: tuple[Callable[..., None], ...] = (
    honoured_by_kind,
    layer_kind_rules,
    top_k_within_experts,
    groups_divide_experts,
    router_rules,
    shared_needs_token_choice,
    zero_compute_needs_scored_router,
    capacity_needs_token_choice,
    bias_needs_token_choice,
    controller_needs_bias,
    untrainable_router_has_nothing_to_balance,
    loss_devices_divide_experts,
    device_losses_need_devices,
)


def check_moe(cfg) -> None:
  """Runs every rule; the first violated one raises."""
  for rule in RULES:
    rule(cfg)
