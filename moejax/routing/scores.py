"""Score functions and router probabilities.

Legend: T tokens, d model width, E_r router outputs (FFN plus zero-computation
experts).

A score function maps router logits f[T, E_r] to per-expert scores s[T, E_r]:
``softmax`` (Switch, Mixtral, Qwen), ``sigmoid`` (DeepSeek-V3) and
``sqrtsoftplus`` = sqrt(softplus(z)) (DeepSeek-V4). Balance losses and
metrics need a distribution over experts, so :func:`probs_from_scores`
divides sigmoid-family scores by their sum; softmax scores already are one.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from moejax.config import RoutingConfig


def _sqrtsoftplus(logits: jax.Array) -> jax.Array:
  return jnp.sqrt(jax.nn.softplus(logits))


SCORE_FNS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "softmax": lambda z: jax.nn.softmax(z, axis=-1),
    "sigmoid": jax.nn.sigmoid,
    "sqrtsoftplus": _sqrtsoftplus,
}


def router_dtype(cfg: RoutingConfig) -> jnp.dtype:
  """The dtype of the router matmul and score function.

  float32 by default even under bf16 activations: Switch (Fedus et al.,
  Table 2) found a bf16 router diverges ("selective precision").
  """
  return jnp.dtype(cfg.router_dtype)


def scores(logits: jax.Array, score_fn: str) -> jax.Array:
  """f[T, E_r] -> s[T, E_r], computed in the dtype of ``logits``."""
  return SCORE_FNS[score_fn](logits)


def probs_from_scores(s: jax.Array, score_fn: str) -> jax.Array:
  """s[T, E_r] -> p[T, E_r] summing to 1 over E_r (sigmoid-family: s / sum s)."""
  if score_fn == "softmax":
    return s
  # sqrtsoftplus and sigmoid are strictly positive, so the sum is > 0 unless
  # every score underflows; the floor keeps that case finite.
  return s / jnp.maximum(jnp.sum(s, axis=-1, keepdims=True), jnp.finfo(s.dtype).tiny)
