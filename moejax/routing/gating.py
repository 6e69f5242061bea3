"""Gate weights from a selection: the ``gating`` conventions of RoutingConfig.

Legend: T tokens, E_r router outputs (FFN plus zero-computation experts), K
slots per token.

Gates always come from the *unbiased* scores of the selected experts: the
aux-loss-free bias (Wang et al. 2408.15664; DeepSeek-V3) only changes which
experts are chosen, never how much they weigh. Conventions:

- ``topk_softmax``: softmax over the selected *logits* (Mixtral,
  Softmax(TopK(W x))). For softmax scores this equals the selected
  probabilities renormalised to sum 1 (the softmax normaliser cancels).
- ``scores``: the selected scores as they are (Switch top-1; Qwen
  ``norm_topk_prob=False``).
- ``normalized``: selected scores divided by their sum over the valid slots
  (Qwen ``norm_topk_prob=True``; DeepSeek-V3).

Then every gate is multiplied by ``routed_scaling_factor`` (2.5 in
DeepSeek-V3 671B). Invalid slots get weight exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gate_weights(s: jax.Array, logits: jax.Array, ids: jax.Array, valid: jax.Array,
                 gating: str, scale: float) -> jax.Array:
  """Gates g[T, K] of the selected experts.

  Args:
    s: [T, E_r] unbiased scores (softmax probabilities or sigmoid-family scores).
    logits: [T, E_r] the logits behind ``s`` (used by ``topk_softmax`` only).
    ids: int[T, K] selected experts.
    valid: bool[T, K] which slots are used.
    gating: ``topk_softmax`` | ``scores`` | ``normalized``.
    scale: routed_scaling_factor.

  Returns:
    [T, K] in the dtype of ``s``; exactly 0 where not ``valid``.
  """
  if gating == "topk_softmax":
    sel = jnp.take_along_axis(logits, ids, axis=-1)
    # A finite floor instead of -inf keeps a token with no valid slot (only
    # possible for expert choice, which does not gate) free of NaNs.
    sel = jnp.where(valid, sel, jnp.finfo(sel.dtype).min)
    g = jax.nn.softmax(sel, axis=-1)
  else:
    g = jnp.where(valid, jnp.take_along_axis(s, ids, axis=-1), 0)
    if gating == "normalized":
      denom = jnp.sum(g, axis=-1, keepdims=True)
      g = g / jnp.where(denom > 0, denom, 1)
    elif gating != "scores":
      raise ValueError(f"moe.routing.gating={gating!r}: unknown gating; "
                       "use topk_softmax, scores or normalized")
  return jnp.where(valid, g * scale, 0).astype(s.dtype)
