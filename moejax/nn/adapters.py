"""Attaching LoRA adapters to a built :class:`~moejax.model.Transformer` (in place).

Legend: d model width, E routed experts, f expert width, F dense width, r rank.

``attach(model, targets, rank, scale, key)`` for ``targets`` among:

- ``attention``: the projections of every block's attention (its
  ``projections()``: q / k / v / o for MHA; MLA's query, kv_a, kv_b and o)
  become :class:`moejax.nn.lora.LoRALinear` (flax's ``nnx.LoRALinear``, scaled);
- ``dense``: the dense FFN layers' w_gate / w_up / w_down likewise, and a MoE
  layer's shared experts get adapters merged before the layer runs;
- ``experts``: every MoE layer's routed experts get per-expert adapters
  A_e [E, i, r], B_e [E, r, o] on w_gate, w_up [E, d, f] and w_down [E, f, d],
  merged into W_e before the executor (:mod:`moejax.nn.lora`).

The base weights keep their Variables (and paths); B = 0, so the model
computes what it computed before. Expert sharing across layers
(``model.expert_sharing_group``) shares the base experts; each layer gets
its own adapters.

Here, with the building blocks, because a fine-tuning run's model *is* the
base model with these adapters: the train step builds that model from the
config (``finetune.lora``) for every state it makes, fresh, abstract or
restored, so building it must not need the fine-tuning package
(:mod:`moejax.finetune.adapters` re-exports :func:`attach` and counts the
parameters it adds).
"""

from __future__ import annotations

import jax
from flax import nnx

from moejax.nn import lora as lora_lib
from moejax.nn.ffn import DenseFFN
from moejax.nn.mod import MoDBlock
from moejax.config import ModelConfig
from moejax.topology.experts import shared_width

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _blocks(model):
  for block in model.blocks:
    yield block.block if isinstance(block, MoDBlock) else block


def attach(model, targets, rank: int, scale: float, key: jax.Array) -> None:
  """Adds adapters on ``targets`` to ``model`` in place (see the module docstring)."""
  targets = set(targets)
  for i, block in enumerate(_blocks(model)):
    k_attn, k_ffn, k_moe = jax.random.split(jax.random.fold_in(key, i), 3)
    rngs = nnx.Rngs(params=k_attn)
    if "attention" in targets:
      for name in block.attn.projections():  # the attention kind's own projections
        setattr(block.attn, name, lora_lib.LoRALinear(getattr(block.attn, name), rank, scale,
                                                      rngs=rngs))
    ffn = block.ffn
    if isinstance(ffn, DenseFFN):
      if "dense" in targets:
        rngs = nnx.Rngs(params=k_ffn)
        for name in ("w_gate", "w_up", "w_down"):
          if hasattr(ffn, name):
            setattr(ffn, name, lora_lib.LoRALinear(getattr(ffn, name), rank, scale, rngs=rngs))
      continue
    subs = (["experts"] if "experts" in targets else []) + (["shared"] if "dense" in targets
                                                            else [])
    if subs:
      params = {k: v for k, v in ffn.params.items()}
      adapters = lora_lib.init_moe_adapters(k_moe, params, subs, rank)
      if adapters:
        ffn.attach_adapters(adapters, scale)


def lora_param_count(model: ModelConfig, targets, rank: int) -> int:
  """Parameters LoRA of rank r on ``targets`` adds to ``model`` (computed from the config).

  Attention: r (I + O) for each I x O projection of the attention kind (MHA:
  r (d + N H) for q and o, r (d + M H) for k and v), per block.
  Dense FFN of width F: r (d + F) per matrix (3 for SwiGLU, 2 for GELU).
  Shared experts of total width F_s: the same with F_s. Routed experts:
  E r (d + f) per matrix. Heterogeneous expert widths count the padded f.
  """
  targets = set(targets)
  d = model.d_model
  attention = sum(rank * (i + o) * c for i, o, c in
                  model.attention_spec.matrices(model, model.attention_options))
  total = 0
  for i in range(model.n_layers):
    if "attention" in targets:
      total += attention
    mats = lambda act: 3 if act == "swiglu" else 2
    if not model.is_moe_layer(i):
      if "dense" in targets:
        total += mats(model.dense_activation) * rank * (d + model.dense_ff_width)
      continue
    moe = model.moe
    t = moe.topology
    if "experts" in targets and moe.layer.expert_bank:
      f = max(t.expert_widths) if t.expert_widths else t.expert_width
      total += mats(t.activation) * moe.num_experts * rank * (d + f)
    if "dense" in targets and t.num_shared_experts:
      fs = t.num_shared_experts * shared_width(moe)
      total += mats(t.activation) * rank * (d + fs)
  return total
