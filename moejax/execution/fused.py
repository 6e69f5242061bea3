"""Fused routed-expert FFN for the ``blocked`` backend (portable XLA).

Legend: T tokens, d model width, K slots per token, E FFN experts, f expert
hidden width, M = T * K token copies, tm row tile, n_e rows of expert e.

Composing permute -> 3 grouped matmuls -> unpermute writes and re-reads
several [M, d] and [M, f] arrays; on a CPU that is memory-bound outside the
matmuls (M * d * 4 bytes = 128 MiB at T=8192, K=8, d=512) and it cost about
as much as two of the nine matmul passes of a forward+backward. Here the
tiles of the dropless layout (``permute.sort_by_expert``, tiles from
``tiling.expert_tiles``) are visited directly: each expert's n_e // tm full
tm-row tiles (no row masks) and its remainder in *one* tile of the next
static size (``tiling.remainder_sizes``). Per tile, with W1 = [W_gate |
W_up] (the stored ``w_gate_up`` of the expert: one [d, 2f] matmul instead of
two [d, f] ones, and no concatenation):

    forward:  x_t = x[tokens]            (gather from [T, d], which stays in cache)
              [a|b] = x_t W1, h = silu(a) * b, y_t = h W_down
              y[tokens] += w * y_t       (scatter-add into [T, d])
    backward: dh' = dy[tokens] W_down^T; dw = <h, dh'>; dh = w * dh'
              dW_down += h^T (w dy); d[a|b] from dh; dW1 += x_t^T d[a|b]
              dx[tokens] += d[a|b] W1^T

so the only [M, *] traffic is saving [a|b] ([M, 2f]) for the backward pass
(an undifferentiated forward does not save it); the backward does the
matmuls a dense FFN backward does, no recomputation.

Per-tile and per-expert costs, not per-row cost, are what the loop structure
is chosen for (the profile benchmark suite, ``bench --suite=profile``, splits
them by kind of instruction):

* Remainder tiles run first, one ``fori_loop`` per size class over exactly
  the experts of that class (``ExpertTiles.by_class``): a size class costs
  compile time, not run time, so a few fine sizes near the balanced group
  size cut the padding (E=512 at T=8192: 128 +- 11 rows per expert, 23%
  padding with 64-row steps, ~6% with the fine sizes).
* An expert's remainder tile *sets* its gradient slices (no accumulator to
  zero-fill and add); its full tiles then run in one loop per expert
  (weights sliced once), accumulate in the loop carry and add one sum.
* The gate|up gradient of an expert is its [d, 2f] accumulator, written
  once into the [E, d, 2f] gradient of ``w_gate_up`` (the layout of the
  weight, so nothing is split or concatenated per expert).

Rows of a remainder tile that belong to another expert gather token T (out
of range, filled with zeros), so they add nothing and scatter nowhere. GELU
experts use W1 = W_up and save a only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moejax.execution import tiling
from moejax.topology import experts as experts_lib


def _gather(a, idx):
  return jnp.take(a, idx, axis=0, mode="fill", fill_value=0)


def _dot(a, b, contract):
  return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


_NN, _NT, _TN = ((1,), (0,)), ((1,), (1,)), ((0,), (0,))


def _act_fwd(activation, a, b):
  if activation == "swiglu":
    return jax.nn.silu(a) * b
  return jax.nn.gelu(a)


def _keys(activation):
  """(first-layer key, 'w_down'): 'w_gate_up' [E, d, 2f] (F1 = 2f) or 'w_up' [E, d, f]."""
  return experts_lib.FIRST_LAYER[activation], "w_down"


def _expert_weights(params, activation, g):
  """(W1 [d, F1], W_down [f, d]) of expert g: slices of the stored stacks.

  One [tm, d] x [d, 2f] matmul instead of two [d, f] ones: at fine expert
  widths (f = 256) the wider product runs measurably closer to peak on CPU.
  """
  return tuple(lax.dynamic_index_in_dim(params[k], g, keepdims=False)
               for k in _keys(activation))


def _rows(a, r0, size):
  return lax.dynamic_slice_in_dim(a, r0, size, 0)


def _masked(keep, v, fill):
  """v where the tile owns the row, else fill; full tiles (keep None) own all."""
  return v if keep is None else jnp.where(keep.reshape((-1,) + (1,) * (v.ndim - 1)), v, fill)


def _put(buf, r0, val, keep):
  """buf[r0:r0+size] = val on the rows the tile owns (in place on a loop carry)."""
  val = val.astype(buf.dtype)
  if keep is not None:
    val = _masked(keep, val, _rows(buf, r0, val.shape[0]))
  return lax.dynamic_update_slice_in_dim(buf, val, r0, 0)


def _remainder_loops(tiles, tile, carry):
  """carry after every group's remainder tile: one loop per size class, over
  exactly the groups of that class (``tile(g, size, r0, keep, carry)``).

  The bounds come from an array and the body indexes the group through the
  induction variable: XLA can neither prove a trip count <= 1 (it would turn
  the loop into a select over the whole carry) nor hoist the body out of
  the loop (every class would run for every group).
  """
  for c, size in enumerate(tiles.sizes):
    def rest(i, carry, size=size):
      g = tiles.by_class[i]
      r0, keep = tiles.rest_tile(g, size)
      return tile(g, size, r0, keep, carry)

    carry = lax.fori_loop(tiles.class_start[c], tiles.class_start[c + 1], rest, carry)
  return carry


def _full_loops(tiles, expert, carry):
  """carry after ``expert(g, carry)`` for each group with full tiles."""
  return lax.fori_loop(0, tiles.num_with_full,
                       lambda j, carry: expert(tiles.with_full[j], carry), carry)


def _forward(activation, tm, ts, fine, params, x, w_rows, src_token, group_sizes,
             save=True):
  """(y [T, d], the pre-activations [M, F1] for the backward, or None without ``save``).

  A forward that is not differentiated (``_ffn``'s primal: inference,
  evaluation) does not write the [M, F1] pre-activations: at T=8192, K=8,
  f=256 that is 128 MiB of freshly allocated memory per call, which the
  operating system must fault in and zero before the first write.
  """
  t, d = x.shape
  m = src_token.shape[0]
  f = experts_lib.hidden_width(params)
  gated = activation == "swiglu"
  tiles = tiling.expert_tiles(group_sizes, m, tm, ts, fine)
  weights = functools.partial(_expert_weights, params, activation)

  def tile(w, size, r0, keep, carry):
    (w1, wd), (y, pre) = w, carry
    tok = _masked(keep, _rows(src_token, r0, size), t)
    ab = _dot(_gather(x, tok), w1, _NN)  # pre-activations [a | b]
    h = (_act_fwd(activation, ab[:, :f], ab[:, f:]) if gated
         else _act_fwd(activation, ab, None)).astype(x.dtype)
    wt = _masked(keep, _rows(w_rows, r0, size), 0)
    y = y.at[tok].add(_dot(h, wd, _NN) * wt[:, None], mode="drop")
    return y, (None if pre is None else _put(pre, r0, ab, keep))

  def expert(g, carry):  # weights sliced once for all of g's full tiles
    w = weights(g)
    return lax.fori_loop(0, tiles.full[g],
                         lambda i, c: tile(w, tm, tiles.starts[g] + i * tm, None, c), carry)

  carry = (jnp.zeros((t, d), jnp.float32),
           jnp.zeros((m, 2 * f if gated else f), x.dtype) if save else None)
  carry = _remainder_loops(tiles, lambda g, *a: tile(weights(g), *a), carry)
  y, pre = _full_loops(tiles, expert, carry)
  return y.astype(x.dtype), pre


def _tile_backward(activation, x, dy, w_rows, src_token, pre, w, size, r0, keep, carry):
  """One tile's backward: (dx, dw_rows) updated, (dW1_t [d, F1], dWd_t [f, d])."""
  (w1, wd), (dx, dw_rows) = w, carry
  t = x.shape[0]
  f = wd.shape[0]
  tok = _masked(keep, _rows(src_token, r0, size), t)
  xt = _gather(x, tok)
  dyt = _gather(dy, tok)
  wt = _masked(keep, _rows(w_rows, r0, size), 0)
  ab = _rows(pre, r0, size).astype(jnp.float32)
  dh_u = _dot(dyt, wd, _NT)  # [size, f] = dy Wd^T, before the gate weight
  if activation == "swiglu":
    a, b = ab[:, :f], ab[:, f:]
    sig = jax.nn.sigmoid(a)
    silu = a * sig
    h = silu * b
  else:
    h, gelu_vjp = jax.vjp(jax.nn.gelu, ab)
  # <y_t, dy> = <h Wd, dy> = <h, dy Wd^T>: the gate-weight gradient
  # without recomputing y_t.
  dw_rows = _put(dw_rows, r0, jnp.sum(h * dh_u, axis=1), keep)  # _put keeps foreign rows
  dh = dh_u * wt[:, None]
  dwd = _dot(h.astype(x.dtype), (dyt * wt[:, None]).astype(x.dtype), _TN)
  if activation == "swiglu":
    dab = jnp.concatenate([dh * b * sig * (1 + a * (1 - sig)), dh * silu], axis=1)
  else:
    dab = gelu_vjp(dh)[0]
  dab = dab.astype(x.dtype)
  dx = dx.at[tok].add(_dot(dab, w1, _NT), mode="drop")
  return (dx, dw_rows), (_dot(xt, dab, _TN), dwd)


