"""``whole_group``: one large matmul per expert over all of its rows.

Legend: T tokens, d model width, K slots per token, E FFN experts (G groups
of a grouped matmul), f expert hidden width, M = T * K token copies (m rows
of a grouped matmul), C rows per expert of a capacity bucket.

The per-expert loops of the peers (Hugging Face's Mixtral block, for one)
gather each expert's rows and run *one* matmul per weight over them.
XLA needs static shapes, so here the rows of the dropless sorted layout
(``permute.sort_by_expert``) are laid out as [E, C] slots, row c of expert
e being the c-th row of its group, with C the smallest of a few *capacity
buckets* that holds the largest group. One batched matmul per weight then
covers every expert: no loop, no per-expert weight slice, no loop carry.
Slots past a group's rows gather zeros, so they add nothing.

The buckets are multiples of the balanced group size m / G
(:data:`BUCKET_FACTORS`). When the largest group fits none of them (skewed
routing), the call runs the tiled ``blocked`` path instead, inside the same
compiled program: a ``lax.switch`` on the bucket index. So the path is
dropless and exact for every routing, and its memory is bounded by the
largest bucket.

Why a switch and not one static C: a bucket that always fits is C = m (E
times the work). Why it pays: the tiled loops pay per tile and per expert
(weight slices, loop carries, gradient writes); a bucket pays for its
padded slots instead, so it wins where groups are large and balanced
(few experts, many tokens per expert) and loses where the padding of a
bucket is a large share of a small group. ``auto`` picks between the two by
shape (:mod:`moejax.execution.shape_choice`).

The FFN keeps the residuals of the tiled path (the pre-activations [a|b] in
the sorted [M, F1] layout), so the backward pass may run the other branch's
code without the forward's choice mattering. Every map between the layouts
is a gather (no scatter-add).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from moejax.execution import blocked as blocked_lib
from moejax.execution import fused as fused_lib
from moejax.execution import gmm as gmm_lib
from moejax.execution import tiling
from moejax.topology import experts as experts_lib

# Capacity buckets as multiples of the balanced group size m / G: a call
# runs the smallest that holds its largest group, else the tiled path.
# More buckets waste fewer padded rows and compile one more branch each.
BUCKET_FACTORS = (1.03125, 1.0625, 1.125, 1.25, 1.5)
# Bucket rows are rounded up to this grain (a matmul's row blocking).
BUCKET_GRAIN = 8


def bucket_sizes(m: int, num_groups: int, factors=None) -> tuple[int, ...]:
  """The static capacities C (ascending, at most m) for m rows in num_groups groups."""
  factors = BUCKET_FACTORS if factors is None else tuple(factors)
  if not factors or min(factors) <= 0:
    raise ValueError(f"bucket_factors={factors} must be positive multiples of the balanced "
                     "group size. Fix: e.g. (1.125, 1.5)")
  mean = m / max(num_groups, 1)
  sizes = {min(m, tiling.cdiv(max(1, math.ceil(mean * f)), BUCKET_GRAIN) * BUCKET_GRAIN)
           for f in factors}
  return tuple(sorted(s for s in sizes if s > 0))


def bucket_index(group_sizes: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
  """int32[]: the first bucket holding the largest group; len(sizes) when none does."""
  biggest = jnp.max(group_sizes, initial=0)
  return jnp.sum(jnp.asarray(sizes, jnp.int32) < biggest).astype(jnp.int32)


class _Slots:
  """The maps between the sorted layout (m rows) and [G, C] slots, all gathers.

  row_of_slot int32[G*C]: the sorted row of slot (g, c), m when empty;
  slot_of_row int32[m]: the slot of sorted row r, G*C past the groups.
  """

  def __init__(self, group_sizes, m: int, capacity: int):
    g = group_sizes.shape[0]
    self.g, self.c, self.m = g, capacity, m
    starts, ends = tiling.group_bounds(group_sizes)
    j = jnp.arange(g * capacity, dtype=jnp.int32)
    grp, pos = j // capacity, j % capacity
    self.row_of_slot = jnp.where(pos < group_sizes[grp], starts[grp] + pos, m)
    r = jnp.arange(m, dtype=jnp.int32)
    rg = jnp.minimum(jnp.searchsorted(ends, r, side="right"), g - 1).astype(jnp.int32)
    self.slot_of_row = jnp.where(r < ends[-1], rg * capacity + r - starts[rg], g * capacity)

  def to_slots(self, a: jax.Array, rows=None) -> jax.Array:
    """[G, C, *]: a's sorted rows in slots (``rows``: through a row -> source map)."""
    idx = self.row_of_slot if rows is None else _take(rows, self.row_of_slot, a.shape[0])
    return _take(a, idx).reshape((self.g, self.c) + a.shape[1:])

  def to_rows(self, s: jax.Array) -> jax.Array:
    """[m, *]: slots [G, C, *] back in the sorted layout (rows past the groups: 0)."""
    return _take(s.reshape((self.g * self.c,) + s.shape[2:]), self.slot_of_row)


def _take(a, idx, fill=0):
  return jnp.take(a, idx, axis=0, mode="fill", fill_value=fill)


