"""Group-limited (node-limited) expert selection, DeepSeek-V2/V3.

Legend: T tokens, E_r router outputs (FFN plus zero-computation experts), G
groups.

Experts are contiguous in groups: expert e belongs to group e // (E_r / G)
(a group is a node or device holding E_r / G experts). Each token ranks the
groups by a group score computed from its selection scores, keeps the best
``topk_groups`` and masks every expert elsewhere, so a token's experts live
on at most ``topk_groups`` nodes and the all-to-all fan-out is bounded.

Group score conventions:
- ``top2_sum``: sum of the two best selection scores in the group
  (DeepSeek-V3, on the biased scores). A group of one expert uses that one.
- ``max``: the best selection score in the group (DeepSeek-V2, no bias).
- ``auto``: ``top2_sum`` when the router uses a bias, else ``max``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import RoutingConfig


def resolve_group_score(cfg: RoutingConfig) -> str:
  if cfg.group_score != "auto":
    return cfg.group_score
  return "top2_sum" if cfg.use_bias else "max"


def group_scores(sel: jax.Array, n_groups: int, how: str) -> jax.Array:
  """sel[T, E_r] selection scores -> [T, G] group scores."""
  t, e = sel.shape
  grouped = sel.reshape(t, n_groups, e // n_groups)
  if how == "max":
    return jnp.max(grouped, axis=-1)
  if how == "top2_sum":
    best, _ = jax.lax.top_k(grouped, min(2, e // n_groups))
    return jnp.sum(best, axis=-1)
  raise ValueError(f"moe.routing.group_score={how!r}: unknown; use top2_sum or max")


def group_mask(sel: jax.Array, n_groups: int, topk_groups: int, how: str) -> jax.Array:
  """bool[T, E_r]: True for experts inside each token's top ``topk_groups`` groups."""
  t, e = sel.shape
  _, top = jax.lax.top_k(group_scores(sel, n_groups, how), topk_groups)  # [T, topk_groups]
  keep = jnp.zeros((t, n_groups), bool).at[jnp.arange(t)[:, None], top].set(True)
  return jnp.repeat(keep, e // n_groups, axis=-1)


def limit_to_groups(sel: jax.Array, cfg: RoutingConfig) -> jax.Array:
  """sel[T, E_r] with experts outside the chosen groups set to -inf.

  -inf rather than 0 (the HF DeepSeek-V3 code uses masked_fill(..., 0.0)):
  biased scores can be negative, and a masked expert at 0 would then beat
  the surviving ones.
  """
  if cfg.n_groups <= 1:
    return sel
  keep = group_mask(sel, cfg.n_groups, cfg.topk_groups, resolve_group_score(cfg))
  return jnp.where(keep, sel, -jnp.inf)
