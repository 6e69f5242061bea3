"""The language-modelling loss: masked cross-entropy over token targets (shared by train and evaluate).

Legend: B batch, S sequence length, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array):
  """(mean f32[], sum f32[], count f32[]) of the CE over mask.

  logits f32[B, S, V], targets int32[B, S], mask bool[B, S]: padding (mask
  False) is neither scored nor counted, so the mean is nats per real token.
  """
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  m = mask.astype(jnp.float32)
  total, count = jnp.sum(ce * m), jnp.sum(m)
  return total / jnp.maximum(count, 1.0), total, count
