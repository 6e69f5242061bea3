"""The one routing result type every router produces, and the router state.

Legend: T tokens, K expert slots per token, E FFN experts, Z
zero-computation experts, E_r = E + Z router outputs (ids >= E name
zero-computation experts).
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
    probs: f32[T, E_r] router probabilities, summing to 1 over E_r for every
      token (softmax of the logits, or sigmoid-family scores divided by their
      sum). Balance losses and metrics read these.
    logits: f32[T, E_r] raw router logits (z-loss reads these).
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
    """f32[T, E_r]: 1 where token t is routed (validly) to expert e."""
    onehot = jax.nn.one_hot(self.expert_ids, self.num_experts, dtype=jnp.float32)
    return jnp.einsum("tke,tk->te", onehot, self.valid.astype(jnp.float32))

  def combine_weights(self) -> jax.Array:
    """f32[T, E_r]: gate weight of token t on expert e (0 if not routed)."""
    onehot = jax.nn.one_hot(self.expert_ids, self.num_experts, dtype=self.weights.dtype)
    return jnp.einsum("tke,tk->te", onehot, jnp.where(self.valid, self.weights, 0))


@struct.dataclass
class RouterState:
  """Non-trainable router state; never handed to the optimizer.

  Attributes:
    bias: f32[E_r] selection bias of aux-loss-free balancing (zeros when unused).
    step: int32[] number of controller updates applied (for freeze schedules).
  """

  bias: jax.Array
  step: jax.Array

  @classmethod
  def zeros(cls, num_experts: int) -> "RouterState":
    return cls(bias=jnp.zeros((num_experts,), jnp.float32), step=jnp.zeros((), jnp.int32))


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
