"""Routing analysis of imported (or any) moejax MoE layers.

Legend: T tokens, d model width, E routed FFN experts, K slots per token.

:func:`analyze_layer` runs hidden states through one layer with
:func:`moejax.layer.moe_layer` and keeps what the layer's own metrics report
(per-expert load, MaxVio, load entropy, co-activation) plus the per-token
routing trace (chosen experts and gate weights). Nothing here is specific to
a checkpoint family: the trace of a layer imported from Hugging Face and of
one trained here read the same. torch is not needed; to run *text* through a
Hugging Face model's embedding and layers see
:mod:`moejax.interop.hf_models`.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.balance import metrics
from moejax.config import MoEConfig
from moejax.layer import moe_layer


@dataclasses.dataclass
class LayerRouting:
  """What one layer did with one batch of tokens (numpy, host side).

  Attributes:
    name: a label (e.g. ``layer 3``).
    expert_ids: int32[T, K] chosen experts per token, in the router's order.
    weights: f32[T, K] their gate weights.
    valid: bool[T, K] used slots.
    load: f32[E] token copies per FFN expert.
    max_vio: (max load - mean load) / mean load (Wang et al. 2408.15664).
    load_entropy: entropy of load / sum, over log E (1 = uniform).
    coactivation: f32[E, E] tokens routed to both i and j (diagonal = load).
    output: f32[T, d] the layer output (for parity checks against a source).
    token_ids: optional int[T] ids of the tokens, for the trace.
  """

  name: str
  expert_ids: np.ndarray
  weights: np.ndarray
  valid: np.ndarray
  load: np.ndarray
  max_vio: float
  load_entropy: float
  coactivation: np.ndarray
  output: np.ndarray
  token_ids: Optional[np.ndarray] = None

  @property
  def num_tokens(self) -> int:
    return int(self.expert_ids.shape[0])

  @property
  def num_experts(self) -> int:
    return int(self.load.shape[0])

  def summary(self) -> dict:
    """JSON-ready scalars and per-expert lists."""
    return {"name": self.name, "tokens": self.num_tokens, "top_k": int(self.expert_ids.shape[1]),
            "experts": self.num_experts, "max_vio": float(self.max_vio),
            "load_entropy": float(self.load_entropy), "load": self.load.tolist(),
            "coactivation": self.coactivation.tolist()}


def _apply(params, x, state, cfg: MoEConfig):
  y, aux = moe_layer(params, x, state, cfg)
  r = aux.routing
  return y, r.expert_ids, r.weights, r.valid, aux.metrics


# cfg is a frozen (hashable) dataclass: one compile per (config, token count).
_apply_jit = jax.jit(_apply, static_argnums=3)


def analyze_layer(block: Any, x: Any, *, name: str = "",
                  token_ids: Optional[Any] = None) -> LayerRouting:
  """Routes hidden states x [T, d] or [B, S, d] through one layer and records it.

  Args:
    block: an :class:`~moejax.interop.ImportedBlock` or a (params, state, cfg)
      tuple.
    x: the layer's *input* hidden states (for an HF decoder layer: the output
      of its post-attention norm).
    name: label for plots and the trace.
    token_ids: optional ids of the T tokens (flattened like x).
  """
  params, state, cfg = block[0], block[1], block[2]
  x = jnp.asarray(x, jnp.float32)
  shape = x.shape
  x2 = x.reshape(-1, shape[-1])
  y, ids, w, valid, m = _apply_jit(params, x2, state, cfg)
  tok = None if token_ids is None else np.asarray(token_ids).reshape(-1)
  if tok is not None and tok.shape[0] != x2.shape[0]:
    raise ValueError(f"analyze_layer: {tok.shape[0]} token ids for {x2.shape[0]} tokens; "
                     "pass one id per token")
  return LayerRouting(name=name, expert_ids=np.asarray(ids), weights=np.asarray(w),
                      valid=np.asarray(valid), load=np.asarray(m.load),
                      max_vio=float(m.max_vio), load_entropy=float(m.load_entropy),
                      coactivation=np.asarray(m.coactivation), output=np.asarray(y),
                      token_ids=tok)


def analyze_layers(blocks: Mapping[Any, Any], inputs: Mapping[Any, Any], *,
                   token_ids: Optional[Any] = None) -> list[LayerRouting]:
  """:func:`analyze_layer` for every key of ``blocks`` (inputs share the keys)."""
  missing = [k for k in blocks if k not in inputs]
  if missing:
    raise ValueError(f"analyze_layers: no input hidden states for layers {missing}")
  return [analyze_layer(blocks[k], inputs[k], name=f"layer {k}", token_ids=token_ids)
          for k in blocks]


def global_max_vio(layers: Iterable[LayerRouting]) -> float:
  """MaxVio of the load summed over the given batches of one layer (MaxVio_global)."""
  acc = None
  for lr in layers:
    acc = metrics.MaxVioAccumulator.zeros(lr.num_experts) if acc is None else acc
    acc = acc.add(jnp.asarray(lr.load))
  if acc is None:
    raise ValueError("global_max_vio: no batches")
  return float(acc.value())


def trace_rows(layers: Sequence[LayerRouting],
               token_text: Optional[Sequence[str]] = None) -> list[dict]:
  """The per-token routing trace: one row per (layer, token).

  Columns: layer, position, token_id, token (text, when given), experts
  (space-separated ids, router order), weights (same order, 6 digits).
  """
  rows = []
  for lr in layers:
    for t in range(lr.num_tokens):
      keep = lr.valid[t]
      rows.append({
          "layer": lr.name, "position": t,
          "token_id": "" if lr.token_ids is None else int(lr.token_ids[t]),
          "token": "" if token_text is None else token_text[t],
          "experts": " ".join(str(int(e)) for e in lr.expert_ids[t][keep]),
          "weights": " ".join(f"{float(v):.6f}" for v in lr.weights[t][keep]),
      })
  return rows


def write_trace_csv(path: str | os.PathLike, layers: Sequence[LayerRouting],
                    token_text: Optional[Sequence[str]] = None) -> None:
  rows = trace_rows(layers, token_text)
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=["layer", "position", "token_id", "token",
                                           "experts", "weights"])
    writer.writeheader()
    writer.writerows(rows)
