"""LoRA adapters of a fine-tuning run: where they go and how many parameters they add.

Legend: d model width, E routed experts, f expert width, F dense width, r rank.

:func:`attach` (and :data:`ATTENTION`) are defined in :mod:`moejax.nn.adapters`,
next to the building blocks they adapt, because the train step builds every
state's model with its adapters and must not import this package; they are
re-exported here as part of the fine-tuning API.

:func:`lora_param_count` is the documented count: r (i + o) per adapted
matrix, times E per expert stack.
"""

from __future__ import annotations

from moejax.config import ModelConfig
from moejax.nn.adapters import ATTENTION, attach
from moejax.topology.experts import shared_width

__all__ = ["ATTENTION", "attach", "lora_param_count"]


def lora_param_count(model: ModelConfig, targets, rank: int) -> int:
  """Parameters LoRA of rank r on ``targets`` adds to ``model`` (computed from the config).

  Attention: r (d + N H) for q and o, r (d + M H) for k and v, per block.
  Dense FFN of width F: r (d + F) per matrix (3 for SwiGLU, 2 for GELU).
  Shared experts of total width F_s: the same with F_s. Routed experts:
  E r (d + f) per matrix. Heterogeneous expert widths count the padded f.
  """
  targets = set(targets)
  d, h = model.d_model, model.attn_head_dim
  total = 0
  for i in range(model.n_layers):
    if "attention" in targets:
      q, kv = model.n_heads * h, model.kv_heads * h
      total += rank * (2 * (d + q) + 2 * (d + kv))
    mats = lambda act: 3 if act == "swiglu" else 2
    if not model.is_moe_layer(i):
      if "dense" in targets:
        total += mats(model.dense_activation) * rank * (d + model.dense_ff_width)
      continue
    moe = model.moe
    t = moe.topology
    if "experts" in targets and moe.kind != "peer":
      f = max(t.expert_widths) if t.expert_widths else t.expert_width
      total += mats(t.activation) * moe.num_experts * rank * (d + f)
    if "dense" in targets and moe.kind == "sparse" and t.num_shared_experts:
      fs = t.num_shared_experts * shared_width(moe)
      total += mats(t.activation) * rank * (d + fs)
  return total
