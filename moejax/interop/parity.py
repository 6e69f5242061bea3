"""Parity of imported MoE layers with the transformers blocks they came from.

Legend: T tokens, d model width, E routed experts, K experts per token, G groups.

:func:`block_parity` builds a random transformers MoE block of a family,
draws ties-free tokens (no routing decision within ``min_margin`` of a tie,
so float32 rounding cannot flip a choice), imports the block's own state
dict with :func:`moejax.interop.import_moe_block` and compares the experts,
the gates and the output. The interop tests assert on it; ``python -m
experiments.bench --suite=interop`` records its errors for :data:`CASES`.

Needs torch and transformers (``pip install -e '.[interop]'``).
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import numpy as np

from moejax.interop import hf_models
from moejax.interop.convert import import_moe_block
from moejax.layer import moe_layer

# model_type -> (modeling module, MoE block class)
BLOCKS = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
}

# (id, model_type, HF config overrides, random-block options): the routing rules each
# family has (top-K with and without renormalisation, shared experts, group limits).
CASES = (
    ("mixtral", "mixtral", {}, {}),
    ("mixtral-top3", "mixtral", {"num_experts_per_tok": 3}, {}),
    ("qwen2-norm", "qwen2_moe", {"norm_topk_prob": True}, {}),
    ("qwen2-nonorm", "qwen2_moe", {"norm_topk_prob": False}, {}),
    ("qwen3-norm", "qwen3_moe", {"norm_topk_prob": True}, {}),
    ("qwen3-nonorm-top4", "qwen3_moe", {"norm_topk_prob": False, "num_experts_per_tok": 4}, {}),
    # group-limited: 4 groups of 2, best 2 groups; scaled, renormalised gates.
    ("dsv3-groups", "deepseek_v3", {"n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                                    "routed_scaling_factor": 2.5}, {"bias_std": 0.1}),
    # one group of 2 for top-2: the group rule alone decides; a large bias
    # makes biased keys negative (masking to 0 instead of -inf would differ).
    ("dsv3-one-group-negative", "deepseek_v3",
     {"n_group": 4, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
     {"bias_std": 1.0}),
    ("dsv3-no-groups", "deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                                       "n_shared_experts": 1}, {"bias_std": 0.3}),
)


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
  import torch  # pylint: disable=g-import-not-at-top
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
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    y = block(torch.from_numpy(x)[None])
  y = y[0] if isinstance(y, tuple) else y
  return y[0].numpy()


def hf_routing(block, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(ids int[T, K], gates f32[T, K]) from the HF router, sorted by expert id."""
  import torch  # pylint: disable=g-import-not-at-top
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
  if x.shape[0] != tokens:
    raise ValueError(f"only {x.shape[0]} of {tokens} ties-free tokens; draw more candidates")
  return x


def block_parity(model_type: str, seed: int, tokens: int, options: dict | None = None,
                 **overrides: Any) -> dict:
  """One random block of ``model_type`` against its import, on ``tokens`` ties-free tokens.

  Returns ``same_experts`` (every token's K experts equal), ``gate_error`` (max |gate -
  HF gate|), ``max_abs`` (max |y - y_HF|), ``max_rel`` (``max_abs`` / max |y_HF|) and
  the block, its config, x and both outputs, for further checks.
  """
  block, hf_cfg = make_block(model_type, seed, **(options or {}), **overrides)
  x = ties_free_inputs(block, hf_cfg, tokens, seed)
  want = hf_forward(block, x)
  want_ids, want_w = hf_routing(block, x)
  imported = import_moe_block(block.state_dict(), hf_cfg, prefix="")
  y, ids, w = (np.asarray(a) for a in apply_layer(imported.params, x, imported.state,
                                                  imported.cfg))
  order = np.argsort(ids, axis=-1)
  ids, w = np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)
  same = bool(np.array_equal(ids, want_ids))
  err = float(np.max(np.abs(y - want)))
  return {"same_experts": same, "gate_error": float(np.max(np.abs(w - want_w))) if same else None,
          "max_abs": err, "max_rel": err / max(float(np.max(np.abs(want))), 1e-30),
          "block": block, "hf_cfg": hf_cfg, "x": x, "y": y, "want": want, "ids": ids,
          "want_ids": want_ids, "gates": w, "want_gates": want_w}
