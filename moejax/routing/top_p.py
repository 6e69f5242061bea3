"""Top-p (dynamic-k) routing (``kind='top_p'``), Huang et al. 2403.07652.

Legend: T tokens, d model width, E_r router outputs (FFN plus zero-computation
experts), K = top_k (the max k).

Experts are ranked by score (plus bias when ``use_bias``) and added in that
order while the probability mass already included is below ``top_p``:

    slot j is valid  iff  sum_{i<j} p[t, id_i] < top_p,   j < K

so the first expert is always in (at least 1), a token stops as soon as its
included mass reaches the threshold, and never exceeds K = top_k experts
(the cap; the included mass can then be below top_p). p are the router
probabilities (softmax, or sigmoid-family scores / their sum).

Gates follow ``gating`` on the valid slots. The paper uses the original
probabilities, unrenormalised: that is gating='scores' (for softmax scores).
gating='normalized' (and 'topk_softmax', equal to it for softmax) rescales
the included probabilities to sum 1.
"""

from __future__ import annotations

import dataclasses

from typing import Optional

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.routing.gating import gate_weights
from moejax.routing.logits import router_logits
from moejax.routing.types import RoutingResult, make_result
from moejax.routing.scores import probs_from_scores, scores
from moejax.routing.spec import RouterSpec, register
from moejax.routing.topk import selection_key
from moejax.config.core import check_fraction


def select_top_p(logits: jax.Array, bias: Optional[jax.Array], cfg: MoEConfig) -> RoutingResult:
  """Top-p decision from logits f[T, E_r]; K = top_k slots, valid = included."""
  rc = cfg.routing
  s = scores(logits, rc.score_fn)
  p = probs_from_scores(s, rc.score_fn)
  _, ids = jax.lax.top_k(selection_key(s, bias, cfg), rc.top_k)  # [T, K]
  p_sel = jnp.take_along_axis(p, ids, axis=-1)
  # Exclusive cumulative sum: mass included before slot j (exactly 0 at j=0).
  before = jnp.concatenate(
      [jnp.zeros_like(p_sel[:, :1]), jnp.cumsum(p_sel, axis=-1)[:, :-1]], axis=-1)
  valid = before < rc.opts.top_p
  w = gate_weights(s, logits, ids, valid, rc.gating, rc.routed_scaling_factor)
  return make_result(ids, w, valid, p, logits)


def route_top_p(params, x, bias, cfg: MoEConfig, *, token_ids=None, rng=None,
                train=False) -> RoutingResult:
  del token_ids
  return select_top_p(router_logits(params["w"], x, cfg.routing, rng, train), bias, cfg)


@dataclasses.dataclass(frozen=True)
class TopPOptions:
  """top_p: cumulative-probability threshold; ``routing.top_k`` is the max k."""

  top_p: float = 0.5

  def __post_init__(self):
    check_fraction("moe.routing.options.top_p", self.top_p,
                   fix="pick a cumulative-probability threshold in (0, 1] such as 0.4")


class TopP(RouterSpec):
  """Dynamic k: experts added by score until their mass reaches top_p (at most top_k).

  The accounting counts the maximum k (a budget bound, not the realised mean).
  """

  name = "top_p"
  Options = TopPOptions
  supports_bias = True

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    return route_top_p(params, x, bias, cfg, token_ids=token_ids, rng=rng, train=train)


register(TopP())
