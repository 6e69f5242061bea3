"""Mixture-of-depths blocks (Raposo et al. 2404.02258).

Legend: B batch, S sequence length, k = tokens a block processes per
sequence, d model width.

A scalar router scores every token; the top k = round(capacity * S) tokens of
each sequence go through the wrapped block (attention among themselves, then
the FFN), the rest skip it on the residual. A processed token's update is
scaled by its router weight, x + g(r) * (block(x) - x), which is how the
router receives gradients (g = sigmoid here by default; the paper multiplies
by the raw score r).

Causality: top-k over a sequence is not causal -- whether token t is
processed depends on later tokens' scores. The paper trains a causal stand-in:
a binary cross-entropy teaching sigmoid(r_t) to predict top-k membership, so
autoregressive sampling can decide per token with sigmoid(r_t) > 0.5. This
module returns that loss (weighted by ``mod_aux_loss_coef``); decoding with
the threshold is the sampler's job.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moejax.topology import roles


def capacity_tokens(seq_len: int, capacity: float) -> int:
  """k tokens per sequence a MoD block processes (at least 1)."""
  return max(1, min(seq_len, int(round(capacity * seq_len))))


def select_tokens(scores: jax.Array, k: int) -> jax.Array:
  """int32[B, k] positions of the k highest scores[B, S], in increasing order.

  Sorting keeps the selected tokens in sequence order, so the block's causal
  mask over the subset is the causal mask over original positions.
  """
  _, idx = jax.lax.top_k(scores, k)
  return jnp.sort(idx, axis=-1).astype(jnp.int32)


def gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[B, S, ...] at idx[B, k] -> [B, k, ...]."""
  return jax.vmap(lambda xb, ib: xb[ib])(x, idx)


def scatter(base: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
  """base[B, S, ...] with rows idx[B, k] replaced by values[B, k, ...]."""
  return jax.vmap(lambda bb, ib, vb: bb.at[ib].set(vb))(base, idx, values)


class MoDBlock(nnx.Module):
  """Wraps a transformer block so it processes only the routed tokens.

  The wrapped block's call is ``block(x, positions, token_ids, train=, rng=,
  axis_names=) -> (x_out, moe_aux or None)``.
  """

  def __init__(self, block: nnx.Module, d_model: int, *, capacity: float, gate: str,
               aux_loss_coef: float, rngs: nnx.Rngs):
    self.block = block
    self.capacity, self.gate, self.aux_loss_coef = capacity, gate, aux_loss_coef
    # Scores in float32 whatever the compute dtype: top-k ties under bf16
    # would make the selection depend on rounding.
    self.router = nnx.Linear(d_model, 1, use_bias=False, dtype=jnp.float32,
                             param_dtype=jnp.float32, rngs=rngs)

  def param_roles(self) -> dict:
    """The scalar router [d, 1] is a router: element-wise, like the MoE routers."""
    return {"router": roles.elementwise("mod_router")}

  def __call__(self, x: jax.Array, positions: jax.Array, token_ids: jax.Array, *,
               train: bool = False, rng: Optional[jax.Array] = None,
               axis_names: Sequence[str] = ()) -> tuple[jax.Array, Any, dict]:
    """x[B, S, d] -> (x_out[B, S, d], moe_aux or None, mod_aux).

    mod_aux: ``selected`` bool[B, S], ``scores`` f32[B, S], ``loss`` (the
    weighted membership cross-entropy; 0 when its coefficient is 0) and
    ``metrics``: ``tokens`` (tokens the block processed in this batch, B k),
    ``capacity_use`` (k / S, the share it processed), ``causal_share`` (share
    of tokens the causal rule sigmoid(r) > 0.5 would process) and
    ``causal_agreement`` (share of tokens on which that rule agrees with the
    top-k selection: how ready the router is for autoregressive sampling).
    """
    b, s, _ = x.shape
    scores = self.router(x.astype(jnp.float32))[..., 0]  # [B, S]
    idx = select_tokens(scores, capacity_tokens(s, self.capacity))
    x_sel = gather(x, idx)
    out, moe_aux = self.block(x_sel, gather(positions, idx), gather(token_ids, idx),
                              train=train, rng=rng, axis_names=axis_names)
    r = gather(scores, idx)
    g = jax.nn.sigmoid(r) if self.gate == "sigmoid" else r
    x_out = scatter(x, idx, x_sel + (g[..., None] * (out - x_sel)).astype(x.dtype))

    selected = scatter(jnp.zeros((b, s), bool), idx, jnp.ones(idx.shape, bool))
    causal = scores > 0
    metrics = {
        "tokens": jnp.asarray(b * idx.shape[1], jnp.float32),
        "capacity_use": jnp.asarray(idx.shape[1] / s, jnp.float32),
        "causal_share": jnp.mean(causal.astype(jnp.float32)),
        "causal_agreement": jnp.mean((causal == selected).astype(jnp.float32)),
    }
    loss = jnp.zeros((), jnp.float32)
    if self.aux_loss_coef:
      loss = self.aux_loss_coef * jnp.mean(
          optax.sigmoid_binary_cross_entropy(scores, selected.astype(jnp.float32)))
    if moe_aux is not None:
      # Unselected tokens did not reach the MoE layer: invalid slots.
      for key in ("expert_ids", "weights", "valid"):
        if key in moe_aux:
          v = moe_aux[key]
          moe_aux[key] = scatter(jnp.zeros((b, s) + v.shape[2:], v.dtype), idx, v)
    return x_out, moe_aux, {"selected": selected, "scores": scores, "loss": loss,
                            "metrics": metrics}
