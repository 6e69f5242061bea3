"""Rotary causal self-attention (MHA, GQA and MQA through n_kv_heads), with a KV cache.

Legend: B batch, S sequence length (new tokens of a call), C cache slots, d
model width, N query heads, M key/value heads (M divides N), H head width.

Two calls, the same weights:

- ``attn(x, positions)``: the full-sequence causal attention of training and
  evaluation;
- ``attn.extend(x, positions, cache, index, write)``: the serving call. The S
  new tokens' keys and values are written into the cache at slots
  ``[index, index + S)`` and the new queries attend over the whole cache:
  a slot is visible to the query at slot ``index + i`` iff it is filled
  (``cache.valid``) and not later (``<= index + i``). Prefill is one call
  with S = prompt length, each decode step one call with S = 1.

The cache holds keys *after* the rotary embedding, so a cached key is never
rotated again; positions are explicit, so a left-padded prompt (pad slots
never marked valid) sees exactly the keys, at exactly the positions, of the
same prompt unpadded.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.topology import roles


class KVCache(NamedTuple):
  """One attention layer's cache.

  k, v: [B, C, M, H] keys (rotated) and values in the compute dtype.
  valid: bool[B, C], True on slots holding a token that later queries may
    attend to (False on padding, unwritten slots and tokens a
    mixture-of-depths block skipped).
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array

  @classmethod
  def zeros(cls, batch: int, capacity: int, n_kv_heads: int, head_dim: int,
            dtype=jnp.float32) -> "KVCache":
    shape = (batch, capacity, n_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.zeros((batch, capacity), bool))


def rope_angles(positions: jax.Array, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin f32[B, S, 1, H/2] for integer positions[B, S]."""
  freqs = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, S, H/2]
  return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotates x[B, S, N, H] by position (Su et al. 2104.09864).

  Half-split layout (GPT-NeoX / Llama in HF): feature i pairs with i + H/2.
  The rotation is done in float32; under bf16, angles of long positions lose
  too many bits.
  """
  h = x.shape[-1]
  cos, sin = rope_angles(positions, h, base)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with rotary position embeddings.

  ``positions`` are passed explicitly so a mixture-of-depths block, which
  sees a sorted subset of each sequence, rotates every token by its original
  position while the causal mask runs over the subset's order.
  """

  def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
               use_bias: bool = False, rope_base: float = 10000.0, qk_norm: bool = False,
               norm_eps: float = 1e-6, dtype=jnp.float32, rngs: nnx.Rngs):
    self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
    self.rope_base, self.qk_norm = rope_base, qk_norm
    lin = lambda i, o: nnx.Linear(i, o, use_bias=use_bias, dtype=dtype,
                                  param_dtype=jnp.float32, rngs=rngs)
    self.q_proj = lin(d_model, n_heads * head_dim)
    self.k_proj = lin(d_model, n_kv_heads * head_dim)
    self.v_proj = lin(d_model, n_kv_heads * head_dim)
    self.o_proj = lin(n_heads * head_dim, d_model)
    if qk_norm:
      # Qwen3's per-head RMSNorm of queries and keys (one scale [H] shared by the heads),
      # before the rotation: it bounds the logits without a softcap.
      norm = lambda: nnx.RMSNorm(head_dim, epsilon=norm_eps, dtype=dtype,
                                 param_dtype=jnp.float32, rngs=rngs)
      self.q_norm, self.k_norm = norm(), norm()

  def projections(self) -> tuple[str, ...]:
    """The names of the projection layers (what LoRA adapts), in a fixed order."""
    return ("q_proj", "k_proj", "v_proj", "o_proj")

  def param_roles(self) -> dict:
    """The four projections are hidden matrices [in, out]; their biases element-wise."""
    proj = {"kernel": roles.matrix("attention"), "bias": roles.elementwise("bias")}
    out = {name: proj for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    return {**out, "q_norm": roles.elementwise("norm"), "k_norm": roles.elementwise("norm")}

  def _qkv(self, x: jax.Array, positions: jax.Array):
    """q [B, S, N, H], k and v [B, S, M, H]; q and k normalised per head (qk_norm), then
    rotated by position."""
    b, s, _ = x.shape
    q = self.q_proj(x).reshape(b, s, self.n_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, s, self.n_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, s, self.n_kv_heads, self.head_dim)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return (apply_rope(q, positions, self.rope_base), apply_rope(k, positions, self.rope_base),
            v)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x[B, S, d], positions int[B, S] -> [B, S, d]."""
    b, s, _ = x.shape
    q, k, v = self._qkv(x, positions)
    # jax.nn.dot_product_attention repeats the M key/value heads over the N
    # query heads itself (GQA) and scales by 1/sqrt(H).
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, S, N, H]
    return self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim))

  def init_cache(self, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of C = ``capacity`` slots for this layer."""
    return KVCache.zeros(batch, capacity, self.n_kv_heads, self.head_dim, dtype)

  def extend(self, x: jax.Array, positions: jax.Array, cache: KVCache, index: jax.Array,
             write: jax.Array) -> tuple[jax.Array, KVCache]:
    """Appends S tokens to the cache and attends over it: (y[B, S, d], new cache).

    Args:
      x: [B, S, d] the new tokens (normalized block input).
      positions: int[B, S] their rotary positions.
      cache: this layer's :class:`KVCache` (C slots, C >= index + S).
      index: int32[] slot of the first new token (the same for every row:
        prompts are left-padded, so all rows advance together).
      write: bool[B, S] which new tokens become visible to later queries
        (False: padding, or a token a mixture-of-depths block skipped).

    A query attends to the filled slots up to its own; its own slot is
    always visible, so padding rows (whose outputs are discarded) never see
    an empty softmax.
    """
    b, s, _ = x.shape
    q, k, v = self._qkv(x, positions)
    c = cache.k.shape[1]
    k_all = jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), index, 1)
    v_all = jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), index, 1)
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, write.astype(bool), index, 1)
    slot = jnp.arange(c, dtype=jnp.int32)                 # [C]
    query_slot = index + jnp.arange(s, dtype=jnp.int32)   # [S]
    mask = (valid[:, None, :] & (slot[None, None, :] <= query_slot[None, :, None])) \
        | (slot[None, None, :] == query_slot[None, :, None])  # [B, S, C]
    out = jax.nn.dot_product_attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype),
                                       mask=mask[:, None])  # [B, S, N, H]
    y = self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim))
    return y, KVCache(k_all, v_all, valid)