def _bdot(a, b, spec):
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _switch(group_sizes, sizes, bucket_fn, fallback, *operands):
  """bucket_fn(C, *operands) for the smallest bucket C holding every group, else fallback."""
  branches = [functools.partial(bucket_fn, c) for c in sizes] + [fallback]
  return lax.switch(bucket_index(group_sizes, sizes), branches, *operands)


# --- The grouped matmul (the gmm contract; ``blocked`` when no bucket fits). -

def whole_group_gmm(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False,
                    interpret=False, bucket_factors=None, tile_m=None, tile_small=None):
  """out[m, n] = lhs[rows_g] @ rhs[g] per group, one batched matmul over [G, C] slots."""
  del interpret
  m = lhs.shape[0]
  sizes = bucket_sizes(m, group_sizes.shape[0], bucket_factors)
  spec = "gck,gnk->gcn" if transpose_rhs else "gck,gkn->gcn"

  def bucket(c, lhs, rhs, group_sizes):
    s = _Slots(group_sizes, m, c)
    return s.to_rows(_bdot(s.to_slots(lhs), rhs, spec).astype(out_dtype))

  def fallback(lhs, rhs, group_sizes):
    return blocked_lib.blocked_gmm(lhs, rhs, group_sizes, out_dtype=out_dtype,
                                   transpose_rhs=transpose_rhs, tile_m=tile_m,
                                   tile_small=tile_small)

  if m == 0:
    return fallback(lhs, rhs, group_sizes)
  return _switch(group_sizes, sizes, bucket, fallback, lhs, rhs, group_sizes)


def whole_group_tgmm(lhs, grad, group_sizes, *, out_dtype, interpret=False,
                     bucket_factors=None, tile_m=None, tile_small=None):
  """out[G, k, n] = lhs[rows_g]^T @ grad[rows_g] per group (empty: 0)."""
  del interpret
  m = lhs.shape[0]
  sizes = bucket_sizes(m, group_sizes.shape[0], bucket_factors)

  def bucket(c, lhs, grad, group_sizes):
    s = _Slots(group_sizes, m, c)
    return _bdot(s.to_slots(lhs), s.to_slots(grad), "gck,gcn->gkn").astype(out_dtype)

  def fallback(lhs, grad, group_sizes):
    return blocked_lib.blocked_tgmm(lhs, grad, group_sizes, out_dtype=out_dtype,
                                    tile_m=tile_m, tile_small=tile_small)

  if m == 0:
    return fallback(lhs, grad, group_sizes)
  return _switch(group_sizes, sizes, bucket, fallback, lhs, grad, group_sizes)


# --- The routed FFN over [E, C] slots. ----------------------------------------
#
# The same math as fused.py's tile bodies, batched over the experts: W1 =
# the stored w_gate_up ([E, d, 2f]) or w_up, pre-activations [a|b] saved in the
# sorted [M, F1] layout (the tiled path's residual), the combine and dx as
# gathers of each token's K slots.


def _combine(s: _Slots, slot_rows, dst):
  """[T, d]: sum over each token's K slots of slot_rows [E, C, d] (undispatched: 0)."""
  t, k = dst.shape
  slot = _take(s.slot_of_row, dst.reshape(-1), s.g * s.c)
  rows = _take(slot_rows.reshape((s.g * s.c,) + slot_rows.shape[2:]), slot)
  return jnp.sum(rows.reshape((t, k) + rows.shape[1:]), axis=1)


def _bucket_forward(activation, c, params, x, w_rows, src_token, dst, group_sizes, save):
  """(y [T, d], pre [M, F1] or None) with every expert's rows in C slots."""
  m = src_token.shape[0]
  f = experts_lib.hidden_width(params)
  gated = activation == "swiglu"
  s = _Slots(group_sizes, m, c)
  xs = s.to_slots(x, src_token)  # [E, C, d]
  ab = _bdot(xs, params[fused_lib._keys(activation)[0]], "ecd,edf->ecf")
  h = fused_lib._act_fwd(activation, ab[..., :f], ab[..., f:]) if gated else (
      fused_lib._act_fwd(activation, ab, None))
  ws = s.to_slots(w_rows)  # [E, C] combine weights, 0 on empty slots
  ys = _bdot(h.astype(x.dtype), params["w_down"], "ecf,efd->ecd") * ws[..., None]
  y = _combine(s, ys, dst)
  return y.astype(x.dtype), (s.to_rows(ab.astype(x.dtype)) if save else None)


