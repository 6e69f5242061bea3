"""Assembling a RoutingResult with its invariants enforced in one place.

Legend: T tokens, E routed experts, K slots per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.routing.types import RoutingResult


def make_result(expert_ids: jax.Array, weights: jax.Array, valid: jax.Array,
                probs: jax.Array, logits: jax.Array) -> RoutingResult:
  """Builds a RoutingResult: int32 ids, f32 weights/probs/logits, bool valid.

  Where ``valid`` is False the id is set to 0 and the weight to exactly 0,
  so consumers can one-hot the ids without reading garbage.
  """
  valid = valid.astype(bool)
  return RoutingResult(
      expert_ids=jnp.where(valid, expert_ids, 0).astype(jnp.int32),
      weights=jnp.where(valid, weights, 0).astype(jnp.float32),
      valid=valid,
      probs=probs.astype(jnp.float32),
      logits=logits.astype(jnp.float32),
  )
