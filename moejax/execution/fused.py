"""Fused routed-expert FFN for the ``blocked`` backend (portable XLA).

Legend: T tokens, d model width, K slots per token, E FFN experts, f expert
hidden width, M = T * K token copies, tm row tile.

Composing permute -> 3 grouped matmuls -> unpermute writes and re-reads
several [M, d] and [M, f] arrays; on a CPU that is memory-bound outside the
matmuls (M * d * 4 bytes = 128 MiB at T=8192, K=8, d=512) and it cost about
as much as two of the nine matmul passes of a forward+backward. Here one
loop visits the experts and, inside an expert, its tm-row tiles of the
dropless layout (``permute.sort_by_expert``). Per tile:

    forward:  x_t = x[tokens]            (gather from [T, d], which stays in cache)
              a = x_t Wg, b = x_t Wu, h = silu(a) * b, y_t = h Wd
              y[tokens] += w * y_t       (scatter-add into [T, d])
    backward: dh' = dy[tokens] Wd^T; dw = <h, dh'>; dh = w * dh'
              dWd += h^T (w dy); dWg += x_t^T da; dWu += x_t^T db
              dx[tokens] += da Wg^T + db Wu^T

so the only [M, *] traffic is saving a and b ([M, f]) for the backward pass;
the backward does the 6 matmuls a dense FFN backward does, no recomputation.
Weight gradients accumulate in per-expert registers of the inner loop (hot in
cache) and are written once per expert. Rows of a tile that belong to another
expert gather token T (out of range, filled with zeros), so they add nothing
and scatter nowhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moejax.execution import tiling

DEFAULT_TILE_M = 128


def _gather(a, idx):
  return jnp.take(a, idx, axis=0, mode="fill", fill_value=0)


def _dot(a, b, contract):
  return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


_NN, _NT, _TN = ((1,), (0,)), ((1,), (1,)), ((0,), (0,))


def _act_fwd(activation, a, b):
  if activation == "swiglu":
    return jax.nn.silu(a) * b
  return jax.nn.gelu(a)


class _Tiles:
  """Per-expert row tiles of the dropless layout."""

  def __init__(self, src_token, group_sizes, num_tokens, tm):
    self.m = src_token.shape[0]
    self.tm = tm
    self.src_token = src_token
    self.num_tokens = num_tokens
    self.starts, self.ends = tiling.group_bounds(group_sizes)
    self.counts = (group_sizes + tm - 1) // tm
    self.offsets = jnp.arange(tm, dtype=jnp.int32)

  def tile(self, g, j):
    """(first row, row mask, token per row with T where masked)."""
    lo = self.starts[g] + j * self.tm
    # The operand's last tile is clamped inside it and re-reads rows of the
    # previous tile: own only [lo, end) so nothing is counted twice.
    r0 = jnp.minimum(lo, self.m - self.tm)
    rows = r0 + self.offsets
    keep = (rows >= lo) & (rows < self.ends[g])
    tok = jnp.where(keep, lax.dynamic_slice(self.src_token, (r0,), (self.tm,)),
                    self.num_tokens)
    return r0, keep, tok


def _merge_rows(buf, r0, keep, val):
  old = lax.dynamic_slice(buf, (r0, 0), val.shape)
  return lax.dynamic_update_slice(buf, jnp.where(keep[:, None], val.astype(buf.dtype), old),
                                  (r0, 0))


def _forward(activation, tm, params, x, w_rows, src_token, group_sizes):
  t, d = x.shape
  m = src_token.shape[0]
  f = params["w_up"].shape[2]
  tiles = _Tiles(src_token, group_sizes, t, tm)
  gated = activation == "swiglu"
  zeros_mf = jnp.zeros((m, f), x.dtype)

  def group(g, carry):
    wu = lax.dynamic_index_in_dim(params["w_up"], g, keepdims=False)
    wd = lax.dynamic_index_in_dim(params["w_down"], g, keepdims=False)
    wg = lax.dynamic_index_in_dim(params["w_gate"], g, keepdims=False) if gated else None

    def tile(j, carry):
      y, sa, sb = carry
      r0, keep, tok = tiles.tile(g, j)
      xt = _gather(x, tok)
      a = _dot(xt, wg if gated else wu, _NN)
      b = _dot(xt, wu, _NN) if gated else a
      h = _act_fwd(activation, a, b).astype(x.dtype)
      yt = _dot(h, wd, _NN)
      wt = jnp.where(keep, lax.dynamic_slice(w_rows, (r0,), (tm,)), 0)
      y = y.at[tok].add(yt * wt[:, None], mode="drop")
      sa = _merge_rows(sa, r0, keep, a)
      if gated:
        sb = _merge_rows(sb, r0, keep, b)
      return y, sa, sb

    return lax.fori_loop(0, tiles.counts[g], tile, carry)

  init = (jnp.zeros((t, d), jnp.float32), zeros_mf, zeros_mf if gated else zeros_mf[:, :0])
  y, sa, sb = lax.fori_loop(0, group_sizes.shape[0], group, init)
  return y.astype(x.dtype), (sa, sb)


def _backward(activation, tm, params, x, w_rows, src_token, group_sizes, sa, sb, dy):
  t, d = x.shape
  m = src_token.shape[0]
  tiles = _Tiles(src_token, group_sizes, t, tm)
  gated = activation == "swiglu"
  dy = dy.astype(x.dtype)

  def group(g, carry):
    dx, dw_rows, grads = carry
    wu = lax.dynamic_index_in_dim(params["w_up"], g, keepdims=False)
    wd = lax.dynamic_index_in_dim(params["w_down"], g, keepdims=False)
    wg = lax.dynamic_index_in_dim(params["w_gate"], g, keepdims=False) if gated else None
    acc0 = {k: jnp.zeros(v.shape[1:], jnp.float32) for k, v in params.items()}

    def tile(j, inner):
      dx, dw_rows, acc = inner
      r0, keep, tok = tiles.tile(g, j)
      xt = _gather(x, tok)
      dyt = _gather(dy, tok)
      wt = jnp.where(keep, lax.dynamic_slice(w_rows, (r0,), (tm,)), 0)
      a = lax.dynamic_slice(sa, (r0, 0), (tm, sa.shape[1])).astype(jnp.float32)
      dh_u = _dot(dyt, wd, _NT)  # [tm, f] = dy Wd^T, before the gate weight
      if gated:
        b = lax.dynamic_slice(sb, (r0, 0), (tm, sb.shape[1])).astype(jnp.float32)
        sig = jax.nn.sigmoid(a)
        silu = a * sig
        h = silu * b
      else:
        h, gelu_vjp = jax.vjp(jax.nn.gelu, a)
      # <y_t, dy> = <h Wd, dy> = <h, dy Wd^T>: the gate-weight gradient
      # without recomputing y_t.
      dw_t = jnp.where(keep, jnp.sum(h * dh_u, axis=1), 0)
      dw_rows = lax.dynamic_update_slice(
          dw_rows, jnp.where(keep, dw_t, lax.dynamic_slice(dw_rows, (r0,), (tm,))), (r0,))
      dh = dh_u * wt[:, None]
      hx = h.astype(x.dtype)
      acc = dict(acc)
      acc["w_down"] = acc["w_down"] + _dot(hx, (dyt * wt[:, None]).astype(x.dtype), _TN)
      if gated:
        da = (dh * b * sig * (1 + a * (1 - sig))).astype(x.dtype)
        db = (dh * silu).astype(x.dtype)
        acc["w_gate"] = acc["w_gate"] + _dot(xt, da, _TN)
        acc["w_up"] = acc["w_up"] + _dot(xt, db, _TN)
        dxt = _dot(da, wg, _NT) + _dot(db, wu, _NT)
      else:
        da = gelu_vjp(dh)[0].astype(x.dtype)
        acc["w_up"] = acc["w_up"] + _dot(xt, da, _TN)
        dxt = _dot(da, wu, _NT)
      dx = dx.at[tok].add(dxt, mode="drop")
      return dx, dw_rows, acc

    dx, dw_rows, acc = lax.fori_loop(0, tiles.counts[g], tile, (dx, dw_rows, acc0))
    grads = {k: lax.dynamic_update_index_in_dim(grads[k], acc[k].astype(grads[k].dtype), g, 0)
             for k in grads}
    return dx, dw_rows, grads

  init = (jnp.zeros((t, d), jnp.float32), jnp.zeros((m,), jnp.float32),
          {k: jnp.zeros_like(v) for k, v in params.items()})
  dx, dw_rows, grads = lax.fori_loop(0, group_sizes.shape[0], group, init)
  return grads, dx.astype(x.dtype), dw_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ffn(activation, tm, params, x, weights, src_token, src_slot, dst, group_sizes):
  w_rows = jnp.take(weights.reshape(-1), src_slot, mode="fill", fill_value=0)
  return _forward(activation, tm, params, x, w_rows, src_token, group_sizes)[0]


def _ffn_fwd(activation, tm, params, x, weights, src_token, src_slot, dst, group_sizes):
  w_rows = jnp.take(weights.reshape(-1), src_slot, mode="fill", fill_value=0)
  y, (sa, sb) = _forward(activation, tm, params, x, w_rows, src_token, group_sizes)
  return y, (params, x, weights, w_rows, src_token, src_slot, dst, group_sizes, sa, sb)


def _ffn_bwd(activation, tm, res, dy):
  params, x, weights, w_rows, src_token, src_slot, dst, group_sizes, sa, sb = res
  grads, dx, dw_rows = _backward(activation, tm, params, x, w_rows, src_token,
                                 group_sizes, sa, sb, dy)
  # Slot (t, k) reads the weight gradient of its row: a gather by dst.
  d_weights = jnp.take(dw_rows, dst.reshape(-1), mode="fill", fill_value=0)
  return (grads, dx, d_weights.reshape(weights.shape).astype(weights.dtype),
          None, None, None, None)


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def blocked_ffn(params, x, weights, plan, *, activation: str,
                tile_m: int = DEFAULT_TILE_M) -> jax.Array:
  """y[T, d] = sum_k weights[t, k] FFN_{expert}(x[t]) over dispatched slots.

  ``plan`` is a dropless :class:`moejax.execution.permute.Dispatch`;
  ``params`` holds the expert weights for ``activation`` (width mask already
  folded into ``w_down`` by the caller).
  """
  m = plan.num_rows
  tm = max(1, min(int(tile_m), m))
  keys = ("w_gate", "w_up", "w_down") if activation == "swiglu" else ("w_up", "w_down")
  params = {k: params[k] for k in keys}
  return _ffn(activation, tm, params, x, weights, plan.src_token, plan.src_slot,
              plan.dst, plan.group_sizes)
