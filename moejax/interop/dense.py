"""Dense Hugging Face decoders -> a dense moejax Transformer (the sources of sparse upcycling).

Legend: V vocabulary, d model width, F dense hidden width, N / M query /
key-value heads, H head width.

The families whose attention the moejax Transformer computes exactly:
Mistral (Mixtral's dense sibling: the same attention, norms and RoPE, one
SwiGLU MLP per layer) and Llama (the same layout). Qwen2 and Qwen3 dense
models are refused in one line naming what the Transformer lacks (the same
gaps as their MoE siblings, :data:`moejax.interop.models.MISSING`).

Tensor mapping (torch Linear weights are [out, in], moejax kernels [in,
out]) as :mod:`moejax.interop.models`, plus the MLP:
``model.layers.{i}.mlp.{gate,up}_proj.weight`` [F, d] ->
``blocks.{i}.ffn.w_{gate,up}.kernel`` [d, F]; ``mlp.down_proj.weight``
[d, F] -> ``ffn.w_down.kernel`` [F, d]. Every tensor is a copy or a
transpose.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp

from moejax.config import ModelConfig
from moejax.interop import families as fam
from moejax.interop import models as whole
from moejax.interop.convert import _resolve_config
from moejax.interop.errors import InteropError
from moejax.interop.tensors import open_source

DENSE_SUPPORTED = ("mistral", "llama")
DENSE_MISSING = {"qwen2": whole.MISSING["qwen2_moe"],
                 "qwen3": "a dense reader of its per-head RMSNorm of queries and keys "
                          "(q_norm / k_norm; its MoE sibling qwen3_moe imports whole)"}
MLP = ("gate_proj", "up_proj", "down_proj")


class ImportedDense(NamedTuple):
  cfg: ModelConfig   # a dense model (moe=None)
  params: dict       # the pure-dict params of Transformer(cfg)


def check_dense_supported(model_type: Any) -> None:
  """InteropError in one line unless ``model_type`` is a dense family moejax computes exactly."""
  if model_type in DENSE_SUPPORTED:
    return
  if model_type in DENSE_MISSING:
    raise InteropError(f"model_type={model_type!r}: the moejax Transformer cannot compute this "
                       f"model exactly; it lacks {DENSE_MISSING[model_type]}. Fix: upcycle a "
                       f"{' / '.join(DENSE_SUPPORTED)} model")
  raise InteropError(f"model_type={model_type!r} is not a dense decoder moejax reads. Fix: use "
                     f"{', '.join(DENSE_SUPPORTED)} (or a MoE family with source_format='hf')")


def model_config_from_hf_dense(hf_config: Any, base: Optional[ModelConfig] = None) -> ModelConfig:
  """The dense ModelConfig computing the HF model (fields that do not change the forward
  function are kept from ``base``)."""
  check_dense_supported(fam.hf_get(hf_config, "model_type"))
  act = fam.hf_get(hf_config, "hidden_act", default="silu")
  if act != "silu":
    raise InteropError(f"hidden_act={act!r}: moejax's dense FFN is SwiGLU (silu) or GELU with a "
                       "single projection. Fix: upcycle a model with hidden_act='silu'")
  for flag in ("attention_bias", "mlp_bias"):
    if fam.hf_get(hf_config, flag, default=False):
      raise InteropError(f"{flag}=True: the moejax Transformer has bias-free attention "
                         "projections and FFNs. Fix: upcycle a model without biases")
  window = fam.hf_get(hf_config, "sliding_window", default=None)
  if window:
    raise InteropError(f"sliding_window={window}: moejax attention is full causal attention. "
                       "Fix: upcycle a checkpoint with sliding_window=null")
  d = fam.hf_get(hf_config, "hidden_size")
  n = fam.hf_get(hf_config, "num_attention_heads")
  m = fam.hf_get(hf_config, "num_key_value_heads", default=None) or n
  h = fam.hf_get(hf_config, "head_dim", default=None) or d // n
  base = base or ModelConfig()
  return dataclasses.replace(
      base, vocab_size=fam.hf_get(hf_config, "vocab_size"), d_model=d,
      n_layers=fam.hf_get(hf_config, "num_hidden_layers"), n_heads=n,
      n_kv_heads=None if m == n else m, head_dim=None if h * n == d else h,
      attention="mha", attention_options=None, mtp_depth=0,
      attention_bias=False, dense_ff_width=fam.hf_get(hf_config, "intermediate_size"),
      dense_activation="swiglu", moe_layout="all", first_dense_layers=0, tie_embeddings=False,
      rope_base=whole.rope_theta(hf_config),
      norm_eps=float(fam.hf_get(hf_config, "rms_norm_eps")), expert_sharing_group=1,
      mod_every=0, moe_schedule="serial", dense_twin="none", moe=None)


def import_dense_model(source: Any, hf_config: Any = None, *,
                       base: Optional[ModelConfig] = None, dtype: Any = jnp.float32
                       ) -> ImportedDense:
  """A whole dense HF decoder (checkpoint directory, safetensors file or state dict)."""
  hf_config = _resolve_config(source, hf_config)
  cfg = model_config_from_hf_dense(hf_config, base)
  f, d = cfg.dense_ff_width, cfg.d_model

  def ffn(_, get, cast) -> dict:
    kernel = lambda key, shape: {"kernel": cast(get(key, shape, "[out, in]").T)}
    return {"w_gate": kernel("mlp.gate_proj.weight", (f, d)),
            "w_up": kernel("mlp.up_proj.weight", (f, d)),
            "w_down": kernel("mlp.down_proj.weight", (d, f))}

  params = whole.decoder_params(open_source(source), hf_config, cfg, dtype, ffn,
                                "MistralForCausalLM")
  return ImportedDense(cfg, params)


__all__ = ["DENSE_MISSING", "DENSE_SUPPORTED", "ImportedDense", "check_dense_supported",
           "import_dense_model", "model_config_from_hf_dense"]
