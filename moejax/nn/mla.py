"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1), with a latent cache.

Legend: B batch, S new tokens of a call, C cache slots, d model width, N
heads, r_kv KV latent width, r_q query latent width (0: no query
compression), h_n per-head content (no-position) width of queries and keys,
h_r rotary width, h_v per-head value width.

Keys and values are not projected from x per head. x is compressed into one
latent c_kv [r_kv] per token (``kv_a``, then an RMSNorm) and into one rotary
key k_r [h_r] shared by every head (the decoupled RoPE key: a rotary key
cannot be folded into the latent's up-projection, so it is kept apart);
``kv_b`` expands the latent into each head's content key [h_n] and value
[h_v]. Queries are [h_n + h_r] per head, from x directly or through a latent
of width r_q (``q_a``, an RMSNorm, ``q_b``). Head n scores slot j by
q_n . [k_n(c_kv_j); k_r_j] / sqrt(h_n + h_r).

The cache (:class:`LatentCache`) holds c_kv and the rotated k_r of every
slot: r_kv + h_r numbers per token and layer, the paper's Table 1, against
2 N h for multi-head attention. Each call expands the latent of every slot
again (the paper's inference folds ``kv_b`` into the query and output
projections instead; the same function, fewer FLOPs per step, not done
here). Scores and the softmax run in float32, the same code for the full
forward and the cached call, so a cached decode reproduces the full forward
up to the rounding of sums over a different number of slots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.nn.attention import apply_rope
from moejax.topology import roles


class LatentCache(NamedTuple):
  """One MLA layer's cache.

  latent: [B, C, r_kv] the normalised KV latent c_kv.
  rope_key: [B, C, h_r] the shared rotary key, rotated.
  valid: bool[B, C], as :class:`moejax.nn.attention.KVCache`'s.
  """

  latent: jax.Array
  rope_key: jax.Array
  valid: jax.Array


class LatentAttention(nnx.Module):
  """Causal multi-head latent attention with rotary position embeddings.

  ``opts``: :class:`moejax.nn.attention_kinds.MLAOptions` (ranks and head
  widths). The call signatures are :class:`~moejax.nn.attention.CausalSelfAttention`'s.
  """

  def __init__(self, d_model: int, n_heads: int, opts, *, norm_eps: float,
               rope_base: float = 10000.0, dtype=jnp.float32, rngs: nnx.Rngs):
    self.n_heads, self.rope_base = n_heads, rope_base
    self.r_kv, self.r_q = opts.kv_lora_rank, opts.q_lora_rank
    self.h_n, self.h_r, self.h_v = opts.qk_nope_head_dim, opts.qk_rope_head_dim, opts.v_head_dim
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,
                                  param_dtype=jnp.float32, rngs=rngs)
    norm = lambda w: nnx.RMSNorm(w, epsilon=norm_eps, dtype=dtype, param_dtype=jnp.float32,
                                 rngs=rngs)
    q_out = n_heads * (self.h_n + self.h_r)
    if self.r_q:
      self.q_a = lin(d_model, self.r_q)
      self.q_norm = norm(self.r_q)
      self.q_b = lin(self.r_q, q_out)
    else:
      self.q_proj = lin(d_model, q_out)
    self.kv_a = lin(d_model, self.r_kv + self.h_r)
    self.kv_norm = norm(self.r_kv)
    self.kv_b = lin(self.r_kv, n_heads * (self.h_n + self.h_v))
    self.o_proj = lin(n_heads * self.h_v, d_model)

  def projections(self) -> tuple[str, ...]:
    """The names of the projection layers (what LoRA adapts), in a fixed order."""
    q = ("q_a", "q_b") if self.r_q else ("q_proj",)
    return q + ("kv_a", "kv_b", "o_proj")

  def param_roles(self) -> dict:
    """Projections are hidden matrices [in, out]; the two latent norms are element-wise."""
    out = {name: {"kernel": roles.matrix("attention")}
           for name in ("q_proj", "q_a", "q_b", "kv_a", "kv_b", "o_proj")}
    out.update(q_norm=roles.elementwise("norm"), kv_norm=roles.elementwise("norm"))
    return out

  def _query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """q [B, S, N, h_n + h_r], its rotary part rotated."""
    b, s, _ = x.shape
    q = self.q_b(self.q_norm(self.q_a(x))) if self.r_q else self.q_proj(x)
    q = q.reshape(b, s, self.n_heads, self.h_n + self.h_r)
    q_rope = apply_rope(q[..., self.h_n:], positions, self.rope_base)
    return jnp.concatenate([q[..., :self.h_n], q_rope], axis=-1)

  def _compress(self, x: jax.Array, positions: jax.Array):
    """(c_kv [B, S, r_kv] normalised, k_r [B, S, h_r] rotated): what the cache stores."""
    kv = self.kv_a(x)
    latent = self.kv_norm(kv[..., :self.r_kv])
    rope_key = apply_rope(kv[..., None, self.r_kv:], positions, self.rope_base)[..., 0, :]
    return latent, rope_key

  def _attend(self, q: jax.Array, latent: jax.Array, rope_key: jax.Array,
              mask: jax.Array) -> jax.Array:
    """Attention of q [B, S, N, h_n + h_r] over C slots of (latent, rope key) under
    mask bool[B, S, C] -> [B, S, d]."""
    b, s = q.shape[:2]
    c = latent.shape[1]
    kv = self.kv_b(latent.astype(q.dtype)).reshape(b, c, self.n_heads, self.h_n + self.h_v)
    k_nope, v = kv[..., :self.h_n], kv[..., self.h_n:]
    k_rope = jnp.broadcast_to(rope_key.astype(q.dtype)[:, :, None, :],
                              (b, c, self.n_heads, self.h_r))
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    scale = (self.h_n + self.h_r) ** -0.5
    scores = jnp.einsum("bsnh,bcnh->bnsc", q, k,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bnsc,bcnh->bsnh", probs, v)
    return self.o_proj(out.reshape(b, s, self.n_heads * self.h_v))

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x[B, S, d], positions int[B, S] -> [B, S, d], causal."""
    b, s, _ = x.shape
    latent, rope_key = self._compress(x, positions)
    causal = jnp.tril(jnp.ones((s, s), bool))
    return self._attend(self._query(x, positions), latent, rope_key,
                        jnp.broadcast_to(causal, (b, s, s)))

  def init_cache(self, batch: int, capacity: int, dtype=jnp.float32) -> LatentCache:
    """An empty cache of C = ``capacity`` slots: the latent and the rotary key only."""
    return LatentCache(jnp.zeros((batch, capacity, self.r_kv), dtype),
                       jnp.zeros((batch, capacity, self.h_r), dtype),
                       jnp.zeros((batch, capacity), bool))

  def extend(self, x: jax.Array, positions: jax.Array, cache: LatentCache, index: jax.Array,
             write: jax.Array) -> tuple[jax.Array, LatentCache]:
    """Appends S tokens' latents to the cache and attends over it: (y[B, S, d], new cache).

    Arguments and visibility: :meth:`moejax.nn.attention.CausalSelfAttention.extend`.
    """
    s = x.shape[1]
    latent, rope_key = self._compress(x, positions)
    lat_all = jax.lax.dynamic_update_slice_in_dim(
        cache.latent, latent.astype(cache.latent.dtype), index, 1)
    rope_all = jax.lax.dynamic_update_slice_in_dim(
        cache.rope_key, rope_key.astype(cache.rope_key.dtype), index, 1)
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, write.astype(bool), index, 1)
    slot = jnp.arange(cache.valid.shape[1], dtype=jnp.int32)   # [C]
    query_slot = index + jnp.arange(s, dtype=jnp.int32)        # [S]
    mask = (valid[:, None, :] & (slot[None, None, :] <= query_slot[None, :, None])) \
        | (slot[None, None, :] == query_slot[None, :, None])   # [B, S, C]
    y = self._attend(self._query(x, positions), lat_all, rope_all, mask)
    return y, LatentCache(lat_all, rope_all, valid)
