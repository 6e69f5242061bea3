"""Load metrics: expert load, MaxVio, drop rate, load entropy, active budget, co-activation.

Legend: T tokens, K slots per token, E FFN experts (ids >= E are
zero-computation experts, E_r = all router outputs).

Load metrics report **FFN experts only** (ids < ``num_experts``): a token
copy sent to a zero-computation expert costs no FLOPs and no communication,
so it is not load. Pass ``num_experts = MoEConfig.num_routed`` to count every
router output instead (what the bias controller needs). The MoE layer passes
the router's decision *before* capacity (loads are what the router asked
for; :func:`routing_metrics` reports drops and the computed active budget
separately). With ``axis_names`` the counts are psum-med over those mesh
axes, so every device reports the global-batch value. Soft MoE and PEER
layers have their own metrics (:func:`soft_metrics`, :func:`peer_metrics`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from moejax.balance import stats
from moejax.balance.aux import LayerMetrics
from moejax.balance.stats import AxisNames
from moejax.config import MoEConfig
from moejax.routing.types import RoutingResult


def expert_load(result: RoutingResult, num_experts: int,
                axis_names: AxisNames = ()) -> jax.Array:
  """f32[E] valid token copies per expert id < num_experts, summed over axis_names."""
  stats.check_num_experts(result, num_experts, "expert_load")
  return stats.psum(stats.expert_counts(result, num_experts), axis_names)


def max_vio(load: jax.Array) -> jax.Array:
  """f32[] MaxVio = (max_i load_i - mean load) / mean load (Wang et al. arXiv 2408.15664).

  0 iff the load is uniform; E - 1 when one expert takes everything. Defined
  as 0 when nothing is routed (no load, no violation). Computed on one
  batch's load it is MaxVio_batch; on a :class:`MaxVioAccumulator` over a
  validation set it is MaxVio_global.
  """
  load = jnp.asarray(load, jnp.float32)
  mean = jnp.mean(load, axis=-1)
  safe = jnp.where(mean > 0, mean, 1.0)
  return jnp.where(mean > 0, (jnp.max(load, axis=-1) - mean) / safe, 0.0)


@struct.dataclass
class MaxVioAccumulator:
  """Summed f32[E] load over many batches, for MaxVio_global; an immutable pytree.

  ``acc = MaxVioAccumulator.zeros(E); acc = acc.add(load)`` per batch, then
  ``acc.value()``. Works under jit and as a scan carry.
  """

  load: jax.Array

  @classmethod
  def zeros(cls, num_experts: int) -> "MaxVioAccumulator":
    return cls(load=jnp.zeros((num_experts,), jnp.float32))

  def add(self, load: jax.Array) -> "MaxVioAccumulator":
    if load.shape != self.load.shape:
      raise ValueError(f"MaxVioAccumulator.add: load shape {load.shape} != "
                       f"accumulated shape {self.load.shape}")
    return self.replace(load=self.load + load.astype(jnp.float32))

  def value(self) -> jax.Array:
    return max_vio(self.load)


def drop_rate(dropped: jax.Array, valid_before: jax.Array,
              axis_names: AxisNames = ()) -> jax.Array:
  """f32[] fraction of the valid token copies (slots) that were dropped.

  Args:
    dropped: bool[T, K] from :func:`apply_capacity`.
    valid_before: bool[T, K] slots valid before dropping (restrict it to FFN
      slots to get the FFN drop rate, as :func:`routing_metrics` does).
  0 when no slot was valid.
  """
  n_drop = stats.psum(jnp.sum(dropped & valid_before, dtype=jnp.float32), axis_names)
  n_valid = stats.psum(jnp.sum(valid_before, dtype=jnp.float32), axis_names)
  return jnp.where(n_valid > 0, n_drop / jnp.maximum(n_valid, 1.0), 0.0)


def load_entropy(load: jax.Array) -> jax.Array:
  """f32[] entropy of load / sum(load) divided by log E, in [0, 1].

  1 for a uniform load, 0 when one expert takes everything; defined as 1 for
  E = 1 (trivially balanced) and 0 when nothing is routed.
  """
  load = jnp.asarray(load, jnp.float32)
  e = load.shape[-1]
  total = jnp.sum(load, axis=-1, keepdims=True)
  p = load / jnp.where(total > 0, total, 1.0)
  h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  if e == 1:
    return jnp.where(total[..., 0] > 0, 1.0, 0.0)
  return h / math.log(e)


def active_experts(result: RoutingResult, num_experts: int, axis_names: AxisNames = ()
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-token active FFN experts and their mean and variance (the active budget).

  Returns:
    (count f32[T]: valid slots of each token on ids < num_experts,
     mean f32[], var f32[]: population mean/variance over the (global) tokens).
  Zero-computation experts (ids >= num_experts) are not active FFN experts,
  so MoE++ / LongCat-style routing and top-p routing show a nonzero variance
  and fixed top-k routing a variance of 0. Routers never repeat an expert in
  one token, so the slot count is the distinct-expert count.
  """
  stats.check_num_experts(result, num_experts, "active_experts")
  count = jnp.sum(stats.counted_slots(result, num_experts), axis=-1, dtype=jnp.float32)
  n = stats.psum(jnp.asarray(count.shape[0], jnp.float32), axis_names)
  mean = stats.psum(jnp.sum(count), axis_names) / n
  second = stats.psum(jnp.sum(jnp.square(count)), axis_names) / n
  return count, mean, jnp.maximum(second - jnp.square(mean), 0.0)


