"""Shared statistics of a routing result: per-expert counts and mesh reductions.

Legend: T tokens, K slots per token, E experts counted (the leading
``num_experts`` router outputs), E_r all router outputs (FFN plus
zero-computation experts, ``probs.shape[-1]``).

Every balance loss and load metric reads the same few numbers: how many
valid token copies each expert received, how many tokens there were and the
summed router probabilities. When those numbers must describe the *global*
batch (Qwen's LBL+sync, MaxVio, the bias controller), they are summed over
the named mesh axes with ``jax.lax.psum`` here, inside ``jax.shard_map``,
before any nonlinear function of them is taken.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax
import jax.numpy as jnp

from moejax.routing.types import RoutingResult

AxisNames = str | Sequence[str]


def axes(axis_names: AxisNames) -> tuple[str, ...]:
  """Normalises ``'data'`` / ``('data', 'expert')`` / ``()`` to a tuple."""
  if isinstance(axis_names, str):
    return (axis_names,)
  return tuple(axis_names)


def psum(x, axis_names: AxisNames):
  """Sum over the mesh axes (identity when there are none)."""
  names = axes(axis_names)
  return jax.lax.psum(x, names) if names else x


def pmean(x, axis_names: AxisNames):
  """Mean over the mesh axes (identity when there are none)."""
  names = axes(axis_names)
  return jax.lax.pmean(x, names) if names else x


def check_num_experts(result: RoutingResult, num_experts: int, where: str) -> None:
  """Fails early when ``num_experts`` cannot index ``result.probs``."""
  if not isinstance(num_experts, numbers.Integral) or isinstance(num_experts, bool):
    raise TypeError(f"{where}: num_experts must be a static integer, "
                    f"got {type(num_experts).__name__}. Fix: pass a Python int "
                    "(static_argnames under jit)")
  total = result.probs.shape[-1]
  if not 1 <= num_experts <= total:
    raise ValueError(
        f"{where}: num_experts={num_experts} must be in [1, {total}] "
        f"(result.probs has {total} router outputs). Fix: pass the number of "
        "FFN experts (MoEConfig.num_experts) or all outputs (MoEConfig.num_routed)")


def counted_slots(result: RoutingResult, num_experts: int,
                  slots: slice = slice(None)) -> jax.Array:
  """bool[T, K']: valid slots whose expert id is in [0, num_experts)."""
  ids, valid = result.expert_ids[:, slots], result.valid[:, slots]
  return valid & (ids >= 0) & (ids < num_experts)


def expert_counts(result: RoutingResult, num_experts: int,
                  slots: slice = slice(None)) -> jax.Array:
  """f32[E] number of valid token copies per expert id < num_experts (local).

  ``slots`` restricts the count to some slots (``slice(0, 1)``: top-1 only).
  Slots on ids >= num_experts (zero-computation experts when num_experts is
  the FFN count) are not counted.
  """
  keep = counted_slots(result, num_experts, slots)
  ids = jnp.where(keep, result.expert_ids[:, slots], 0)
  return jnp.zeros((num_experts,), jnp.float32).at[ids.reshape(-1)].add(
      keep.reshape(-1).astype(jnp.float32))


def mean_probs(result: RoutingResult, num_experts: int,
               axis_names: AxisNames = ()) -> jax.Array:
  """f32[E] P_i = mean over the (global) tokens of probs[t, i], i < num_experts."""
  probs = result.probs[:, :num_experts].astype(jnp.float32)
  total = psum(jnp.sum(probs, axis=0), axis_names)
  tokens = psum(jnp.asarray(probs.shape[0], jnp.float32), axis_names)
  return total / tokens
