"""Dispatch and combine: token copies laid out by expert, and back.

Legend: T tokens, d model width, K slots per token, E FFN experts (ids >= E
name zero-computation experts), M = T * K token copies, C capacity per
expert, R rows of a layout (M for dropless, E * C for capacity buffers).

Two layouts, one :class:`Dispatch` description:

* :func:`sort_by_expert` (dropless, MegaBlocks): every routed copy gets a row;
  rows are sorted by expert (stable, so tokens stay in order inside an
  expert), giving contiguous groups of ``group_sizes[e]`` rows for a grouped
  matmul. Invalid slots and zero-computation experts get no row; the rows
  they would have used form a trailing zero region (R = M stays static).
* :func:`capacity_layout` ([E, C] buffers, GShard/Switch): row e * C + p is
  the p-th copy sent to expert e. **Drop rule** ('position' priority, as
  ``moejax.balance.capacity``): copies are ranked slot-major, all first
  choices (k = 0) before any second choice, earlier tokens first inside a
  choice; an expert keeps its first C copies and drops the rest. This is the
  layout the expert-parallel all_to_all moves. C itself comes from
  ``moejax.balance.capacity.expert_capacity``.

:func:`permute` gathers rows ``xs[r] = x[src_token[r]]`` and
:func:`unpermute` computes ``y[t] = sum_k w[t, k] * ys[dst[t, k]]``. Both have
custom VJPs in which every backward pass is again a *gather* through the
inverse map (src <-> dst), never a scatter-add: with each row fed by at most
one slot, the transpose of a gather by ``src`` is a gather by ``dst``
followed by a sum over K. The row gather itself has backends: ``xla``
(``jnp.take``), ``pallas_tpu`` and ``pallas_gpu`` (Pallas kernels in
:mod:`moejax.execution.pallas_gather`, interpretable on CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from moejax.execution import scopes
from moejax.execution.registry import GATHER_BACKENDS


@struct.dataclass
class Dispatch:
  """Where every token copy goes and where every row comes from.

  Attributes:
    src_token: int32[R] token feeding row r; T (out of range) for empty rows.
    src_slot: int32[R] flat slot t * K + k feeding row r; M for empty rows.
    dst: int32[T, K] row of slot (t, k); R (out of range) when the slot is
      not dispatched (invalid, zero-computation expert, or dropped).
    group_sizes: int32[E] rows per expert (dropless: contiguous groups;
      capacity: filled rows at the front of each expert's C rows).
  """

  src_token: jax.Array
  src_slot: jax.Array
  dst: jax.Array
  group_sizes: jax.Array

  @property
  def num_rows(self) -> int:
    return self.src_token.shape[0]

  def dispatched(self) -> jax.Array:
    """bool[T, K]: the slot has a row (not dropped, not excluded)."""
    return self.dst < self.num_rows


def _routed(expert_ids: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
  return valid & (expert_ids >= 0) & (expert_ids < num_experts)


def _check_routing(expert_ids, valid, num_experts: int) -> None:
  if expert_ids.ndim != 2 or valid.shape != expert_ids.shape:
    raise ValueError(f"expert_ids {expert_ids.shape} and valid {valid.shape} must both "
                     "be [T, K]; pass RoutingResult.expert_ids and .valid")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"expert_ids dtype {expert_ids.dtype} must be integer (int32)")
  if num_experts <= 0:
    raise ValueError(f"num_experts={num_experts} must be > 0 (the FFN experts)")


def stable_order(key: jax.Array, bound: int) -> jax.Array:
  """int32[M]: the indices that sort ``key`` (int32[M], values in [0, bound)) stably.

  Equal to ``jnp.argsort(key, stable=True)``. Packing (key, index) into one
  int32 and sorting that single operand avoids the two-operand sort, whose
  comparator XLA:CPU calls per comparison: several times faster at the
  routing's sizes, and no slower elsewhere. Falls back to argsort when the
  packed key would overflow int32.
  """
  m = key.shape[0]
  if bound * m >= 2**31:
    return jnp.argsort(key, stable=True).astype(jnp.int32)
  packed = key.astype(jnp.int32) * m + jnp.arange(m, dtype=jnp.int32)
  return jax.lax.rem(jnp.sort(packed), jnp.int32(m))


@jax.named_scope(scopes.DISPATCH)
def sort_by_expert(expert_ids: jax.Array, valid: jax.Array,
                   num_experts: int) -> Dispatch:
  """Dropless layout: R = M rows sorted by expert, zero rows at the end.

  Args:
    expert_ids: int32[T, K]; ids >= num_experts are zero-computation experts.
    valid: bool[T, K].
    num_experts: E, the FFN experts that get rows.
  """
  _check_routing(expert_ids, valid, num_experts)
  t, k = expert_ids.shape
  m = t * k
  key = jnp.where(_routed(expert_ids, valid, num_experts), expert_ids,
                  num_experts).reshape(-1).astype(jnp.int32)
  order = stable_order(key, num_experts + 1)
  counts = jnp.bincount(key, length=num_experts + 1).astype(jnp.int32)
  rows = jnp.arange(m, dtype=jnp.int32)
  used = rows < m - counts[num_experts]
  dst = jnp.zeros((m,), jnp.int32).at[order].set(rows)
  dst = jnp.where(key < num_experts, dst, m).reshape(t, k)
  return Dispatch(src_token=jnp.where(used, order // k, t).astype(jnp.int32),
                  src_slot=jnp.where(used, order, m).astype(jnp.int32),
                  dst=dst, group_sizes=counts[:num_experts])


@jax.named_scope(scopes.DISPATCH)
def capacity_layout(expert_ids: jax.Array, valid: jax.Array, num_experts: int,
                    capacity: int) -> Dispatch:
  """[E, C] buffer layout (R = E * C) with the slot-major drop rule.

  Row e * C + p holds the p-th copy routed to expert e in priority order
  (k-major, then token); copies ranked >= C are dropped (``dst`` = R).
  """
  _check_routing(expert_ids, valid, num_experts)
  if capacity < 0:
    raise ValueError(f"capacity={capacity} must be >= 0 rows per expert")
  t, k = expert_ids.shape
  m, r = t * k, num_experts * capacity
  routed = _routed(expert_ids, valid, num_experts)
  key = jnp.where(routed, expert_ids, num_experts).astype(jnp.int32)
  key_sm = key.T.reshape(-1)  # slot-major priority: index k * T + t
  order = stable_order(key_sm, num_experts + 1)
  counts = jnp.bincount(key_sm, length=num_experts + 1).astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  rank = jnp.arange(m, dtype=jnp.int32) - starts[key_sm[order]]
  pos = jnp.zeros((m,), jnp.int32).at[order].set(rank).reshape(k, t).T
  kept = routed & (pos < capacity)
  dst = jnp.where(kept, key * capacity + pos, r).astype(jnp.int32)
  tok = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, k))
  slot = jnp.arange(m, dtype=jnp.int32).reshape(t, k)
  src_token = jnp.full((r,), t, jnp.int32).at[dst.reshape(-1)].set(
      tok.reshape(-1), mode="drop")
  src_slot = jnp.full((r,), m, jnp.int32).at[dst.reshape(-1)].set(
      slot.reshape(-1), mode="drop")
  return Dispatch(src_token=src_token, src_slot=src_slot, dst=dst,
                  group_sizes=jnp.minimum(counts[:num_experts], capacity))


# --- Row gathers with fill, by backend. -------------------------------------

@dataclasses.dataclass(frozen=True)
class RowGather:
  """One implementation of :func:`gather_rows`, asked for what it needs.

  Attributes:
    name: the ``backend=`` name (one of ``registry.GATHER_BACKENDS``).
    gather: (x[T, d], idx int32[R], interpret) -> [R, d], zero rows where
      idx is out of range.
    platform: the ``jax.default_backend()`` it compiles for natively; None
      runs everywhere. Elsewhere it needs ``interpret=True``.
    foldable: whether the expert kernels may replace this gather by their
      own row loads (``grouped_ffn.routed_ffn``'s fused and folded paths).
      Only ``xla``'s: it is the "no preference" default, while naming a
      Pallas gather asks for that kernel's separate pass (to measure it).
  """

  name: str
  gather: Callable[[jax.Array, jax.Array, bool], jax.Array]
  platform: Optional[str] = None
  foldable: bool = False


def _xla_gather(x, idx, interpret):
  del interpret
  return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def _pallas_tpu_gather(x, idx, interpret):
  from moejax.execution import pallas_gather  # Pallas only for the callers that pick it
  return pallas_gather.gather_rows(x, idx, interpret=interpret)


def _pallas_gpu_gather(x, idx, interpret):
  from moejax.execution import pallas_gather
  return pallas_gather.gather_rows_gpu(x, idx, interpret=interpret)


ROW_GATHERS = {g.name: g for g in (
    RowGather("xla", _xla_gather, foldable=True),
    RowGather("pallas_tpu", _pallas_tpu_gather, platform="tpu"),
    RowGather("pallas_gpu", _pallas_gpu_gather, platform="gpu"),
)}
assert tuple(ROW_GATHERS) == GATHER_BACKENDS, "registry.GATHER_BACKENDS lists these names"


def get_gather(backend: str, interpret: bool = False) -> RowGather:
  """The row gather ``backend``, checked to run here; ValueError naming the fix otherwise."""
  if backend not in ROW_GATHERS:
    raise ValueError(f"gather backend {backend!r} is unknown. Fix: use one of "
                     f"{', '.join(GATHER_BACKENDS)}")
  g = ROW_GATHERS[backend]
  if g.platform and jax.default_backend() != g.platform and not interpret:
    raise ValueError(f"gather backend {backend!r} needs a {g.platform.upper()}; this "
                     f"platform is {jax.default_backend()!r}. Fix: use backend='xla' or "
                     "pass interpret=True (slow, tests only)")
  return g


def gather_rows(x: jax.Array, idx: jax.Array, *, backend: str = "xla",
                interpret: bool = False) -> jax.Array:
  """out[i] = x[idx[i]] for 0 <= idx[i] < len(x), else zeros. [R, d]."""
  if backend not in ROW_GATHERS:
    get_gather(backend)  # raises, naming the valid ones
  return ROW_GATHERS[backend].gather(x, idx, interpret)


def _check_gather_backend(backend: str, interpret: bool) -> None:
  get_gather(backend, interpret)


def _permute_impl(x, src_token, dst, backend, interpret):
  return gather_rows(x, src_token, backend=backend, interpret=interpret)


def _permute_fwd(x, src_token, dst, backend, interpret):
  return _permute_impl(x, src_token, dst, backend, interpret), (src_token, dst)


def _permute_bwd(backend, interpret, res, g):
  src_token, dst = res
  t, k = dst.shape
  # dx[t] = sum_k g[dst[t, k]]: a gather through the inverse map.
  rows = gather_rows(g, dst.reshape(-1), backend=backend, interpret=interpret)
  dx = rows.reshape(t, k, -1).sum(axis=1, dtype=jnp.float32).astype(g.dtype)
  return dx, None, None


_permute_vjp = jax.custom_vjp(_permute_impl, nondiff_argnums=(3, 4))
_permute_vjp.defvjp(_permute_fwd, _permute_bwd)


@jax.named_scope(scopes.DISPATCH)
def permute(x: jax.Array, plan: Dispatch, *, backend: str = "xla",
            interpret: bool = False) -> jax.Array:
  """xs[R, d]: row r is x[src_token[r]]; empty rows are zero."""
  _check_gather_backend(backend, interpret)
  if x.ndim != 2 or x.shape[0] != plan.dst.shape[0]:
    raise ValueError(f"x {x.shape} must be [T={plan.dst.shape[0]}, d] to match the plan")
  return _permute_vjp(x, plan.src_token, plan.dst, backend, interpret)


def _unpermute_impl(ys, w, dst, src_token, src_slot, backend, interpret):
  t, k = dst.shape
  rows = gather_rows(ys, dst.reshape(-1), backend=backend, interpret=interpret)
  y = jnp.einsum("tkd,tk->td", rows.reshape(t, k, -1), w,
                 preferred_element_type=jnp.float32)
  return y.astype(ys.dtype)


def _unpermute_fwd(ys, w, dst, src_token, src_slot, backend, interpret):
  out = _unpermute_impl(ys, w, dst, src_token, src_slot, backend, interpret)
  return out, (ys, w, dst, src_token, src_slot)


def _unpermute_bwd(backend, interpret, res, dy):
  ys, w, dst, src_token, src_slot = res
  t, k = dst.shape
  # d_ys[r] = w[slot of r] * dy[token of r]: a gather by the forward map.
  w_rows = jnp.take(w.reshape(-1), src_slot, mode="fill", fill_value=0)
  dy_rows = gather_rows(dy, src_token, backend=backend, interpret=interpret)
  d_ys = (dy_rows * w_rows[:, None].astype(dy.dtype)).astype(ys.dtype)
  rows = gather_rows(ys, dst.reshape(-1), backend=backend, interpret=interpret)
  d_w = jnp.einsum("tkd,td->tk", rows.reshape(t, k, -1), dy.astype(ys.dtype),
                   preferred_element_type=jnp.float32).astype(w.dtype)
  return d_ys, d_w, None, None, None


_unpermute_vjp = jax.custom_vjp(_unpermute_impl, nondiff_argnums=(5, 6))
_unpermute_vjp.defvjp(_unpermute_fwd, _unpermute_bwd)


@jax.named_scope(scopes.COMBINE)
def unpermute(ys: jax.Array, plan: Dispatch, weights: jax.Array, *,
              backend: str = "xla", interpret: bool = False) -> jax.Array:
  """y[T, d] = sum_k weights[t, k] * ys[dst[t, k]] over dispatched slots.

  Undispatched slots (invalid, zero-computation, dropped) contribute 0 and
  get weight gradient 0 from here.
  """
  _check_gather_backend(backend, interpret)
  if ys.ndim != 2 or ys.shape[0] != plan.num_rows:
    raise ValueError(f"ys {ys.shape} must be [R={plan.num_rows}, d] to match the plan")
  if weights.shape != plan.dst.shape:
    raise ValueError(f"weights {weights.shape} must be [T, K]={plan.dst.shape}")
  return _unpermute_vjp(ys, weights, plan.dst, plan.src_token, plan.src_slot,
                        backend, interpret)
