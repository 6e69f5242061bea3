"""Shared helpers of the interop tests: random HF MoE blocks and ties-free inputs.

Legend: T tokens, d model width, E routed experts, K experts per token, G groups.

Import this only after ``pytest.importorskip("torch")`` (the interop extra).
"""

from __future__ import annotations

import importlib

import jax
import numpy as np
import torch

from moejax.interop import hf_models
from moejax.layer import moe_layer

torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float32)

# model_type -> (modeling module, MoE block class)
BLOCKS = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
}


def _apply(params, x, state, cfg):
  y, aux = moe_layer(params, x, state, cfg)
  return y, aux.routing.expert_ids, aux.routing.weights


# (y, expert_ids, gates) of the moejax layer; cfg (hashable) is static, so one
# compile per (config, input shape).
apply_layer = jax.jit(_apply, static_argnums=3)


def block_class(model_type: str):
  module, name = BLOCKS[model_type]
  return getattr(importlib.import_module(module), name)


def make_block(model_type: str, seed: int, *, router_std: float = 0.3,
               expert_std: float = 0.2, bias_std: float = 0.0, **overrides):
  """(HF MoE block in eval mode with N(0, std) weights, its config)."""
  cfg = hf_models.tiny_config(model_type, **overrides)
  block = block_class(model_type)(cfg).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in block.named_parameters():
      std = router_std if name == "gate.weight" else expert_std
      p.copy_(torch.randn(p.shape, generator=gen) * std)
    for name, b in block.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(torch.randn(b.shape, generator=gen) * bias_std)
  return block, cfg


def hf_forward(block, x: np.ndarray) -> np.ndarray:
  """The block on x f32[T, d] (as one sequence) -> f32[T, d]."""
  with torch.no_grad():
    y = block(torch.from_numpy(x)[None])
  y = y[0] if isinstance(y, tuple) else y
  return y[0].numpy()


def hf_routing(block, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(ids int[T, K], gates f32[T, K]) from the HF router, sorted by expert id."""
  with torch.no_grad():
    _, w, ids = block.gate(torch.from_numpy(x))
  ids, w = ids.numpy(), w.numpy()
  order = np.argsort(ids, axis=-1)
  return np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)


def selection(block, cfg, x: np.ndarray) -> dict:
  """The HF selection rule recomputed in float64, with its tie margins.

  Returns a dict: ``key`` [T, E] (masked outside the chosen groups),
  ``unlimited`` [T, K] ids of the top-K without the group limit (sorted),
  ``margin`` [T] the smallest gap at a decision boundary (K-th vs K+1-th
  allowed expert; topk_group-th vs next group), ``kth`` [T] the K-th allowed
  key.
  """
  w = block.gate.weight.detach().double().numpy()
  logits = x.astype(np.float64) @ w.T
  k = cfg.num_experts_per_tok
  if cfg.model_type == "deepseek_v3":
    key = 1.0 / (1.0 + np.exp(-logits)) + block.gate.e_score_correction_bias.double().numpy()
  else:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    key = z / z.sum(-1, keepdims=True)
  unlimited = np.sort(np.argsort(-key, axis=-1)[:, :k], axis=-1)
  t, e = key.shape
  margin = np.full((t,), np.inf)
  if cfg.model_type == "deepseek_v3" and cfg.n_group > 1:
    g, tg = cfg.n_group, cfg.topk_group
    top2 = np.sort(key.reshape(t, g, e // g), -1)[..., -2:].sum(-1)  # [T, G]
    srt = np.sort(top2, -1)[:, ::-1]
    margin = srt[:, tg - 1] - srt[:, tg] if tg < g else margin
    top_groups = np.argsort(-top2, -1)[:, :tg]
    keep = np.zeros((t, g), bool)
    np.put_along_axis(keep, top_groups, True, -1)
    key = np.where(np.repeat(keep, e // g, -1), key, -np.inf)
  srt = np.sort(key, -1)[:, ::-1]
  gap = srt[:, k - 1] - srt[:, k] if k < e else np.full((t,), np.inf)
  return {"key": key, "unlimited": unlimited, "margin": np.minimum(margin, gap),
          "kth": srt[:, k - 1]}


def ties_free_inputs(block, cfg, tokens: int, seed: int, min_margin: float = 1e-4,
                     scale: float = 1.0) -> np.ndarray:
  """x f32[T, d] whose every routing decision clears ``min_margin``.

  Candidates are drawn N(0, scale^2) and those within ``min_margin`` of a tie
  (in expert or group selection) are dropped, so float32 rounding cannot flip
  a choice and torch and XLA must agree on every expert.
  """
  rng = np.random.default_rng(1000 + seed)
  x = (rng.standard_normal((4 * tokens + 16, cfg.hidden_size)) * scale).astype(np.float32)
  ok = selection(block, cfg, x)["margin"] > min_margin
  x = x[ok][:tokens]
  assert x.shape[0] == tokens, "too few ties-free candidates; draw more"
  return x
