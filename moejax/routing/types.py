"""The one routing result type every router produces.

Legend (used across moejax): T tokens, d model width, E routed experts (FFN
experts plus zero-computation experts), K expert slots per token, f expert
hidden width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class RoutingResult:
  """Token-major routing decision; immutable pytree.

  Attributes:
    expert_ids: int32[T, K] chosen expert per slot; ids >= num FFN experts
      name zero-computation experts. Meaningless where ``valid`` is False
      (set to 0 there).
    weights: f32[T, K] gate weight per slot; exactly 0 where not valid.
    valid: bool[T, K] whether the slot is used. Variable-k routers (expert
      choice, top-p, dropped tokens) clear slots here.
    probs: f32[T, E] router probabilities, summing to 1 over E for every
      token (softmax of the logits, or sigmoid-family scores divided by their
      sum). Balance losses and metrics read these.
    logits: f32[T, E] raw router logits (z-loss reads these).
  """

  expert_ids: jax.Array
  weights: jax.Array
  valid: jax.Array
  probs: jax.Array
  logits: jax.Array

  @property
  def num_tokens(self) -> int:
    return self.expert_ids.shape[0]

  @property
  def k(self) -> int:
    return self.expert_ids.shape[1]

  @property
  def num_experts(self) -> int:
    return self.probs.shape[-1]

  def mask(self) -> jax.Array:
    """f32[T, E]: 1 where token t is routed (validly) to expert e."""
    onehot = jax.nn.one_hot(self.expert_ids, self.num_experts, dtype=jnp.float32)
    return jnp.einsum("tke,tk->te", onehot, self.valid.astype(jnp.float32))

  def combine_weights(self) -> jax.Array:
    """f32[T, E]: gate weight of token t on expert e (0 if not routed)."""
    onehot = jax.nn.one_hot(self.expert_ids, self.num_experts, dtype=self.weights.dtype)
    return jnp.einsum("tke,tk->te", onehot, jnp.where(self.valid, self.weights, 0))


@struct.dataclass
class RouterState:
  """Non-trainable router state; never handed to the optimizer.

  Attributes:
    bias: f32[E] selection bias of aux-loss-free balancing (zeros when unused).
    step: int32[] number of controller updates applied (for freeze schedules).
  """

  bias: jax.Array
  step: jax.Array

  @classmethod
  def zeros(cls, num_experts: int) -> "RouterState":
    return cls(bias=jnp.zeros((num_experts,), jnp.float32), step=jnp.zeros((), jnp.int32))
