"""The routing plane's entry points: router parameters and ``route``.

Legend: T tokens, d model width, E_r router outputs (moe.num_routed: FFN
experts plus zero-computation experts), F families, K slots per token.

``route`` validates its inputs, applies router freezing (stop_gradient on
the router weights) and input jitter, then dispatches on
``cfg.routing.kind`` through :data:`ROUTERS`; every router returns the same
token-major RoutingResult. Each router's decision rule lives in its own
module and is also callable directly on logits (``select_*``), which is how
the hand-computed tests pin them.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from moejax.config import ROUTER_KINDS, MoEConfig
from moejax.routing.expert_choice import route_expert_choice
from moejax.routing.hashing import route_hash
from moejax.routing.hierarchical import route_hierarchical
from moejax.routing.logits import check_rng, jitter_input, needs_rng
from moejax.routing.top_p import route_top_p
from moejax.routing.topk import route_topk
from moejax.routing.types import RouterState, RoutingResult

# kind -> fn(params, x, bias, cfg, *, token_ids, rng, train) -> RoutingResult.
# x arrives already in the router dtype and jittered; rng is the logit-noise
# key (None outside training).
ROUTERS: dict[str, Callable[..., RoutingResult]] = {
    "topk": route_topk,
    "expert_choice": route_expert_choice,
    "hash": route_hash,
    "top_p": route_top_p,
    "hierarchical": route_hierarchical,
}
# The config registry is the one list of router kinds; every kind it allows
# must be implemented here, and nothing else.
assert tuple(ROUTERS) == ROUTER_KINDS, (tuple(ROUTERS), ROUTER_KINDS)

# Switch Transformer (Fedus et al. §2.4): truncated normal, variance 0.1 / d
# (their scale s = 0.1, ten times below the usual fan-in init). A small init
# keeps the early routing near uniform and, with the f32 router, stable.
_ROUTER_INIT = jax.nn.initializers.variance_scaling(0.1, "fan_in", "truncated_normal")


def init_router_params(key: jax.Array, d_model: int, cfg: MoEConfig) -> dict:
  """Router parameters for ``cfg.routing.kind``.

  Returns:
    {'w': f32[d, E_r]} with E_r = cfg.num_routed; plus 'w_family': f32[d, F] for
    ``hierarchical``; {} for ``hash`` (no parameters). Init: truncated normal
    with variance 0.1 / d (Switch).
  """
  _check_layer_kind(cfg)
  rc = cfg.routing
  if rc.kind == "hash":
    return {}
  k_w, k_fam = jax.random.split(key)
  params = {"w": _ROUTER_INIT(k_w, (d_model, cfg.num_routed), jnp.float32)}
  if rc.kind == "hierarchical":
    params["w_family"] = _ROUTER_INIT(k_fam, (d_model, rc.n_families), jnp.float32)
  return params


def route(params: dict, x: jax.Array, state: Optional[RouterState], cfg: MoEConfig, *,
          token_ids: Optional[jax.Array] = None, rng: Optional[jax.Array] = None,
          train: bool = False) -> RoutingResult:
  """Routes tokens x f32/bf16[T, d] to experts.

  Args:
    params: from :func:`init_router_params`.
    x: token-major activations [T, d] (flatten [B, S, d] first).
    state: RouterState; its bias f32[E_r] is read when cfg.routing.use_bias
      (may be None otherwise).
    cfg: the layer config (static).
    token_ids: int[T], required by ``hash`` routing.
    rng: PRNG key for input jitter / logit noise; required when train and
      either is > 0, ignored otherwise.
    train: enables jitter and noise.

  Returns:
    RoutingResult (probs and logits f32[T, E_r]; router math in
    cfg.routing.router_dtype, float32 by default even for bf16 x).
  """
  _check_layer_kind(cfg)
  rc = cfg.routing
  _check_inputs(params, x, state, cfg)
  if rc.kind != "hash":  # hash routing reads no activations, so has no noise
    check_rng(rc, rng, train)
  if rc.freeze:
    params = jax.tree.map(jax.lax.stop_gradient, params)
  k_jitter = k_noise = None
  if needs_rng(rc, train) and rng is not None:
    k_jitter, k_noise = jax.random.split(rng)
  if rc.kind != "hash":
    x = jitter_input(x, rc, k_jitter, train)
  bias = state.bias if rc.use_bias else None
  return ROUTERS[rc.kind](params, x, bias, cfg, token_ids=token_ids, rng=k_noise, train=train)


def _check_layer_kind(cfg: MoEConfig) -> None:
  if cfg.kind != "sparse":
    fix = ("use moejax.routing.soft.soft_weights" if cfg.kind == "soft"
           else "PEER retrieves experts by product keys, not through this router")
    raise ValueError(f"moe.kind={cfg.kind!r}: route() serves token routing of sparse "
                     f"layers. Fix: {fix}.")


def _check_inputs(params: dict, x: jax.Array, state: Optional[RouterState],
                  cfg: MoEConfig) -> None:
  rc, e = cfg.routing, cfg.num_routed
  if x.ndim != 2:
    raise ValueError(f"x has shape {x.shape}; route takes token-major x[T, d]. "
                     "Fix: reshape [B, S, d] to [B*S, d].")
  want = {} if rc.kind == "hash" else {"w": (x.shape[1], e)}
  if rc.kind == "hierarchical":
    want["w_family"] = (x.shape[1], rc.n_families)
  for name, shape in want.items():
    if name not in params or params[name].shape != shape:
      got = params[name].shape if name in params else "missing"
      raise ValueError(
          f"router params[{name!r}] is {got}, expected {shape} for moe.topology.num_experts="
          f"{cfg.num_experts} + {cfg.num_zero_compute} zero-computation experts, "
          f"router.kind={rc.kind!r}. Fix: build params with init_router_params(key, "
          f"{x.shape[1]}, cfg).")
  if rc.use_bias:
    if state is None or state.bias.shape != (e,):
      got = None if state is None else state.bias.shape
      raise ValueError(f"moe.routing.use_bias=True needs RouterState.bias of shape ({e},), "
                       f"got {got}. Fix: pass RouterState.zeros(cfg.num_routed).")
