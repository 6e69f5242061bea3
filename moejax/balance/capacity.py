"""Expert capacity and token dropping.

Legend: T tokens, K slots per token, E FFN experts (ids >= E name
zero-computation experts, which have no capacity), C capacity per expert.

A capacity-limited layer keeps at most C token copies per FFN expert; the
rest are dropped (their slot becomes invalid with weight 0, so the token's
contribution from that expert is 0 and it passes on the residual, as in
Switch). Which copies are kept is the priority rule:

* ``position`` (GShard / Switch): slot-major, i.e. every token's top-1 choice
  is served before any top-2 choice, and within one slot earlier tokens
  first. (A token-major order, slot by slot per token, would let early
  tokens' 2nd choices evict later tokens' 1st choices.)
* ``score``: highest gate weight first, ties in ``position`` order. This is
  batch prioritized routing (Riquelme et al. V-MoE, arXiv 2106.05974)
  with the per-slot gate as the priority, which is also DeepSeek-V2's drop
  rule (lowest affinity dropped first). V-MoE ranks by the token's top-1
  gate instead; the two agree for K = 1.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from moejax.balance import stats
from moejax.config import DROP_PRIORITIES
from moejax.routing.types import RoutingResult


def expert_capacity(num_tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float) -> int:
  """C = max(1, ceil(capacity_factor * T * K / E)) token copies per expert.

  Switch Transformer's expert capacity (K = 1) generalised to K copies per
  token as in GShard. A 1e-9 slack absorbs float error (1.1 * 10 is
  11.000000000000002 in binary, which must stay 11).
  """
  for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts),
                      ("top_k", top_k)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"expert_capacity: {name}={value!r} must be a positive int")
  if not capacity_factor > 0:
    raise ValueError(f"expert_capacity: capacity_factor={capacity_factor!r} must be > 0. "
                     "Fix: use e.g. 1.25 (Switch), or no capacity for dropless")
  return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts - 1e-9))


def slots_per_expert(num_tokens: int, num_experts: int, top_k: int,
                     capacity_factor: float) -> float:
  """cf * T * K / E: each expert's capacity before it is rounded up (and clamped to >= 1).

  Below 1, the capacity factor asks for less than one slot per expert and
  :func:`expert_capacity` gives every expert a single slot: of T * K copies
  at most E are kept.
  """
  return capacity_factor * num_tokens * top_k / num_experts


# The share of token copies dropped over a run's first logged steps above which the
# trainer warns (moejax.train.config.drop_warning): most tokens would skip their experts.
DROP_WARN_BOUND = 0.5


def drop_warning(drop_rate, capacity_factor, field: str,
                 bound: float = DROP_WARN_BOUND) -> Optional[str]:
  """One ``warning:`` line when ``drop_rate`` (a fraction of copies) is above ``bound``, else None."""
  if capacity_factor is None or drop_rate is None or not drop_rate > bound:
    return None
  return (f"warning: {100 * drop_rate:.1f}% of token copies were dropped over the first logged "
          f"steps (above {100 * bound:.0f}%): {field}={capacity_factor!r} leaves the experts "
          f"(almost) no slots. Fix: raise {field} (Switch uses 1.25) or set it to None "
          "(dropless)")


def apply_capacity(result: RoutingResult, capacity, *, num_experts: int,
                   priority: str = "position") -> tuple[RoutingResult, jax.Array]:
  """Drops token copies beyond each FFN expert's capacity.

  Args:
    result: routing of T tokens over K slots.
    capacity: C, int (or int32[] array) copies kept per FFN expert.
    num_experts: E; slots on ids >= E (zero-computation experts) are never
      dropped, and invalid slots are ignored.
    priority: ``position`` (slot-major, GShard) or ``score`` (gate weight).

  Returns:
    (result with dropped slots made invalid, weight 0 and expert id 0,
     dropped bool[T, K]).
  """
  if priority not in DROP_PRIORITIES:
    raise ValueError(f"apply_capacity: priority={priority!r} unknown. "
                     f"Fix: use one of {', '.join(DROP_PRIORITIES)}")
  stats.check_num_experts(result, num_experts, "apply_capacity")
  if isinstance(capacity, int) and capacity < 0:
    raise ValueError(f"apply_capacity: capacity={capacity} must be >= 0")
  t, k = result.expert_ids.shape
  eligible = stats.counted_slots(result, num_experts)
  # Work slot-major ([K, T] flattened): index order = position priority.
  ids = jnp.where(eligible, result.expert_ids, num_experts).T.reshape(-1)
  if priority == "position":
    rank = jnp.arange(t * k)
  else:
    w = result.weights.astype(jnp.float32).T.reshape(-1)
    rank = jnp.argsort(jnp.argsort(-w, stable=True), stable=True)
  # Sort by (expert, priority); a copy's place in its expert's queue is its
  # index minus the index of the expert's first copy.
  order = jnp.lexsort((rank, ids))
  sorted_ids = ids[order]
  first = jnp.searchsorted(sorted_ids, sorted_ids, side="left")
  place_sorted = jnp.arange(t * k) - first
  place = jnp.zeros((t * k,), place_sorted.dtype).at[order].set(place_sorted)
  dropped = (place >= capacity).reshape(k, t).T & eligible
  new = result.replace(
      valid=result.valid & ~dropped,
      weights=jnp.where(dropped, jnp.zeros_like(result.weights), result.weights),
      expert_ids=jnp.where(dropped, jnp.zeros_like(result.expert_ids), result.expert_ids))
  return new, dropped
