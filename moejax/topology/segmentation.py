"""Fine-grained expert segmentation and shared-expert isolation (DeepSeekMoE).

Dai et al. 2401.06066: split each of N experts of width w into m experts of
width w / m and activate m K of them instead of K. Total and active
parameters stay the same (m N experts of w/m, m K active of w/m) while the
number of possible expert combinations grows combinatorially. Shared-expert
isolation then turns K_s of the fine-grained experts into always-on shared
experts and routes m K - K_s of the remaining m N - K_s, again at equal total
and active parameters.

Both transforms are pure functions MoEConfig -> MoEConfig; the returned
config is validated like any other.
"""

from __future__ import annotations

import dataclasses
import math

from moejax.config import ConfigError, MoEConfig


def _check_divisible(field: str, widths, m: int) -> None:
  bad = [w for w in widths if w % m]
  if bad:
    raise ConfigError(field, widths if len(widths) > 1 else widths[0],
                      f"width {bad[0]} is not divisible by the segmentation factor m={m}",
                      f"pick m among the divisors of {math.gcd(*widths)}")


def fine_grain(cfg: MoEConfig, m: int, split_shared: bool = False) -> MoEConfig:
  """Splits every routed expert into m experts of 1/m the width.

  num_experts -> m E, widths -> w / m, router.top_k -> m K. Everything a
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

  Args:
    cfg: a ``kind='sparse'`` or ``'soft'`` layer config.
    m: segmentation factor (1 returns ``cfg``).
    split_shared: also segment the shared experts.

  Raises:
    ConfigError: m < 1, a width not divisible by m, or a PEER layer.
  """
  if not isinstance(m, int) or m < 1:
    raise ConfigError("fine_grain.m", m, "the segmentation factor must be an integer >= 1",
                      "use m = 1, 2, 4, ...")
  if cfg.kind == "peer":
    raise ConfigError("moe.kind", cfg.kind,
                      "PEER experts are single neurons and cannot be segmented",
                      "fine-grain a kind='sparse' or 'soft' layer")
  if m == 1:
    return cfg
  if cfg.expert_widths is not None:
    # Each expert's m pieces stay adjacent, so piece i of expert e is e m + i.
    _check_divisible("moe.expert_widths", cfg.expert_widths, m)
    changes = dict(expert_widths=tuple(w // m for w in cfg.expert_widths for _ in range(m)))
  else:
    _check_divisible("moe.expert_width", (cfg.expert_width,), m)
    changes = dict(expert_width=cfg.expert_width // m)
  changes.update(
      num_experts=cfg.num_experts * m,
      zero_experts=cfg.zero_experts * m,
      copy_experts=cfg.copy_experts * m,
      constant_experts=cfg.constant_experts * m,
  )
  router = dataclasses.replace(cfg.router, top_k=cfg.router.top_k * m)
  if cfg.router.kind == "expert_choice":
    router = dataclasses.replace(router, expert_choice_capacity=cfg.router.expert_choice_capacity * m)
  changes["router"] = router
  if split_shared and cfg.num_shared_experts:
    fs = cfg.shared_expert_width or cfg.expert_width
    if fs % m:
      raise ConfigError("moe.shared_expert_width", fs,
                        f"not divisible by the segmentation factor m={m}",
                        "set split_shared=False or pick m dividing the shared width")
    changes["num_shared_experts"] = cfg.num_shared_experts * m
    changes["shared_expert_width"] = fs // m
  elif cfg.num_shared_experts and cfg.shared_expert_width is None:
    # The shared width defaulted to the routed width; pin it before that changes.
    changes["shared_expert_width"] = cfg.expert_width
  return dataclasses.replace(cfg, **changes)


def deepseekmoe(cfg: MoEConfig, m: int, num_shared: int) -> MoEConfig:
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
  if cfg.expert_widths is not None:
    raise ConfigError("moe.expert_widths", cfg.expert_widths,
                      "DeepSeekMoE isolation assumes equal expert widths",
                      "use fine_grain for heterogeneous experts")
  if cfg.num_shared_experts:
    raise ConfigError("moe.num_shared_experts", cfg.num_shared_experts,
                      "the base layer already has shared experts",
                      "start from a conventional top-K layer with num_shared_experts=0")
  if cfg.router.kind not in ("topk", "hash"):
    raise ConfigError("moe.router.kind", cfg.router.kind,
                      "shared-expert isolation keeps m K - K_s routed slots per token, "
                      "which needs a token-choice top-k router",
                      "use router.kind='topk'")
  if num_shared < 0:
    raise ConfigError("deepseekmoe.num_shared", num_shared, "must be >= 0", "use K_s >= 0")
  fine = fine_grain(cfg, m)
  if num_shared >= fine.router.top_k:
    raise ConfigError("deepseekmoe.num_shared", num_shared,
                      f"must be below m K = {fine.router.top_k}, or no expert is left to route",
                      f"use num_shared < {fine.router.top_k}")
  if fine.num_zero_compute:
    raise ConfigError("moe.zero_experts", fine.num_zero_compute,
                      "shared-expert isolation with zero-computation experts is not "
                      "parameter-preserving", "drop the zero-computation experts")
  router = dataclasses.replace(fine.router, top_k=fine.router.top_k - num_shared)
  changes = dict(num_experts=fine.num_experts - num_shared, router=router,
                 num_shared_experts=num_shared,
                 shared_expert_width=fine.expert_width if num_shared else None)
  if router.n_groups > 1 and changes["num_experts"] % router.n_groups:
    raise ConfigError("moe.router.n_groups", router.n_groups,
                      f"does not divide the {changes['num_experts']} routed experts left "
                      f"after isolating {num_shared} shared ones",
                      "use n_groups=1 or a K_s that keeps the routed count divisible")
  return dataclasses.replace(fine, **changes)
