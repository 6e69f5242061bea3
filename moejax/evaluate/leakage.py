"""Causal-leakage probe: does routing let a position see the future?

Legend: B batch, S sequence length, V vocabulary.

A causal LM's prediction at position t may depend on tokens <= t only.
Attention is masked, but routing need not be: expert choice picks each
expert's top tokens over the whole batch, future tokens included; capacity
dropping decides which copies survive by looking at every token; Soft MoE
mixes whole sequences. Training (and "whole chunk" evaluation) then scores a
model that peeks, and generation, which only ever has the prefix, does worse.

The probe scores the same tokens twice:

(i) ``chunk``: one forward over the whole [B, S] chunk, as training and
    ordinary validation do;
(ii) ``causal``: for every t, a forward over the prefix ``inputs[:, :t+1]``
    keeping the logits at t, so position t is routed with tokens <= t only
    (of every row of the batch: nothing from any row's future).

``gap = causal_loss - chunk_loss`` (nats per token). Token-choice routers
without capacity give a gap of 0 up to float rounding (and identical logits);
a leaking router gives a nonzero gap, positive once the model has learnt to
use what it peeks at. (ii) costs S forwards of S different lengths (one
compilation each), so probe short sequences (``max_len``).
"""

from __future__ import annotations

from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.nn.losses import masked_cross_entropy


class LeakageProbe:
  """The probe for one model, compiled once per sequence length and reused.

  ``probe = LeakageProbe(model); probe(inputs, targets)`` or
  ``probe.over(batches)``; see :func:`causal_leakage`.
  """

  def __init__(self, model: nnx.Module):
    graphdef, self._state = nnx.split(model)

    @jax.jit
    def logits(state, tokens):
      return nnx.merge(graphdef, state)(tokens, train=False)[0]

    self._logits = logits

  def _forward(self, tokens):
    return self._logits(self._state, tokens)

  def __call__(self, inputs, targets, mask=None, max_len: Optional[int] = None) -> dict:
    inputs, targets = jnp.asarray(inputs), jnp.asarray(targets)
    mask = jnp.ones(inputs.shape, bool) if mask is None else jnp.asarray(mask)
    if max_len is not None:
      inputs, targets, mask = inputs[:, :max_len], targets[:, :max_len], mask[:, :max_len]
    if inputs.ndim != 2 or inputs.shape != targets.shape or inputs.shape != mask.shape:
      raise ValueError(f"causal_leakage: inputs {inputs.shape}, targets {targets.shape} and "
                       f"mask {mask.shape} must be the same [B, S]")
    chunk = self._forward(inputs)                                       # [B, S, V]
    causal = jnp.stack([self._forward(inputs[:, : t + 1])[:, t]
                        for t in range(inputs.shape[1])], axis=1)
    chunk_loss = float(masked_cross_entropy(chunk, targets, mask)[0])
    causal_loss = float(masked_cross_entropy(causal, targets, mask)[0])
    return {"chunk_loss": chunk_loss, "causal_loss": causal_loss,
            "gap": causal_loss - chunk_loss,
            "max_logit_diff": float(jnp.max(jnp.abs(chunk - causal)))}

  def over(self, batches: Iterable[dict], num_batches: int = 4,
           max_len: int = 32) -> dict[str, float]:
    """The probe averaged over the first ``num_batches`` data batches, token-weighted.

    ``batches`` yields dicts with ``inputs``, ``targets``, ``mask`` (e.g.
    ``moejax.data.make_batches(cfg, 'validation')``).
    """
    chunk_sum = causal_sum = tokens = max_diff = 0.0
    for i, batch in enumerate(batches):
      if i >= num_batches:
        break
      n = float(np.asarray(batch["mask"])[:, :max_len].sum())
      r = self(batch["inputs"], batch["targets"], batch["mask"], max_len)
      chunk_sum += r["chunk_loss"] * n
      causal_sum += r["causal_loss"] * n
      tokens += n
      max_diff = max(max_diff, r["max_logit_diff"])
    if tokens == 0:
      raise ValueError("causal_leakage_over: no scored token in the batches")
    chunk, causal = chunk_sum / tokens, causal_sum / tokens
    return {"chunk_loss": chunk, "causal_loss": causal, "gap": causal - chunk,
            "max_logit_diff": max_diff, "tokens": tokens}


def causal_leakage(model: nnx.Module, inputs, targets, mask=None,
                   max_len: Optional[int] = None) -> dict[str, float]:
  """Loss of whole-chunk vs causally consistent evaluation of one batch.

  Args:
    model: a :class:`moejax.model.Transformer` (evaluated with train=False).
    inputs, targets: int32[B, S]; mask: bool[B, S] scored targets (all if None).
    max_len: probe only the first ``max_len`` positions (the chunk is cut too).

  Returns:
    ``chunk_loss``, ``causal_loss``, ``gap`` (causal - chunk) in nats per
    token, and ``max_logit_diff``, the largest |logit| difference between the
    two evaluations (0 up to rounding without leakage).
  """
  return LeakageProbe(model)(inputs, targets, mask, max_len)


def causal_leakage_over(model: nnx.Module, batches: Iterable[dict], num_batches: int = 4,
                        max_len: int = 32) -> dict[str, float]:
  """:meth:`LeakageProbe.over`: the probe averaged over data batches."""
  return LeakageProbe(model).over(batches, num_batches, max_len)
