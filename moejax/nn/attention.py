"""Rotary causal self-attention (MHA, GQA and MQA through n_kv_heads).

Legend: B batch, S sequence length, d model width, N query heads, M key/value
heads (M divides N), H head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


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
               use_bias: bool = False, rope_base: float = 10000.0,
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
    self.rope_base = rope_base
    lin = lambda i, o: nnx.Linear(i, o, use_bias=use_bias, dtype=dtype,
                                  param_dtype=jnp.float32, rngs=rngs)
    self.q_proj = lin(d_model, n_heads * head_dim)
    self.k_proj = lin(d_model, n_kv_heads * head_dim)
    self.v_proj = lin(d_model, n_kv_heads * head_dim)
    self.o_proj = lin(n_heads * head_dim, d_model)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x[B, S, d], positions int[B, S] -> [B, S, d]."""
    b, s, _ = x.shape
    q = self.q_proj(x).reshape(b, s, self.n_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, s, self.n_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, s, self.n_kv_heads, self.head_dim)
    q = apply_rope(q, positions, self.rope_base)
    k = apply_rope(k, positions, self.rope_base)
    # jax.nn.dot_product_attention repeats the M key/value heads over the N
    # query heads itself (GQA) and scales by 1/sqrt(H).
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, S, N, H]
    return self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim))
