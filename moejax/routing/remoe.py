"""ReMoE (``kind='remoe'``): ReLU routing with an adaptive L1 penalty toward k experts per token.

Wang, Zhu and Chen, "ReMoE: Fully Differentiable Mixture-of-Experts with
ReLU Routing" (arXiv 2412.14711, ICLR 2025). The router replaces top-k and
softmax by a ReLU: a token uses every expert whose gate is positive, and
the gate is the ReLU itself, so the decision is continuous and trained end
to end. Sparsity comes from an L1 penalty on the gates (the ``remoe_l1``
balance loss, :mod:`moejax.balance.remoe`) whose coefficient lambda is
moved once per optimizer step toward the target (Section 3.3 of the paper):

    lambda <- lambda * alpha ** sign((1 - k / E) - S),   S = 1 - a / E

with S the realised sparsity, a the realised active experts per token, k
the target (``routing.top_k``) and E the experts; so lambda grows by alpha
while tokens use more than k experts and shrinks while they use fewer.
(1 - k/E) - S = (a - k) / E, so the rule is written here per token:
lambda <- lambda * alpha ** sign(a - k). The paper's defaults: lambda_0 =
1e-8, alpha = 1.2.

Legend: T tokens on this device, N T the tokens of the batch, E FFN
experts, K = E slots per token (the valid ones are the positive gates).

Differences from the paper, and why:

- lambda is per layer (each layer's state), driven by that layer's own a;
  the paper keeps one lambda for the model, driven by the sparsity averaged
  over layers. Per layer, every layer's compute meets the target, which is
  what the budget accounting assumes.
- a is measured over the whole step's batch (every micro-batch and device,
  through the routing context's token count), so the target is per token
  whatever the batch, sequence length, rung or device count.

The accounting's declared slots are the target k (expected) and E (maximum):
a ReLU router may use every expert. The realised count is logged as
``active_experts_mean``; lambda as ``state/remoe/coef``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import ConfigError, MoEConfig
from moejax.config.core import check_number, check_positive
from moejax.routing.logits import router_logits
from moejax.routing.spec import RouterSpec, register
from moejax.routing.types import IdeaState, RoutingContext, RoutingResult, make_result

# The balance loss that carries ReMoE's penalty (moejax.balance.remoe).
L1_LOSS = "remoe_l1"


def select_relu(logits: jax.Array, cfg: MoEConfig) -> RoutingResult:
  """ReLU decision from logits f[T, E]: every expert a slot, valid where the gate is > 0.

  Gates are ReLU(logits) (times ``routed_scaling_factor``), unnormalised,
  as in the paper, so ``moe.routing.gating`` does not apply. ``probs`` are
  softmax(logits), what load-balance losses and metrics read.
  """
  t, e = logits.shape
  gates = jax.nn.relu(logits.astype(jnp.float32))
  ids = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32), (t, e))
  return make_result(ids, gates * cfg.routing.routed_scaling_factor, gates > 0,
                     jax.nn.softmax(logits.astype(jnp.float32), axis=-1), logits)


def active_per_token(result: RoutingResult) -> jax.Array:
  """f32[T]: each token's experts with a positive gate."""
  return jnp.sum(result.valid, axis=-1, dtype=jnp.float32)


def _init(cfg: MoEConfig) -> dict:
  return {"coef": jnp.asarray(cfg.routing.opts.l1_init, jnp.float32)}


def _observe(result: RoutingResult, cfg: MoEConfig, *, state, context: RoutingContext) -> dict:
  del cfg, state
  return {"active": context.sum(active_per_token(result)), "tokens": context.num_tokens}


def _update(own: dict, seen: dict, cfg: MoEConfig) -> dict:
  """lambda * alpha ** sign(a - k); unchanged by a step that routed no token."""
  rc = cfg.routing
  tokens = seen["tokens"]
  realised = seen["active"] / jnp.maximum(tokens, 1.0)
  step = jnp.where(tokens > 0, jnp.sign(realised - rc.top_k), 0.0)
  return {"coef": own["coef"] * jnp.power(jnp.float32(rc.opts.alpha), step)}


STATE = IdeaState(init=_init, update=_update, observe=_observe)


@dataclasses.dataclass(frozen=True)
class ReMoEOptions:
  """l1_init: lambda_0, the L1 coefficient before any update (the paper: 1e-8).
  alpha: lambda's factor per step (> 1; the paper: 1.2).
  balanced: weigh each expert's gates by its share of the batch's active
    slots, E / (k N T) sum_t 1[gate > 0] (the paper's load-balancing L1,
    Section 3.4); False: the plain L1 of the gates.
  """

  l1_init: float = 1e-8
  alpha: float = 1.2
  balanced: bool = True

  def __post_init__(self):
    check_positive("moe.routing.options.l1_init", self.l1_init)
    check_number("moe.routing.options.alpha", self.alpha, minimum=1.0, min_open=True,
                 fix="set moe.routing.options.alpha > 1, such as 1.2")
    if not isinstance(self.balanced, bool):
      raise ConfigError("moe.routing.options.balanced", self.balanced, "must be a bool",
                        "set it to True or False")


class ReMoE(RouterSpec):
  """ReLU gates over every expert; sparsity from the adaptive L1 penalty (state: lambda)."""

  name = "remoe"
  Options = ReMoEOptions
  state = STATE

  def check(self, cfg) -> None:
    coef = dict(cfg.balance.extra_losses).get(L1_LOSS, 0.0)
    if not coef:
      raise ConfigError("moe.balance.extra_losses", cfg.balance.extra_losses,
                        "routing.kind='remoe' gets its sparsity from its adaptive L1 penalty, "
                        "which is not in the objective",
                        f"add ('{L1_LOSS}', 1.0) to moe.balance.extra_losses")
    if cfg.routing.score_fn != "softmax":
      raise ConfigError("moe.routing.score_fn", cfg.routing.score_fn,
                        "ReMoE's gates are ReLU(logits) and its probabilities (what balance "
                        "losses and metrics read) softmax(logits); no other score is read",
                        "leave moe.routing.score_fn='softmax'")
    if cfg.num_zero_compute:
      raise ConfigError("moe.topology.zero_experts", cfg.num_zero_compute,
                        "ReMoE's target k counts FFN experts; zero-computation experts are "
                        "not defined for it", "set the zero-computation experts to 0")

  def result_k(self, cfg) -> int:
    return cfg.num_routed  # every expert is a slot (select_relu)

  def replay_weights(self, result, expert_ids, valid, cfg):
    # ReLU gates of the replayed experts, as select_relu's.
    gates = jax.nn.relu(jnp.take_along_axis(result.logits, expert_ids, axis=-1))
    return gates * cfg.routing.routed_scaling_factor

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    del bias, token_ids
    return select_relu(router_logits(params["w"], x, cfg.routing, rng, train), cfg)

  def slots(self, cfg) -> tuple[float, float]:
    """The target k expected (what lambda steers to), every expert at most."""
    return float(cfg.routing.top_k), float(cfg.num_experts)


register(ReMoE())
