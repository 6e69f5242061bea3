"""S-BASE (``kind='sbase'``): Sinkhorn-balanced top-k in training, greedy top-k otherwise.

Clark et al. 2022 (Unified Scaling Laws for Routed Language Models, arXiv
2202.01169) replace BASE layers' exact balanced assignment (a linear
program) by a few Sinkhorn iterations: the router's affinities are scaled
until every expert holds the same share of the batch, and each token then
takes its top-k experts of the balanced matrix. At evaluation and decoding
the router is greedy (each token's top-k by its own scores), so inference
stays causal.

Legend: T tokens on this device, N T the tokens of the batch (the context's
``num_tokens``), E_r router outputs (FFN plus zero-computation experts), K
= top_k slots per token.

Training (``train=True``), with c = exp(z - max_e z) [T, E_r] from the
router logits z (a row's scale cancels in its normalisation, so this is
Sinkhorn on the softmax probabilities):

    d1 = 1                                        [E_r]
    repeat ``iterations`` times:
      d0[t] = 1 / (N T  sum_e c[t, e] d1[e])      rows -> 1 / (N T)
      d1[e] = 1 / (E_r  sum_t d0[t] c[t, e])      columns -> 1 / E_r
    ids = top-K over e of d0[t] c[t, e] d1[e]

The column sum runs over every token of the batch (``context.sum``), so
under expert parallelism the decision is the single-device one. The
iterations carry no gradient (the assignment is a selection); the gates are
the unbiased router scores of the chosen experts under ``moe.routing.gating``,
as for top-k. Megatron-LM's S-BASE router iterates until d1 moves by less
than 1e-4; here the count is fixed (``iterations``), so the cost is static
and every device runs the same collectives. Evaluation: :func:`select_topk`
without a bias (the shipped ``topk`` decision).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.config.core import check_count
from moejax.routing.gating import gate_weights
from moejax.routing.logits import router_logits
from moejax.routing.scores import probs_from_scores, scores
from moejax.routing.spec import RouterSpec, register
from moejax.routing.topk import select_topk
from moejax.routing.types import RoutingContext, RoutingResult, make_result


def sinkhorn(logits: jax.Array, iterations: int, context: RoutingContext) -> jax.Array:
  """f32[T, E_r] balanced affinities: rows sum to 1 / (N T), columns (over the batch) to 1 / E_r.

  After a finite number of iterations the columns are exact and the rows
  approximate (the last step normalises the columns).
  """
  z = logits.astype(jnp.float32)
  c = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))  # each row's maximum is 1
  e = c.shape[-1]
  d1 = jnp.ones((e,), jnp.float32)
  tiny = jnp.finfo(jnp.float32).tiny
  d0 = None
  for _ in range(iterations):  # unrolled: no collective inside control flow
    d0 = 1.0 / (context.num_tokens * jnp.maximum(c @ d1, tiny))             # [T]
    d1 = 1.0 / (e * jnp.maximum(context.sum(c * d0[:, None]), tiny))       # [E_r]
  return d0[:, None] * c * d1[None, :]


def select_sbase(logits: jax.Array, cfg: MoEConfig, context: RoutingContext) -> RoutingResult:
  """S-BASE decision from logits f[T, E_r]: Sinkhorn top-k in training, greedy otherwise."""
  if not context.train:
    return select_topk(logits, None, cfg)
  rc = cfg.routing
  balanced = sinkhorn(jax.lax.stop_gradient(logits), rc.opts.iterations, context)
  _, ids = jax.lax.top_k(balanced, rc.top_k)
  s = scores(logits, rc.score_fn)
  valid = jnp.ones(ids.shape, bool)
  w = gate_weights(s, logits, ids, valid, rc.gating, rc.routed_scaling_factor)
  return make_result(ids, w, valid, probs_from_scores(s, rc.score_fn), logits)


@dataclasses.dataclass(frozen=True)
class SBaseOptions:
  """iterations: Sinkhorn iterations in training (each one batch-wide sum of [E_r])."""

  iterations: int = 8

  def __post_init__(self):
    check_count("moe.routing.options.iterations", self.iterations)


class SBase(RouterSpec):
  """Sinkhorn-balanced top-k in training (batch-wide), greedy top-k in eval and decoding."""

  name = "sbase"
  Options = SBaseOptions
  batch_wide = True
  # causal stays True: decoding runs with train=False, the greedy top-k of each token.

  def route(self, params, x, bias, cfg, *, token_ids, rng, train, context):
    del bias, token_ids
    return select_sbase(router_logits(params["w"], x, cfg.routing, rng, train), cfg, context)


register(SBase())