def _bucket_backward(activation, c, params, x, w_rows, src_token, dst, group_sizes, pre,
                     dy):
  """(grads, dx [T, d], dw_rows [M]): the tiled path's backward, batched over experts."""
  m = src_token.shape[0]
  f = experts_lib.hidden_width(params)
  gated = activation == "swiglu"
  s = _Slots(group_sizes, m, c)
  names = fused_lib._keys(activation)
  w1, wd = (params[n] for n in names)
  xs, dys = s.to_slots(x, src_token), s.to_slots(dy, src_token)
  ws = s.to_slots(w_rows)[..., None]
  ab = s.to_slots(pre).astype(jnp.float32)
  dh_u = _bdot(dys, wd, "ecd,efd->ecf")  # dy Wd^T, before the gate weight
  if gated:
    a, b = ab[..., :f], ab[..., f:]
    sig = jax.nn.sigmoid(a)
    silu = a * sig
    h = silu * b
  else:
    h, gelu_vjp = jax.vjp(jax.nn.gelu, ab)
  dw_rows = s.to_rows(jnp.sum(h * dh_u, axis=-1))  # <y_t, dy> without recomputing y_t
  dh = dh_u * ws
  dwd = _bdot(h.astype(x.dtype), (dys * ws).astype(x.dtype), "ecf,ecd->efd")
  if gated:
    dab = jnp.concatenate([dh * b * sig * (1 + a * (1 - sig)), dh * silu], axis=-1)
  else:
    dab = gelu_vjp(dh)[0]
  dab = dab.astype(x.dtype)
  dx = _combine(s, _bdot(dab, w1, "ecf,edf->ecd"), dst)
  dw1 = _bdot(xs, dab, "ecd,ecf->edf")
  grads = {n: p.astype(params[n].dtype) for n, p in zip(names, (dw1, dwd))}
  return grads, dx.astype(x.dtype), dw_rows


def _tiled_forward(activation, tiles, params, x, w_rows, src_token, dst, group_sizes, save):
  del dst
  return fused_lib._forward(activation, *tiles, params, x, w_rows, src_token, group_sizes,
                            save=save)


def _tiled_backward(activation, tiles, params, x, w_rows, src_token, dst, group_sizes, pre,
                    dy):
  del dst
  return fused_lib._backward(activation, *tiles, params, x, w_rows, src_token, group_sizes,
                             pre, dy)


def _forward(activation, sizes, tiles, params, x, w_rows, src_token, dst, group_sizes,
             save):
  bucket = functools.partial(_bucket_forward, activation)
  tiled = functools.partial(_tiled_forward, activation, tiles)
  fn = lambda c, *a: bucket(c, *a, save)
  return _switch(group_sizes, sizes, fn, lambda *a: tiled(*a, save),
                 params, x, w_rows, src_token, dst, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ffn(activation, sizes, tiles, params, x, weights, src_token, src_slot, dst,
         group_sizes):
  w_rows = _take(weights.reshape(-1), src_slot)
  return _forward(activation, sizes, tiles, params, x, w_rows, src_token, dst, group_sizes,
                  save=False)[0]


def _ffn_fwd(activation, sizes, tiles, params, x, weights, src_token, src_slot, dst,
             group_sizes):
  w_rows = _take(weights.reshape(-1), src_slot)
  y, pre = _forward(activation, sizes, tiles, params, x, w_rows, src_token, dst,
                    group_sizes, save=True)
  return y, (params, x, weights, w_rows, src_token, src_slot, dst, group_sizes, pre)


def _ffn_bwd(activation, sizes, tiles, res, dy):
  params, x, weights, w_rows, src_token, src_slot, dst, group_sizes, pre = res
  bucket = functools.partial(_bucket_backward, activation)
  tiled = functools.partial(_tiled_backward, activation, tiles)
  grads, dx, dw_rows = _switch(group_sizes, sizes, bucket, tiled, params, x, w_rows,
                               src_token, dst, group_sizes, pre, dy.astype(x.dtype))
  d_weights = _take(dw_rows, dst.reshape(-1))  # slot (t, k) reads its row's gradient
  return (grads, dx, d_weights.reshape(weights.shape).astype(weights.dtype),
          None, None, None, None)


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def whole_group_ffn(params, x, weights, plan, *, activation: str, bucket_factors=None,
                    tile_m: int | None = None, tile_small: int | None = None,
                    tile_fine: int | None = None) -> jax.Array:
  """y[T, d] = sum_k weights[t, k] FFN_{expert}(x[t]), one batched matmul per weight.

  ``plan`` is a dropless :class:`moejax.execution.permute.Dispatch`. The
  capacity buckets are ``bucket_factors`` (default :data:`BUCKET_FACTORS`)
  times the balanced group size; the tile options are those of the tiled
  path that runs when no bucket holds the largest group
  (:func:`moejax.execution.fused.blocked_ffn`).
  """
  m, e = plan.num_rows, plan.group_sizes.shape[0]
  params = {k: params[k] for k in fused_lib._keys(activation)}
  tm, ts = tiling.fused_tiles(m, e, tile_m, tile_small)
  fine = tiling.FUSED_TILE_FINE if tile_fine is None else int(tile_fine)
  return _ffn(activation, bucket_sizes(m, e, bucket_factors), (tm, ts, fine), params, x,
              weights, plan.src_token, plan.src_slot, plan.dst, plan.group_sizes)


BACKEND = gmm_lib.Backend(
    name="whole_group", gmm=whole_group_gmm, tgmm=whole_group_tgmm,
    needs="nothing (portable XLA)",
    # Named, or chosen by auto's shape rule on CPU (moejax.execution.shape_choice);
    # never auto's platform default.
    auto_on=(),
    fused_ffn=whole_group_ffn)

gmm_lib.register_backend(BACKEND)
