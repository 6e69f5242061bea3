"""Running Hugging Face MoE models (torch) to feed imported moejax layers.

Legend: B batch, S sequence length, d model width.

Needs the ``interop`` extra (torch, transformers). Three pieces:

- :func:`tiny_model`: a small random model of a supported family, built from
  its transformers config class (nothing is downloaded), for tests and demos;
- :func:`capture_moe_io`: runs token ids through an HF model's embedding and
  decoder layers and returns, per MoE layer, the block's input and output
  hidden states (forward hooks on the block module);
- :func:`analyze_text`: text -> byte-level ids -> captured inputs -> the
  imported moejax layers -> :class:`~moejax.interop.analysis.LayerRouting`
  per layer, with the max error of each moejax layer against the HF block.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from moejax.interop import analysis
from moejax.interop import families as fam
from moejax.interop.convert import import_moe_block
from moejax.interop.errors import InteropError

# Small configs with every MoE feature of the family switched on; attention
# is tiny too (the MoE blocks are what is analysed).
TINY: dict[str, dict] = {
    "mixtral": dict(hidden_size=32, intermediate_size=16, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256),
    "qwen2_moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "qwen3_moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=256),
    "deepseek_v3": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        num_hidden_layers=3, first_k_dense_replace=1,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=8, vocab_size=256),
}


def tiny_config(model_type: str, **overrides: Any):
  """The transformers config of a tiny ``model_type`` model (eager experts)."""
  from transformers import AutoConfig

  if model_type not in TINY:
    fam.get_family(model_type)  # unsupported: names the supported list
    raise InteropError(f"no tiny config for {model_type!r}; pass a real config")
  kw = {**TINY[model_type], **overrides}
  # 'eager' is the per-expert loop of modeling_<family>.py: the reference
  # semantics, and deterministic on CPU.
  kw.setdefault("experts_implementation", "eager")
  return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str, seed: int = 0, init_std: Optional[float] = None,
               bias_std: float = 0.0, **overrides: Any):
  """A random tiny causal LM of ``model_type`` in eval mode, float32.

  ``init_std`` redraws every parameter as N(0, init_std) (transformers' own
  init is N(0, 0.02), under which routing is nearly uniform); ``bias_std``
  draws DeepSeek-V3's e_score_correction_bias as N(0, bias_std).
  """
  import torch
  from transformers import AutoModelForCausalLM

  cfg = tiny_config(model_type, **overrides)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    if init_std is not None:
      for name, p in model.named_parameters():
        if "norm" not in name:
          p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(torch.randn(b.shape, generator=gen) * bias_std)
  return model


def block_module(model: Any, layer: int):
  """The MoE block module of decoder layer ``layer`` (CausalLM or base model)."""
  family = fam.family_of(model.config)
  path = family.module_prefix.format(layer=layer)
  for cand in (path, path.removeprefix("model.")):
    try:
      return model.get_submodule(cand)
    except AttributeError:
      continue
  raise InteropError(f"{type(model).__name__} has no module {path!r}. Fix: pass a "
                     f"{family.model_type} causal LM or base model")


def text_to_ids(text: str, vocab_size: int) -> np.ndarray:
  """Byte-level ids int64[1, S] (UTF-8 bytes mod vocab_size): no tokenizer needed."""
  ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64) % vocab_size
  if ids.size == 0:
    raise ValueError("text_to_ids: empty text")
  return ids[None, :]


def capture_moe_io(model: Any, input_ids: Any,
                   layers: Optional[Sequence[int]] = None) -> dict[int, tuple]:
  """{layer: (x f32[B, S, d], y f32[B, S, d])}: each MoE block's input and output."""
  import torch

  chosen = fam.moe_layers(model.config) if layers is None else list(layers)
  got: dict[int, tuple] = {}

  def hook(i):
    def fn(_module, args, out):
      y = out[0] if isinstance(out, tuple) else out
      got[i] = (args[0].detach().float().numpy().copy(), y.detach().float().numpy().copy())
    return fn

  handles = [block_module(model, i).register_forward_hook(hook(i)) for i in chosen]
  try:
    with torch.no_grad():
      model(input_ids=torch.as_tensor(np.asarray(input_ids)))
  finally:
    for h in handles:
      h.remove()
  return got


def analyze_text(model: Any, text: str, *, layers: Optional[Sequence[int]] = None,
                 max_tokens: Optional[int] = None):
  """Routes ``text`` through the HF model and its imported MoE layers.

  Returns:
    (routings, errors, token_text): a LayerRouting per MoE layer (from the
    imported moejax layer fed with the HF block's captured input), the max
    abs difference of each layer's output from the HF block's, and the
    per-token text (one byte each, printable or escaped).
  """
  ids = text_to_ids(text, model.config.vocab_size)
  if max_tokens is not None:
    ids = ids[:, :max_tokens]
  io = capture_moe_io(model, ids, layers)
  sd = model.state_dict()
  routings, errors = [], {}
  raw = text.encode("utf-8")[: ids.shape[1]]
  token_text = [chr(b) if 32 <= b < 127 else f"\\x{b:02x}" for b in raw]
  for i, (x, y) in io.items():
    block = import_moe_block(sd, model.config, layer=i)
    lr = analysis.analyze_layer(block, x, name=f"layer {i}", token_ids=ids)
    errors[i] = float(np.max(np.abs(lr.output - y.reshape(lr.output.shape))))
    routings.append(lr)
  return routings, errors, token_text
