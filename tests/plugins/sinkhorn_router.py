"""A researcher's batch-wide router, registered from outside the package.

Legend: T tokens on this device, N T tokens of the batch, E_r router outputs,
K = top_k.

``balanced_sinkhorn``: each expert's logit is centred on its mean over the
batch (a logit every token shares does not steer the choice), then a
log-domain Sinkhorn spreads the batch evenly over the experts and every
token takes its top-K experts of the balanced plan, in training and in
evaluation alike. Gates follow ``moe.routing.gating`` on the centred scores
of the chosen experts, so the gradient runs through the batch mean. With
a = (z - mean_batch z) / tau [T, E_r] and g = 0 [E_r]:

    repeat ``iterations`` times:
      f[t] = -logsumexp_e(a[t, e] + g[e])                      rows sum to 1
      g[e] = log(N T / E_r) - logsumexp_t(a[t, e] + f[t])      columns to N T / E_r
    ids = top-K over e of a[t, e] + g[e]

Every statistic over tokens (the mean, the column maximum and sum of the
log-sum-exp) goes through the RoutingContext, so under ``ep_moe_layer`` it
decides on the whole batch. ``balanced_sinkhorn_local`` is the same rule
declaring ``expert_parallel = False``: it must be refused under expert
parallelism before anything runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax import routing
from moejax.config import check_count, check_positive
from moejax.routing.gating import gate_weights
from moejax.routing.logits import router_logits
from moejax.routing.scores import probs_from_scores, scores
from moejax.routing.types import make_result


@dataclasses.dataclass(frozen=True)
class SinkhornOptions:
  """iterations: Sinkhorn iterations; temperature: tau of the plan's logits."""

  iterations: int = 6
  temperature: float = 1.0

  def __post_init__(self):
    check_count("moe.routing.options.iterations", self.iterations)
    check_positive("moe.routing.options.temperature", self.temperature)


def _batch_logsumexp(v, context):
  """logsumexp over every token of the batch of v[T, E_r] -> [E_r]."""
  m = jax.lax.stop_gradient(context.max(v))
  return m + jnp.log(context.sum(jnp.exp(v - m)))


def balanced_plan(a, iterations, context):
  """Column potentials g[E_r] of the log-domain Sinkhorn plan of a[T, E_r]."""
  g = jnp.zeros(a.shape[-1], a.dtype)
  log_share = jnp.log(context.num_tokens / a.shape[-1])
  for _ in range(iterations):
    f = -jax.nn.logsumexp(a + g, axis=-1, keepdims=True)  # [T, 1], token-local
    g = log_share - _batch_logsumexp(a + f, context)
  return g


class BalancedSinkhorn(routing.RouterSpec):
  """Batch-centred logits, Sinkhorn-balanced top-k (batch-wide, exact under EP)."""

  name = "balanced_sinkhorn"
  Options = SinkhornOptions
  batch_wide = True
  causal = False
  why_not_causal = "the balanced plan of a token reads every token of the batch"

  def route(self, params, x, bias, cfg, *, token_ids, rng, train, context):
    rc = cfg.routing
    z = router_logits(params["w"], x, rc, rng, train)
    z = z - context.mean(z)                     # gradient flows through the batch mean
    a = jax.lax.stop_gradient(z) / rc.opts.temperature
    g = balanced_plan(a, rc.opts.iterations, context)
    _, ids = jax.lax.top_k(a + g, rc.top_k)
    s = scores(z, rc.score_fn)
    valid = jnp.ones(ids.shape, bool)
    w = gate_weights(s, z, ids, valid, rc.gating, rc.routed_scaling_factor)
    return make_result(ids, w, valid, probs_from_scores(s, rc.score_fn), z)


class BalancedSinkhornLocal(BalancedSinkhorn):
  """The same rule, declaring it cannot decide on a batch split over devices."""

  name = "balanced_sinkhorn_local"
  expert_parallel = False
  calls = 0  # route() calls: a refusal must come before the first

  def route(self, params, x, bias, cfg, *, token_ids, rng, train, context):
    type(self).calls += 1
    return super().route(params, x, bias, cfg, token_ids=token_ids, rng=rng, train=train,
                         context=context)


routing.register(BalancedSinkhorn())
routing.register(BalancedSinkhornLocal())
