"""Fine-grained expert segmentation and shared-expert isolation (DeepSeekMoE).

Dai et al. 2401.06066: split each of N experts of width w into m experts of
width w / m and activate m K of them instead of K. Total and active
parameters stay the same (m N experts of w/m, m K active of w/m) while the
number of possible expert combinations grows combinatorially. Shared-expert
isolation then turns K_s of the fine-grained experts into always-on shared
experts and routes m K - K_s of the remaining m N - K_s, again at equal total
and active parameters.

Both transforms are pure functions MoEConfig -> MoEConfig. They are also
config knobs: ``moe.topology.granularity=m`` and ``isolate_shared=K_s`` on a
conventional layer are resolved by :func:`resolve` when the config is built,
so a suite arm says "granularity 4" instead of copying the resulting counts.
"""

from __future__ import annotations

import dataclasses
import math

from moejax.config.core import ConfigError


def _check_divisible(field: str, widths, m: int) -> None:
  bad = [w for w in widths if w % m]
  if bad:
    raise ConfigError(field, widths if len(widths) > 1 else widths[0],
                      f"width {bad[0]} is not divisible by the segmentation factor m={m}",
                      f"pick m among the divisors of {math.gcd(*widths)}")


def fine_grain(cfg: "MoEConfig", m: int, split_shared: bool = False) -> "MoEConfig":
  """Splits every routed expert into m experts of 1/m the width.

  num_experts -> m E, widths -> w / m, routing.top_k -> m K. Everything a
  token's expected active compute depends on is scaled with it, so total and
  active parameters are unchanged:

  - zero-computation experts are multiplied by m too, keeping the fraction of
    slots that land on FFN experts under balanced routing (constant experts
    carry width-independent parameters, W_c [d, 2] and v [d] each, so theirs
    grow m-fold: 3 d (m - 1) J more);
  - expert-choice capacity c (experts per token on average) is multiplied
    by m;
  - shared experts are unchanged unless ``split_shared``, which splits them
    into m K_s experts of width f_s / m (same parameters, one dense FFN
    either way);
  - Soft MoE keeps p slots per expert, so its E p slots of width w become
    m E p slots of width w / m: the same per-token expert compute.

  Only the router grows, from d E to d m E columns (d m E p for Soft MoE);
  DeepSeekMoE's equal-parameter comparison neglects it the same way.

  Raises:
    ConfigError: m < 1, a width not divisible by m, or a PEER layer.
  """
  if not isinstance(m, int) or isinstance(m, bool) or m < 1:
    raise ConfigError("moe.topology.granularity", m,
                      "the segmentation factor must be an integer >= 1", "use m = 1, 2, 4, ...")
  if not cfg.layer.segmentable:
    raise ConfigError("moe.kind", cfg.kind, cfg.layer.why_not_segmentable,
                      "fine-grain a kind='sparse' or 'soft' layer")
  if m == 1:
    return cfg
  t = cfg.topology
  if t.expert_widths is not None:
    # Each expert's m pieces stay adjacent, so piece i of expert e is e m + i.
    _check_divisible("moe.topology.expert_widths", t.expert_widths, m)
    changes = dict(expert_widths=tuple(w // m for w in t.expert_widths for _ in range(m)))
  else:
    _check_divisible("moe.topology.expert_width", (t.expert_width,), m)
    changes = dict(expert_width=t.expert_width // m)
  changes.update(num_experts=t.num_experts * m, zero_experts=t.zero_experts * m,
                 copy_experts=t.copy_experts * m, constant_experts=t.constant_experts * m)
  routing = cfg.routing
  if cfg.layer.routed:
    routing = dataclasses.replace(routing, top_k=routing.top_k * m)
    options = cfg.router.granular(routing.opts, m)  # expert choice: m times c
    if options != routing.opts:
      routing = dataclasses.replace(routing, options=options)
  if split_shared and t.num_shared_experts:
    fs = t.shared_expert_width or t.expert_width
    if fs % m:
      raise ConfigError("moe.topology.shared_expert_width", fs,
                        f"not divisible by the segmentation factor m={m}",
                        "set split_shared=False or pick m dividing the shared width")
    changes["num_shared_experts"] = t.num_shared_experts * m
    changes["shared_expert_width"] = fs // m
  elif t.num_shared_experts and t.shared_expert_width is None:
    # The shared width defaulted to the routed width; pin it before that changes.
    changes["shared_expert_width"] = t.expert_width
  topology = dataclasses.replace(t, **changes)
  return dataclasses.replace(cfg, topology=topology, routing=routing)


def deepseekmoe(cfg: "MoEConfig", m: int, num_shared: int) -> "MoEConfig":
  """DeepSeekMoE from a conventional N-expert top-K layer.

  Segments the N experts of width w into m N of width w / m, isolates
  ``num_shared`` = K_s of them as shared experts (width w / m each) and routes
  m K - K_s among the other m N - K_s. Total and active parameters equal the
  original layer's (Dai et al. 2401.06066, section 3).

  Example: N=16, K=2, w=1024, m=4, K_s=1 gives 63 routed experts of width
  256, top-7, plus 1 shared expert of width 256.

  Raises:
    ConfigError: heterogeneous widths, existing shared experts, a non-top-k
      router, or K_s >= m K (nothing left to route).
  """
  t = cfg.topology
  if not isinstance(num_shared, int) or isinstance(num_shared, bool) or num_shared < 0:
    raise ConfigError("moe.topology.isolate_shared", num_shared, "must be an int >= 0",
                      "use K_s >= 0")
  if not cfg.layer.routed:
    raise ConfigError("moe.topology.isolate_shared", num_shared,
                      f"shared experts are a routed-layer path, not moe.kind={cfg.kind!r}",
                      "use moe.kind='sparse'")
  if t.expert_widths is not None:
    raise ConfigError("moe.topology.expert_widths", t.expert_widths,
                      "DeepSeekMoE isolation assumes equal expert widths",
                      "use granularity alone for heterogeneous experts")
  if t.num_shared_experts:
    raise ConfigError("moe.topology.num_shared_experts", t.num_shared_experts,
                      "the base layer already has shared experts",
                      "start from a conventional top-K layer with num_shared_experts=0")
  if not cfg.router.isolates_shared:
    raise ConfigError("moe.routing.kind", cfg.routing.kind,
                      "shared-expert isolation keeps m K - K_s routed slots per token, "
                      "which needs a token-choice top-k router", "use routing.kind='topk'")
  fine = fine_grain(cfg, m)
  k = fine.routing.top_k
  if num_shared >= k:
    raise ConfigError("moe.topology.isolate_shared", num_shared,
                      f"must be below m K = {k}, or no expert is left to route",
                      f"use isolate_shared < {k}")
  if fine.num_zero_compute:
    raise ConfigError("moe.topology.zero_experts", fine.num_zero_compute,
                      "shared-expert isolation with zero-computation experts is not "
                      "parameter-preserving", "drop the zero-computation experts")
  routing = dataclasses.replace(fine.routing, top_k=k - num_shared)
  routed = fine.num_experts - num_shared
  if routing.n_groups > 1 and routed % routing.n_groups:
    raise ConfigError("moe.routing.n_groups", routing.n_groups,
                      f"does not divide the {routed} routed experts left after isolating "
                      f"{num_shared} shared ones",
                      "use n_groups=1 or a K_s that keeps the routed count divisible")
  topology = dataclasses.replace(
      fine.topology, num_experts=routed, num_shared_experts=num_shared,
      shared_expert_width=fine.topology.expert_width if num_shared else None)
  return dataclasses.replace(fine, topology=topology, routing=routing)


def resolve(cfg: "MoEConfig") -> "MoEConfig":
  """``cfg`` with ``topology.granularity`` / ``isolate_shared`` applied (or ``cfg`` itself).

  The result has granularity 1 and isolate_shared 0, so resolving it again
  changes nothing; ``topology.derived_from`` records the knobs and the base
  layer they were applied to.
  """
  t = cfg.topology
  m, s = t.granularity, t.isolate_shared
  if m == 1 and s == 0:
    return cfg
  base = dataclasses.replace(cfg, topology=dataclasses.replace(t, granularity=1,
                                                               isolate_shared=0))
  out = deepseekmoe(base, m, s) if s else fine_grain(base, m)
  widths = (f"expert_widths={t.expert_widths}" if t.expert_widths is not None
            else f"expert_width={t.expert_width}")
  note = (f"granularity={m}, isolate_shared={s} applied to num_experts={t.num_experts}, "
          f"{widths}, top_k={cfg.routing.top_k}")
  if t.derived_from:
    note = f"{t.derived_from}; then {note}"
  return dataclasses.replace(out, topology=dataclasses.replace(out.topology, derived_from=note))