def coactivation(result: RoutingResult, num_experts: int,
                 axis_names: AxisNames = ()) -> jax.Array:
  """f32[E, E] tokens routed to both i and j; the diagonal is the load of i.

  C = M^T M with M[t, i] = 1 when token t has a valid slot on expert i.
  """
  stats.check_num_experts(result, num_experts, "coactivation")
  keep = stats.counted_slots(result, num_experts)
  ids = jnp.where(keep, result.expert_ids, 0)
  m = jnp.max(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32) * keep[..., None],
              axis=1)                                               # [T, E]
  return stats.psum(jnp.einsum("te,tf->ef", m, m), axis_names)


def routing_metrics(result: RoutingResult, cfg: MoEConfig, *,
                    dropped: jax.Array | None = None,
                    axis_names: AxisNames = ()) -> LayerMetrics:
  """The routing metrics of one routed layer over FFN experts (E = cfg.num_experts).

  ``result`` is the router's decision *before* capacity; ``dropped``
  (bool[T, K], from :func:`~moejax.balance.capacity.apply_capacity`) marks the
  copies capacity removed. Load metrics describe the decision (what the
  router asked of each expert, which is what balancing acts on); the active
  budget describes what was computed (kept copies); ``drop_rate`` how much
  capacity removed.

  Fields of the :class:`LayerMetrics` (the others None): ``load`` f32[E], ``max_vio`` (MaxVio_batch when axis_names span the
  global batch), ``load_entropy``, ``coactivation`` f32[E, E],
  ``zero_compute_fraction`` (share of valid slots on zero-computation
  experts), ``active_mean`` / ``active_var`` (FFN experts computed per
  token), ``active_over_max`` (share of tokens the router gave more FFN
  experts than its declared maximum, ``RouterSpec.slots``), and
  ``drop_rate`` (FFN copies) when ``dropped`` is given. Scalars are f32[].
  """
  if not isinstance(cfg, MoEConfig):
    raise TypeError(f"routing_metrics: cfg must be a MoEConfig, got {type(cfg).__name__}")
  e = cfg.num_experts
  load = expert_load(result, e, axis_names)
  kept = result
  if dropped is not None:
    if dropped.shape != result.valid.shape:
      raise ValueError(f"routing_metrics: dropped shape {dropped.shape} != "
                       f"valid shape {result.valid.shape}")
    kept = result.replace(valid=result.valid & ~dropped)
  _, mean, var = active_experts(kept, e, axis_names)
  # What the router asked for, against what it declares (the budget counts the declaration).
  asked = jnp.sum(stats.counted_slots(result, e), axis=-1, dtype=jnp.float32)   # [T]
  over = stats.psum(jnp.sum(asked > cfg.router.slots(cfg)[1], dtype=jnp.float32), axis_names)
  n_tokens = stats.psum(jnp.asarray(asked.shape[0], jnp.float32), axis_names)
  n_valid = stats.psum(jnp.sum(result.valid, dtype=jnp.float32), axis_names)
  n_zero = stats.psum(jnp.sum(result.valid & (result.expert_ids >= e), dtype=jnp.float32),
                      axis_names)
  return LayerMetrics(
      load=load,
      max_vio=max_vio(load),
      load_entropy=load_entropy(load),
      active_mean=mean,
      active_var=var,
      active_over_max=over / jnp.maximum(n_tokens, 1.0),
      zero_compute_fraction=jnp.where(n_valid > 0, n_zero / jnp.maximum(n_valid, 1.0), 0.0),
      coactivation=coactivation(result, e, axis_names),
      drop_rate=(None if dropped is None
                 else drop_rate(dropped, stats.counted_slots(result, e), axis_names)))


