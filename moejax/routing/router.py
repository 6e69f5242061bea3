"""The routing plane's entry points: router parameters and ``route``.

Legend: T tokens, d model width, E_r router outputs (moe.num_routed: FFN
experts plus zero-computation experts), K slots per token.

``route`` validates its inputs, applies router freezing (stop_gradient on
the router weights) and input jitter, then hands over to the registered
:class:`~moejax.routing.spec.RouterSpec` of ``cfg.routing.kind``; every
router returns the same token-major RoutingResult. Each router's decision
rule lives in its own module and is also callable directly on logits
(``select_*``), which is how the hand-computed tests pin them.
"""

from __future__ import annotations

from typing import Optional

import jax

from moejax.config import MoEConfig
from moejax.config.registry import LAYERS, ROUTERS
from moejax.routing.logits import check_rng, jitter_input, needs_rng
from moejax.routing import state as state_lib
from moejax.routing.spec import RouterSpec
from moejax.routing.types import RouterState, RoutingContext, RoutingResult


def spec_of(cfg: MoEConfig) -> RouterSpec:
  """The registered router of ``cfg.routing.kind``."""
  return ROUTERS.get(cfg.routing.kind)


def init_router_params(key: jax.Array, d_model: int, cfg: MoEConfig) -> dict:
  """Router parameters of ``cfg.routing.kind``: the spec's ``param_shapes``.

  Shipped: {'w': f32[d, E_r]} (E_r = cfg.num_routed), plus 'w_family': f32[d, F]
  for ``hierarchical``; {} for ``hash``. Init: truncated normal with variance
  0.1 / d (Switch).
  """
  _check_layer_kind(cfg)
  return spec_of(cfg).init_params(key, d_model, cfg)


def route(params: dict, x: jax.Array, state: Optional[RouterState], cfg: MoEConfig, *,
          token_ids: Optional[jax.Array] = None, rng: Optional[jax.Array] = None,
          train: bool = False, context: Optional[RoutingContext] = None) -> RoutingResult:
  """Routes tokens x f32/bf16[T, d] to experts.

  Args:
    params: from :func:`init_router_params`.
    x: token-major activations [T, d] (flatten [B, S, d] first).
    state: RouterState; its bias f32[E_r] is read when cfg.routing.use_bias
      (may be None otherwise).
    cfg: the layer config (static).
    token_ids: int[T], required by routers that read ids (``hash``).
    rng: PRNG key for input jitter / logit noise; required when train and
      either is > 0, ignored otherwise.
    train: enables jitter and noise.
    context: the batch these tokens belong to (the layer passes it; default:
      these T tokens on one device). Handed to routers whose ``route`` takes
      ``context``; a batch-wide router that cannot use it is refused here
      when the batch is split over mesh axes.

  Returns:
    RoutingResult (probs and logits f32[T, E_r]; router math in
    cfg.routing.router_dtype, float32 by default even for bf16 x).
  """
  _check_layer_kind(cfg)
  rc, spec = cfg.routing, spec_of(cfg)
  _check_inputs(params, x, state, cfg, spec)
  context = _check_context(context, x, train, spec)
  if spec.reads_activations:  # a router that reads no activations has no noise
    check_rng(rc, rng, train)
  if rc.freeze:
    params = jax.tree.map(jax.lax.stop_gradient, params)
  k_jitter = k_noise = None
  if needs_rng(rc, train) and rng is not None:
    k_jitter, k_noise = jax.random.split(rng)
  if spec.reads_activations:
    x = jitter_input(x, rc, k_jitter, train)
  bias = state.bias if rc.use_bias else None
  kw = {"context": context} if spec.reads_context else {}
  if state_lib.takes_state(type(spec).route):  # a stateful router reads its layer's state
    kw["state"] = state_lib.read(state.ideas if state is not None else {})
  return spec.route(params, x, bias, cfg, token_ids=token_ids, rng=k_noise, train=train, **kw)


def _check_layer_kind(cfg: MoEConfig) -> None:
  kind = LAYERS.get(cfg.kind)
  if not kind.routed:
    raise ValueError(f"moe.kind={cfg.kind!r}: route() serves token routing of routed "
                     f"layers. Fix: {kind.routing_fix}.")


def _check_inputs(params: dict, x: jax.Array, state: Optional[RouterState],
                  cfg: MoEConfig, spec: RouterSpec) -> None:
  rc, e = cfg.routing, cfg.num_routed
  if x.ndim != 2:
    raise ValueError(f"x has shape {x.shape}; route takes token-major x[T, d]. "
                     "Fix: reshape [B, S, d] to [B*S, d].")
  for name, shape in spec.param_shapes(x.shape[1], cfg).items():
    if name not in params or params[name].shape != tuple(shape):
      got = params[name].shape if name in params else "missing"
      raise ValueError(
          f"router params[{name!r}] is {got}, expected {tuple(shape)} for "
          f"moe.topology.num_experts={cfg.num_experts} + {cfg.num_zero_compute} "
          f"zero-computation experts, router.kind={rc.kind!r}. Fix: build params with "
          f"init_router_params(key, {x.shape[1]}, cfg).")
  if rc.use_bias:
    if state is None or state.bias.shape != (e,):
      got = None if state is None else state.bias.shape
      raise ValueError(f"moe.routing.use_bias=True needs RouterState.bias of shape ({e},), "
                       f"got {got}. Fix: pass RouterState.zeros(cfg.num_routed).")


def _check_context(context: Optional[RoutingContext], x: jax.Array, train: bool,
                   spec: RouterSpec) -> RoutingContext:
  """The context of x (one device when None); refuses one that does not describe x."""
  if context is None:
    return RoutingContext.build(x.shape[0], train=train)
  if not isinstance(context, RoutingContext):
    raise TypeError(f"route: context must be a RoutingContext, got {type(context).__name__}. "
                    "Fix: build it with RoutingContext.build(T, axis_names, train=train)")
  if context.local_tokens != x.shape[0] or context.train != bool(train):
    raise ValueError(f"route: the context describes {context.local_tokens} tokens with "
                     f"train={context.train}, but x has {x.shape[0]} and train={bool(train)}. "
                     "Fix: build the context from the x and train passed to route()")
  if context.axis_names and spec.batch_wide and spec.why_not_expert_parallel:
    raise ValueError(f"moe.routing.kind={spec.name!r}: {spec.why_not_expert_parallel} "
                     f"(the batch is split over {context.axis_names}). Fix: run it on one "
                     "device or without mesh axes, or pick another router")
  return context