def _write_grads(grads, g, acc, add):
  """grads (W1, w_down) [E, ...] f32 with expert g's accumulator (dW1 [d, F1],
  dWd [f, d]) written (``add``: added) at g."""
  def put(gg, p):
    if add:
      p = lax.dynamic_index_in_dim(gg, g, keepdims=False) + p
    return lax.dynamic_update_index_in_dim(gg, p, g, 0)

  return tuple(put(gg, p) for gg, p in zip(grads, acc))


def _backward(activation, tm, ts, fine, params, x, w_rows, src_token, group_sizes, pre, dy):
  t, d = x.shape
  m = src_token.shape[0]
  tiles = tiling.expert_tiles(group_sizes, m, tm, ts, fine)
  weights = functools.partial(_expert_weights, params, activation)
  dy = dy.astype(x.dtype)
  names = _keys(activation)
  tile = functools.partial(_tile_backward, activation, x, dy, w_rows, src_token, pre)

  # An expert's remainder tile runs first and *sets* its gradient (no
  # accumulator to zero-fill and add); its full tiles then add one sum.
  def rest(g, size, r0, keep, carry):
    rows, grads = carry
    rows, acc = tile(weights(g), size, r0, keep, rows)
    return rows, _write_grads(grads, g, acc, add=False)

  def expert(g, carry):
    rows, grads = carry
    w = weights(g)
    rows, acc = tile(w, tm, tiles.starts[g], None, rows)

    def more(i, ca):
      rows, acc_t = tile(w, tm, tiles.starts[g] + i * tm, None, ca[0])
      return rows, jax.tree.map(jnp.add, ca[1], acc_t)

    rows, acc = lax.fori_loop(1, tiles.full[g], more, (rows, acc))
    return rows, _write_grads(grads, g, acc, add=True)

  carry = ((jnp.zeros((t, d), jnp.float32), jnp.zeros((m,), jnp.float32)),
           tuple(jnp.zeros(params[n].shape, jnp.float32) for n in names))
  carry = _remainder_loops(tiles, rest, carry)
  (dx, dw_rows), grads = _full_loops(tiles, expert, carry)
  grads = {n: gg.astype(params[n].dtype) for n, gg in zip(names, grads)}
  return grads, dx.astype(x.dtype), dw_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ffn(activation, tm, ts, fine, params, x, weights, src_token, src_slot, dst, group_sizes):
  w_rows = jnp.take(weights.reshape(-1), src_slot, mode="fill", fill_value=0)
  return _forward(activation, tm, ts, fine, params, x, w_rows, src_token, group_sizes,
                  save=False)[0]