def _normalized_entropy(p: jax.Array, axis: int) -> jax.Array:
  """Entropy of the distributions p along ``axis`` divided by log(size), in [0, 1]."""
  n = p.shape[axis]
  h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=axis)
  return h / math.log(n) if n > 1 else jnp.ones_like(h)


def soft_metrics(dispatch: jax.Array, combine: jax.Array, cfg: MoEConfig, *,
                 axis_names: AxisNames = ()) -> LayerMetrics:
  """Metrics of a Soft MoE layer (Puigcerver et al. 2308.00951).

  Args:
    dispatch: f32[B, S, P] softmax over a sequence's S tokens for each of
      the P = E p slots (every slot's column sums to 1, so slots are balanced
      by construction).
    combine: f32[B, S, P] softmax over the P slots for each token.

  Fields of the :class:`LayerMetrics`: ``load`` f32[E]: the combine mass each expert contributes, summed
  over tokens (what "load" means when every token uses every expert a
  little); ``max_vio`` and ``load_entropy`` of it; ``dispatch_entropy``: mean
  over slots of the entropy of its token mixture / log S (1 = a slot averages
  its whole sequence, 0 = it copies one token); ``combine_entropy``: mean
  over tokens of the entropy of its slot mixture / log P.
  """
  e, p = cfg.num_experts, cfg.layer_options.slots_per_expert
  b, s, n = combine.shape
  mass = jnp.sum(combine.astype(jnp.float32), axis=(0, 1)).reshape(e, p).sum(-1)
  load = stats.psum(mass, axis_names)
  tokens = stats.psum(jnp.asarray(b * s, jnp.float32), axis_names)
  seqs = stats.psum(jnp.asarray(b, jnp.float32), axis_names)
  d_ent = stats.psum(jnp.sum(_normalized_entropy(dispatch, axis=1)), axis_names) / (seqs * n)
  c_ent = stats.psum(jnp.sum(_normalized_entropy(combine, axis=-1)), axis_names) / tokens
  return LayerMetrics(load=load, max_vio=max_vio(load), load_entropy=load_entropy(load),
                      dispatch_entropy=d_ent, combine_entropy=c_ent)


def peer_metrics(expert_ids: jax.Array, cfg: MoEConfig, *,
                 axis_names: AxisNames = ()) -> LayerMetrics:
  """Metrics of a PEER layer (He 2407.04153) from its retrievals.

  Args:
    expert_ids: int32[T, H, k] retrieved singleton experts (of N = n^2; the
      id is a n + b for sub-keys a of the first half and b of the second).

  Fields of the :class:`LayerMetrics`: ``experts_touched`` fraction of the N experts retrieved at least once
  in the (global) batch; ``load_entropy`` of the retrieval counts over the N
  experts; ``max_vio`` of them; ``key_max_vio`` / ``key_entropy``: the same
  for the 2n sub-keys (how evenly the product keys are used).
  """
  n = cfg.layer_options.num_keys
  flat = expert_ids.reshape(-1)
  counts = stats.psum(jnp.zeros((n * n,), jnp.float32).at[flat].add(1.0), axis_names)
  keys = jnp.concatenate([counts.reshape(n, n).sum(1), counts.reshape(n, n).sum(0)])
  return LayerMetrics(experts_touched=jnp.mean((counts > 0).astype(jnp.float32)),
                      load_entropy=load_entropy(counts), max_vio=max_vio(counts),
                      key_max_vio=max_vio(keys), key_entropy=load_entropy(keys))
