"""Hierarchical routing (``kind='hierarchical'``): families, then experts.

Legend: T tokens, d model width, E_r router outputs (FFN plus zero-computation
experts), F families, K = top_k.

Experts are split into F contiguous families of m = E_r / F (expert e is in
family e // m). Two routers:

- coarse, params 'w_family' [d, F]: P(f) = normalised score_fn(x w_family);
- fine, params 'w' [d, E_r]: P(e | f) = score_fn of the fine logits normalised
  *within* e's family (for softmax: a softmax over the m experts of f).

probs[t, e] = P(f(e)) * P(e | f(e)) sums to 1 over E_r. A token keeps its
``top_k_families`` most probable families, then takes the top_k experts by
that joint probability among the experts of the kept families.

Gate convention: gates come from the joint probability of the chosen
experts, by ``gating``: 'scores' uses P(f) P(e|f) as is; 'normalized'
divides by their sum over the K chosen; 'topk_softmax' is a softmax over
log P(f) P(e|f), which is the same as 'normalized'. Then times
routed_scaling_factor. RoutingResult.logits holds the fine router's logits
(what a z-loss on the expert router reads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.routing.gating import gate_weights
from moejax.routing.logits import router_logits
from moejax.routing.types import RoutingResult, make_result
from moejax.routing.scores import probs_from_scores, scores
from moejax.routing.spec import RouterSpec, register
from moejax.config.core import ConfigError, check_count


def joint_probs(family_logits: jax.Array, expert_logits: jax.Array, score_fn: str) -> jax.Array:
  """[T, E_r] P(f(e)) * P(e | f(e]) from family logits [T, F] and expert logits [T, E_r]."""
  t, e = expert_logits.shape
  f = family_logits.shape[-1]
  p_fam = probs_from_scores(scores(family_logits, score_fn), score_fn)  # [T, F]
  # Normalise inside each family (a softmax over the family's logits, not a
  # global softmax renormalised, so a far-away family cannot underflow it).
  within = probs_from_scores(scores(expert_logits.reshape(t, f, e // f), score_fn), score_fn)
  return (p_fam[:, :, None] * within).reshape(t, e)


def select_hierarchical(family_logits: jax.Array, expert_logits: jax.Array,
                        cfg: MoEConfig) -> RoutingResult:
  """Hierarchical decision from family logits [T, F] and expert logits [T, E_r]."""
  rc = cfg.routing
  t, e = expert_logits.shape
  f = family_logits.shape[-1]
  joint = joint_probs(family_logits, expert_logits, rc.score_fn)
  p_fam = probs_from_scores(scores(family_logits, rc.score_fn), rc.score_fn)
  _, fams = jax.lax.top_k(p_fam, rc.opts.top_k_families)  # [T, top_k_families]
  keep = jnp.zeros((t, f), bool).at[jnp.arange(t)[:, None], fams].set(True)
  keep = jnp.repeat(keep, e // f, axis=-1)
  _, ids = jax.lax.top_k(jnp.where(keep, joint, -jnp.inf), rc.top_k)
  valid = jnp.ones(ids.shape, bool)
  log_joint = jnp.log(jnp.maximum(joint, jnp.finfo(joint.dtype).tiny))
  w = gate_weights(joint, log_joint, ids, valid, rc.gating, rc.routed_scaling_factor)
  return make_result(ids, w, valid, joint, expert_logits)


def route_hierarchical(params, x, bias, cfg: MoEConfig, *, token_ids=None, rng=None,
                       train=False) -> RoutingResult:
  del bias, token_ids
  k_fam, k_exp = jax.random.split(rng) if rng is not None else (None, None)
  family_logits = router_logits(params["w_family"], x, cfg.routing, k_fam, train)
  expert_logits = router_logits(params["w"], x, cfg.routing, k_exp, train)
  return select_hierarchical(family_logits, expert_logits, cfg)


@dataclasses.dataclass(frozen=True)
class HierarchicalOptions:
  """n_families F contiguous families of E_r / F experts; top_k_families kept per token."""

  n_families: int = 2
  top_k_families: int = 1

  def __post_init__(self):
    p = "moe.routing.options"
    check_count(f"{p}.n_families", self.n_families)
    check_count(f"{p}.top_k_families", self.top_k_families)
    if self.n_families < 2:
      raise ConfigError(f"{p}.n_families", self.n_families,
                        "hierarchical routing needs at least 2 families",
                        f"set {p}.n_families >= 2")
    if self.top_k_families > self.n_families:
      raise ConfigError(f"{p}.top_k_families", self.top_k_families,
                        f"exceeds {p}.n_families={self.n_families}",
                        f"set {p}.top_k_families <= {p}.n_families")


class Hierarchical(RouterSpec):
  """Families, then experts inside the kept families: two linear routers."""

  name = "hierarchical"
  Options = HierarchicalOptions

  def check(self, cfg):
    o, e = cfg.routing.opts, cfg.num_routed
    if e % o.n_families:
      raise ConfigError("moe.routing.options.n_families", o.n_families,
                        f"does not divide the {e} router outputs",
                        f"pick n_families among the divisors of {e}")
    per = (e // o.n_families) * o.top_k_families
    if cfg.routing.top_k > per:
      raise ConfigError("moe.routing.top_k", cfg.routing.top_k,
                        f"exceeds the {per} experts inside top_k_families="
                        f"{o.top_k_families} families of {e // o.n_families}",
                        "raise top_k_families or lower top_k")

  def param_shapes(self, d_model, cfg):
    return {"w": (d_model, cfg.num_routed), "w_family": (d_model, cfg.routing.opts.n_families)}

  def replay_weights(self, result, expert_ids, valid, cfg):
    # The gates read the joint probabilities (result.probs), as select_hierarchical's do.
    rc, joint = cfg.routing, result.probs
    log_joint = jnp.log(jnp.maximum(joint, jnp.finfo(joint.dtype).tiny))
    return gate_weights(joint, log_joint, expert_ids, valid, rc.gating, rc.routed_scaling_factor)

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    return route_hierarchical(params, x, bias, cfg, token_ids=token_ids, rng=rng, train=train)


register(Hierarchical())
