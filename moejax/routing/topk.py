"""Token-choice top-k routing (``kind='topk'``).

Legend: T tokens, d model width, E_r router outputs (FFN plus zero-computation
experts), K = top_k slots per token.

One rule covers Switch top-1, GShard/Mixtral top-2, Qwen-MoE, DeepSeek-V2/V3
(group-limited, sigmoid + aux-loss-free bias) and DeepSeek-V4
(sqrtsoftplus):

1. s = score_fn(logits)                         [T, E_r]
2. selection key = s + bias if use_bias else s  (bias from RouterState)
3. optional group limit: experts outside the top ``topk_groups`` groups -> -inf
4. ids = top-K of the selection key              [T, K], descending
5. gates from the *unbiased* s (or logits) of the chosen experts by
   ``gating``, times ``routed_scaling_factor`` (see moejax.routing.gating).

Switch top-1 is K=1, softmax, gating='scores'. Mixtral is softmax +
gating='topk_softmax', which equals softmax over all E_r, take top-K,
renormalise (Qwen norm_topk_prob=True): the softmax normaliser cancels.
Zero-computation experts are just extra columns of the logits.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.routing.gating import gate_weights
from moejax.routing.groups import limit_to_groups
from moejax.routing.logits import router_logits
from moejax.routing.types import RoutingResult, make_result
from moejax.routing.scores import probs_from_scores, scores
from moejax.routing.spec import RouterSpec, register


def selection_key(s: jax.Array, bias: Optional[jax.Array], cfg: MoEConfig) -> jax.Array:
  """[T, E_r] key the experts are ranked by: s (+ bias), group-limited.

  The bias is router *state*: stop_gradient makes sure no gradient reaches it
  even if a caller passes it through a differentiated function.
  """
  rc = cfg.routing
  key = s
  if rc.use_bias:
    key = s + jax.lax.stop_gradient(bias).astype(s.dtype)
  return limit_to_groups(key, rc)


def select_topk(logits: jax.Array, bias: Optional[jax.Array], cfg: MoEConfig) -> RoutingResult:
  """Top-k routing decision from logits f[T, E_r] (and bias f32[E_r] if used)."""
  rc = cfg.routing
  s = scores(logits, rc.score_fn)
  _, ids = jax.lax.top_k(selection_key(s, bias, cfg), rc.top_k)
  valid = jnp.ones(ids.shape, bool)
  w = gate_weights(s, logits, ids, valid, rc.gating, rc.routed_scaling_factor)
  return make_result(ids, w, valid, probs_from_scores(s, rc.score_fn), logits)


def route_topk(params, x, bias, cfg: MoEConfig, *, token_ids=None, rng=None,
               train=False) -> RoutingResult:
  del token_ids
  return select_topk(router_logits(params["w"], x, cfg.routing, rng, train), bias, cfg)


class TopK(RouterSpec):
  """Token-choice top-k: one linear router, K experts per token."""

  name = "topk"
  supports_bias = True
  supports_groups = True
  isolates_shared = True

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    return route_topk(params, x, bias, cfg, token_ids=token_ids, rng=rng, train=train)


register(TopK())
