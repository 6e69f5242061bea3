"""Routing consistency: how often two forwards of one model send a token to other experts.

Legend: B sequences, S tokens per sequence, K slots per token, E_r router
outputs.

Two forwards of the same model on the same tokens (f32 against bf16, the
full forward against cached decoding, one expert-parallel degree against
another, ...) each give every routed layer a selection, the set of (token,
expert) pairs it used (:class:`~moejax.routing.replay.RoutingReplay`, the
model's ``aux['moe'][layer]['selection']``). Measured on those pairs, so it
means the same for top-k, variable-k routers and expert choice:

- **flip rate** of a layer: the share of selected pairs (selected in either
  forward) that the other forward did not select,
  ``(|A - B| + |B - A|) / (|A| + |B|)``; for a fixed K it is the share of a
  forward's pairs the other one moved. 0 for identical selections.
- **token flip share**: the share of tokens with at least one flipped pair
  in any layer.
- **near-tie margin** (:func:`topk_margin`): per token, the gap between the
  K-th and the (K+1)-th selection score. A small perturbation can flip only
  a token whose margin it can cross, so the margins' histogram predicts
  where flips land.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from moejax.routing.replay import RoutingReplay


def pair_mask(sel: RoutingReplay, num_routed: int) -> np.ndarray:
  """bool[..., E_r]: token routed (validly) to expert e."""
  ids, valid = np.asarray(sel.expert_ids), np.asarray(sel.valid, bool)
  onehot = np.arange(num_routed) == ids[..., None]             # [..., K, E_r]
  return np.any(onehot & valid[..., None], axis=-2)


@dataclasses.dataclass(frozen=True)
class Consistency:
  """Flip rates of one forward against a reference.

  Attributes:
    layer_flip_rate: ``{'layer_<i>': share of selected pairs flipped}``.
    token_flip_share: share of tokens with a flipped pair in any layer.
    flip_rate: the flipped pairs' share over every layer's pairs.
  """

  layer_flip_rate: Mapping[str, float]
  token_flip_share: float
  flip_rate: float


def compare(reference: Mapping[str, RoutingReplay], other: Mapping[str, RoutingReplay],
            num_routed: int) -> Consistency:
  """Flip rates of ``other``'s selections against ``reference``'s (the same layers and tokens)."""
  if sorted(reference) != sorted(other):
    raise ValueError(f"consistency: the forwards route layers {sorted(reference)} and "
                     f"{sorted(other)}. Fix: compare two forwards of the same model")
  rates, flipped_tokens, flips, pairs = {}, None, 0, 0
  for name in sorted(reference):
    a, b = pair_mask(reference[name], num_routed), pair_mask(other[name], num_routed)
    if a.shape != b.shape:
      raise ValueError(f"consistency: {name} routes tokens {a.shape[:-1]} and {b.shape[:-1]}. "
                       "Fix: compare forwards on the same tokens")
    diff = a ^ b
    n_flip, n_pair = int(diff.sum()), int(a.sum() + b.sum())
    rates[name] = n_flip / n_pair if n_pair else 0.0
    flips, pairs = flips + n_flip, pairs + n_pair
    tok = diff.any(axis=-1)
    flipped_tokens = tok if flipped_tokens is None else flipped_tokens | tok
  share = float(flipped_tokens.mean()) if flipped_tokens is not None else 0.0
  return Consistency(layer_flip_rate=rates, token_flip_share=share,
                     flip_rate=flips / pairs if pairs else 0.0)


def topk_margin(key: jax.Array, k: int) -> jax.Array:
  """f32[T]: the K-th minus the (K+1)-th largest selection score of each token (key [T, E_r])."""
  if not 0 < k < key.shape[-1]:
    raise ValueError(f"topk_margin: k={k} needs 0 < k < {key.shape[-1]} experts. Fix: pass "
                     "the router's top_k")
  top, _ = jax.lax.top_k(key.astype(jnp.float32), k + 1)
  return top[..., k - 1] - top[..., k]


def margin_histogram(margins, bins: int = 20, top: Optional[float] = None) -> dict:
  """``{'edges': [...], 'counts': [...]}`` of the margins over [0, top] (default their max)."""
  m = np.asarray(margins, np.float64).reshape(-1)
  if top is None:
    top = float(m.max()) if m.size else 1.0
  hi = float(top)
  counts, edges = np.histogram(m, bins=bins, range=(0.0, max(hi, 1e-12)))
  return {"edges": edges.tolist(), "counts": counts.astype(int).tolist()}