def _ffn_fwd(activation, tm, ts, fine, params, x, weights, src_token, src_slot, dst, group_sizes):
  w_rows = jnp.take(weights.reshape(-1), src_slot, mode="fill", fill_value=0)
  y, pre = _forward(activation, tm, ts, fine, params, x, w_rows, src_token, group_sizes)
  return y, (params, x, weights, w_rows, src_token, src_slot, dst, group_sizes, pre)


def _ffn_bwd(activation, tm, ts, fine, res, dy):
  params, x, weights, w_rows, src_token, src_slot, dst, group_sizes, pre = res
  grads, dx, dw_rows = _backward(activation, tm, ts, fine, params, x, w_rows, src_token,
                                 group_sizes, pre, dy)
  # Slot (t, k) reads the weight gradient of its row: a gather by dst.
  d_weights = jnp.take(dw_rows, dst.reshape(-1), mode="fill", fill_value=0)
  return (grads, dx, d_weights.reshape(weights.shape).astype(weights.dtype),
          None, None, None, None)


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def blocked_ffn(params, x, weights, plan, *, activation: str,
                tile_m: int | None = None, tile_small: int | None = None,
                tile_fine: int | None = None) -> jax.Array:
  """y[T, d] = sum_k weights[t, k] FFN_{expert}(x[t]) over dispatched slots.

  ``plan`` is a dropless :class:`moejax.execution.permute.Dispatch`;
  ``params`` holds the expert weights for ``activation`` (width mask already
  folded into ``w_down`` by the caller). ``tile_m`` is the full row tile,
  ``tile_small`` the grain of the one remainder tile per expert (defaults
  from the balanced group size: ``tiling.fused_tiles``), ``tile_fine`` the step
  of the extra remainder sizes near the balanced group size
  (``tiling.remainder_sizes``; default ``FUSED_TILE_FINE``, 0 for none).
  """
  tm, ts = tiling.fused_tiles(plan.num_rows, plan.group_sizes.shape[0], tile_m, tile_small)
  params = {k: params[k] for k in _keys(activation)}
  fine = tiling.FUSED_TILE_FINE if tile_fine is None else int(tile_fine)
  return _ffn(activation, tm, ts, fine, params, x, weights, plan.src_token, plan.src_slot,
              plan.dst, plan.group_sizes)
