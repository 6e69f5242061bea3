"""The one routing result type every router produces, the router state, and the
routing context a router reads the batch through.

Legend: T tokens (on this device), N shards the batch is split over (1 on
one device), K expert slots per token, E FFN experts, Z zero-computation
experts, E_r = E + Z router outputs (ids >= E name zero-computation experts).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

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
    ideas: ``{idea name: {field: array}}``, the state the config's stateful
      ideas declare (:class:`IdeaState`); empty without one, so the stored
      tree of a run without stateful ideas is the bias and step alone.
  """

  bias: jax.Array
  step: jax.Array
  ideas: dict = dataclasses.field(default_factory=dict)

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


@dataclasses.dataclass(frozen=True)
class RoutingContext:
  """The batch a router decides on: where it lives and how to reduce over it.

  A token-local router never needs this. A *batch-wide* one (its decision
  for a token depends on the other tokens: Sinkhorn balancing, expert
  choice over the batch) takes every statistic over tokens through the
  helpers below. They reduce over ``axis_names``, the mesh axes the batch is
  split over inside ``jax.shard_map`` (``ep_moe_layer``, the model under
  data parallelism), and are plain reductions on one device, so a router
  written with them decides on the whole batch either way. The batch is what
  the layer is called on: one micro-batch under gradient accumulation; under
  ``jax.jit`` data parallelism without ``shard_map`` the router already sees
  the whole (sharded) batch and ``axis_names`` is ().

  Attributes:
    axis_names: mesh axes the batch is split over; () on one device.
    num_tokens: N T, the tokens of the whole batch (a static int).
    local_tokens: T, the tokens this call routes.
    batch_shape: (B, S) the local tokens were flattened from (sequence-major).
    train: the layer is in training (eval and decoding: False).
  """

  axis_names: tuple[str, ...]
  num_tokens: int
  local_tokens: int
  batch_shape: tuple[int, int]
  train: bool = False

  @classmethod
  def build(cls, local_tokens: int, axis_names=(), *,
            batch_shape: Optional[tuple[int, int]] = None,
            train: bool = False) -> "RoutingContext":
    """The context of ``local_tokens`` tokens split over ``axis_names``.

    With axis names it must be built inside the mapped function
    (``shard_map``), where the axes' sizes are known.
    """
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    shards = math.prod(jax.lax.axis_size(a) for a in names) if names else 1
    shape = (1, local_tokens) if batch_shape is None else tuple(batch_shape)
    if shape[0] * shape[1] != local_tokens:
      raise ValueError(f"RoutingContext: batch_shape={shape} holds {shape[0] * shape[1]} "
                       f"tokens, not {local_tokens}. Fix: pass the (B, S) the tokens came from")
    return cls(names, int(shards) * local_tokens, local_tokens, shape, bool(train))

  @property
  def num_shards(self) -> int:
    """N, the shards the batch is split over (1 on one device)."""
    return self.num_tokens // self.local_tokens

  def psum(self, value):
    """A per-shard value summed over the shards (identity on one device)."""
    return jax.lax.psum(value, self.axis_names) if self.axis_names else value

  def sum(self, x: jax.Array) -> jax.Array:
    """x[T, ...] summed over every token of the batch -> [...]."""
    return self.psum(jnp.sum(x, axis=0))

  def mean(self, x: jax.Array) -> jax.Array:
    """x[T, ...] averaged over every token of the batch -> [...]."""
    return self.sum(x) / self.num_tokens

  def max(self, x: jax.Array) -> jax.Array:
    """x[T, ...]'s maximum over every token of the batch -> [...]."""
    m = jnp.max(x, axis=0)
    return jax.lax.pmax(m, self.axis_names) if self.axis_names else m

  def gather(self, x: jax.Array) -> jax.Array:
    """x[T, ...] of every shard -> [N T, ...] in global token order (the mesh's order)."""
    if not self.axis_names:
      return x
    return jax.lax.all_gather(x, self.axis_names, axis=0, tiled=True)

  def token_offset(self) -> jax.Array:
    """int32[]: the global index of this shard's first token (0 on one device)."""
    idx = jnp.zeros((), jnp.int32)
    for a in self.axis_names:  # row-major over the axes, as the batch is split
      idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return idx * self.local_tokens


@dataclasses.dataclass(frozen=True)
class IdeaState:
  """The per-layer state a router, balance loss or bias rule declares; its three functions.

  An idea carrying one (``RouterSpec.state``, ``register_loss(..., state=)``,
  ``register_bias_rule(..., state=)``) gets, in every MoE layer, the fields
  ``init`` returns, kept under the idea's name in ``RouterState.ideas``:

  - ``init(cfg) -> {field: value}``: the first values, from the layer's
    MoEConfig (a coefficient, an EMA, a counter);
  - ``observe(result, cfg, *, state, context) -> {name: f32}``: what one
    forward saw, from the router's decision before capacity. Each value is a
    *sum over the batch's tokens* (``context.sum``; ``context.num_tokens``
    for a count of tokens), so micro-batches add up and expert parallelism
    gives the whole batch's: a per-token quantity (a target k) stays per
    token whatever the batch, sequence length or device count. None: nothing;
  - ``update(state, observed, cfg) -> {field: value}``: the next values, run
    once per optimizer step outside the gradient (as the bias controller),
    on the observations summed over the whole step's batch.

  ``logged``: the fields logged as ``state/<idea>/<field>`` (their mean over
  MoE layers); None logs every scalar field. Routers and losses whose
  function takes a ``state`` parameter read ``{idea: {field: value}}`` of
  their layer (read only, without gradient); bias rules likewise.
  """

  init: Callable
  update: Callable
  observe: Optional[Callable] = None
  logged: Optional[tuple[str, ...]] = None
