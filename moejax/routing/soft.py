"""Soft MoE weights, Puigcerver et al. 2308.00951.

Legend: T tokens, d model width, E experts, p slots per expert, N = E * p
slots.

No discrete routing: every slot is a convex mix of all tokens and every token
a convex mix of all slots. With Phi [d, N] and a learned scalar scale:

    logits = l2norm(X) @ l2norm(Phi) * scale        [T, N]
    D = softmax over tokens (axis T) per slot       dispatch, columns sum 1
    C = softmax over slots  (axis N) per token      combine,  rows sum 1

l2norm is over d for each token and each column of Phi (the paper's
normalisation, which keeps the logits in [-scale, scale] as d grows). The
layer composes slots = D^T X, expert i on slots i*p .. i*p + p - 1, and
Y = C @ expert_outputs; this module only provides the weights. Every slot
mixes all T tokens, so Soft MoE is not causal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.config.core import check_count
from moejax.routing.scores import router_dtype


@dataclasses.dataclass(frozen=True)
class SoftOptions:
  """Soft MoE's options (``moe.layer_options`` with ``moe.kind='soft'``).

  Attributes:
    slots_per_expert: p slots per expert; a sequence fills E p slots.
  """

  slots_per_expert: int = 1

  def __post_init__(self):
    check_count("moe.layer_options.slots_per_expert", self.slots_per_expert)


def _l2norm(v: jax.Array, axis: int) -> jax.Array:
  # The epsilon keeps an all-zero token (padding) at 0 instead of NaN.
  return v * jax.lax.rsqrt(jnp.sum(v * v, axis=axis, keepdims=True) + 1e-12)


def init_soft_params(key: jax.Array, d_model: int, cfg: MoEConfig) -> dict:
  """{'phi': f32[d, E*p] LeCun normal (the paper's init), 'scale': f32[] = 1}."""
  n = cfg.num_experts * cfg.layer_options.slots_per_expert
  phi = jax.nn.initializers.lecun_normal()(key, (d_model, n), jnp.float32)
  return {"phi": phi, "scale": jnp.ones((), jnp.float32)}


def soft_weights(params: dict, x: jax.Array, cfg: MoEConfig):
  """Dispatch and combine weights of Soft MoE.

  Args:
    params: {'phi': [d, N], 'scale': []} from :func:`init_soft_params`.
    x: f32/bf16[T, d] tokens.
    cfg: the layer config (num_experts, layer_options.slots_per_expert, router.router_dtype,
      router.freeze).

  Returns:
    (dispatch f32[T, N], combine f32[T, N], logits f32[T, N]); dispatch
    columns and combine rows sum to 1. Computed in router_dtype.
  """
  n = cfg.num_experts * cfg.layer_options.slots_per_expert
  if x.ndim != 2:
    raise ValueError(f"x has shape {x.shape}; soft_weights takes token-major x[T, d]. "
                     "Fix: reshape [B, S, d] to [B*S, d] (or vmap over B for per-sequence slots).")
  phi, scale = params["phi"], params["scale"]
  if phi.shape != (x.shape[1], n):
    raise ValueError(f"params['phi'] has shape {phi.shape}, expected ({x.shape[1]}, {n}) = "
                     f"(d_model, moe.topology.num_experts={cfg.num_experts} * "
                     f"moe.layer_options.slots_per_expert={cfg.layer_options.slots_per_expert}). "
                     "Fix: build params with init_soft_params for this config.")
  if cfg.routing.freeze:
    phi, scale = jax.lax.stop_gradient(phi), jax.lax.stop_gradient(scale)
  dt = router_dtype(cfg.routing)
  logits = jnp.einsum("td,dn->tn", _l2norm(x.astype(dt), -1), _l2norm(phi.astype(dt), 0),
                      preferred_element_type=dt) * scale.astype(dt)
  dispatch = jax.nn.softmax(logits, axis=0)
  combine = jax.nn.softmax(logits, axis=1)
  return dispatch.astype(jnp.float32), combine.astype(jnp.float32), logits.astype(jnp.float32)
