"""Expert-choice routing (``kind='expert_choice'``), Zhou et al. 2202.09368.

Legend: T tokens, d model width, E_r router outputs (FFN plus zero-computation
experts), C tokens per expert.

S = score_fn(logits) [T, E_r] (the paper: softmax over experts). Each expert
takes its top C tokens by S[:, e], with

    C = round(T * c / E_r),  c = moe.routing.options.capacity,

rounded half up (floor(T c / E_r + 0.5)) and clipped to [1, T]. Every expert
therefore processes exactly C tokens (balanced by construction) while a token
may get anywhere from 0 to E_r experts.

Output stays token-major so the execution plane needs nothing special:
K = E_r slots per token, slot e is expert e, valid where expert e chose the
token, weight = S[t, e] (the paper's gating; ``moe.routing.gating`` does not
apply), times routed_scaling_factor.

Which tokens an expert chooses among (``moe.routing.options.scope``):

- ``group`` (default): the tokens of this call, one group per device under
  expert parallelism (GShard's groups), so the expert-parallel layer equals
  the single-device layer run on each device's share; T is the group's.
- ``batch``: every token of the batch, through the routing context: the
  scores of all devices are gathered, each expert takes its top C of the
  N T tokens (C from N T), and each device keeps the choices that fall on its
  own tokens, so the expert-parallel layer equals the single-device layer
  on the whole batch. One device: the same as ``group``.

Not causal: an expert's top-C is taken over all T tokens, future ones
included. Route over shuffled or per-chunk token sets when that matters
(Wang et al. 2408.15664 §5.2 saw leakage shrink the loss artificially).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.routing.logits import router_logits
from moejax.routing.types import RoutingContext, RoutingResult, make_result
from moejax.routing.scores import probs_from_scores, scores
from moejax.routing.spec import RouterSpec, register
from moejax.config.core import check_choice, check_positive

SCOPES = ("group", "batch")


def tokens_per_expert(num_tokens: int, num_experts: int, capacity: float) -> int:
  """C = round-half-up(T * c / E_r), clipped to [1, T]."""
  c = math.floor(num_tokens * capacity / num_experts + 0.5)
  return max(1, min(num_tokens, c))


def select_expert_choice(logits: jax.Array, cfg: MoEConfig,
                         context: Optional[RoutingContext] = None) -> RoutingResult:
  """Expert-choice decision from logits f[T, E_r]; K = E_r slots per token.

  ``context`` (scope ``batch``): the batch these T tokens belong to; the
  experts choose among all of its tokens (default: these T alone).
  """
  rc = cfg.routing
  t, e = logits.shape
  s = scores(logits, rc.score_fn)
  if rc.opts.scope == "batch" and context is not None and context.axis_names:
    chosen = _choose_over_batch(jax.lax.stop_gradient(s), rc.opts.capacity, context)
  else:
    cap = tokens_per_expert(t, e, rc.opts.capacity)
    _, tok = jax.lax.top_k(s.T, cap)  # [E_r, C] tokens chosen by each expert
    chosen = jnp.zeros((e, t), bool).at[jnp.arange(e)[:, None], tok].set(True)
  valid = chosen.T  # [T, E_r]
  ids = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32), (t, e))
  return make_result(ids, s * rc.routed_scaling_factor, valid,
                     probs_from_scores(s, rc.score_fn), logits)


def _choose_over_batch(s: jax.Array, capacity: float, context: RoutingContext) -> jax.Array:
  """bool[E_r, T]: expert e chose local token t among the top C of the whole batch."""
  t, e = s.shape
  every = context.gather(s)  # [N T, E_r], global token order
  cap = tokens_per_expert(context.num_tokens, e, capacity)
  _, tok = jax.lax.top_k(every.T, cap)  # [E_r, C] global token indices
  local = tok - context.token_offset()
  mine = (local >= 0) & (local < t)
  # Choices on other devices' tokens land out of range and are dropped.
  return jnp.zeros((e, t), bool).at[jnp.arange(e)[:, None], jnp.where(mine, local, t)].set(
      True, mode="drop")


def route_expert_choice(params, x, bias, cfg: MoEConfig, *, token_ids=None, rng=None,
                        train=False, context: Optional[RoutingContext] = None) -> RoutingResult:
  del bias, token_ids
  return select_expert_choice(router_logits(params["w"], x, cfg.routing, rng, train), cfg,
                              context)


@dataclasses.dataclass(frozen=True)
class ExpertChoiceOptions:
  """capacity: c in C = T c / E_r tokens per expert (experts per token on average);
  scope: ``group`` (among this device's tokens) or ``batch`` (among the whole batch's)."""

  capacity: float = 2.0
  scope: str = "group"

  def __post_init__(self):
    check_positive("moe.routing.options.capacity", self.capacity)
    check_choice("moe.routing.options.scope", self.scope, SCOPES)


class ExpertChoice(RouterSpec):
  """Each expert picks its top C tokens: balanced by construction, not causal."""

  name = "expert_choice"
  Options = ExpertChoiceOptions
  token_choice = False
  batch_wide = True  # an expert's choice reads every token it chooses among
  causal = False
  why_not_causal = "expert choice lets each expert pick its top tokens over the whole sequence"

  def granular(self, options, m):
    # m times the experts at the same tokens per expert keeps c experts of
    # width f / m per token only if each token gets m c of them.
    return dataclasses.replace(options, capacity=options.capacity * m)

  def slots(self, cfg):
    # Each expert takes c T / E tokens, so a token is in c experts on average
    # and in all E at most.
    return cfg.routing.opts.capacity, float(cfg.num_experts)

  def replay_weights(self, result, expert_ids, valid, cfg):
    # The paper's gate: the chosen expert's score, whatever moe.routing.gating says.
    s = scores(result.logits, cfg.routing.score_fn)
    return jnp.take_along_axis(s, expert_ids, axis=-1) * cfg.routing.routed_scaling_factor

  def route(self, params, x, bias, cfg, *, token_ids, rng, train, context):
    return route_expert_choice(params, x, bias, cfg, token_ids=token_ids, rng=rng, train=train,
                               context=context)


register(ExpertChoice())
