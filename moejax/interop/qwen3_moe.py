"""Whole Qwen3-MoE causal LMs <-> the moejax Transformer.

Legend: d model width, N query heads, M key/value heads, H head width, L layers.

Qwen3-MoE is Mixtral's layout (:mod:`moejax.interop.models`) with three
differences, each a field of the ModelConfig the import builds:

- attention normalises each head's query and key by an RMSNorm of width H
  before the rotation (``self_attn.q_norm`` / ``k_norm``): ``mha`` with
  ``attention_options.qk_norm=True``, the scales in ``attn.q_norm`` /
  ``attn.k_norm``;
- the router is a softmax over the experts, top-K, renormalised iff
  ``norm_topk_prob``; there is no shared expert (the MoE block's own
  :mod:`moejax.interop.families` entry);
- layers listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``
  grid are dense SwiGLU FFNs of width ``intermediate_size``
  (``mlp.{gate,up,down}_proj``): ``moe_layout`` ``all``, ``every_other``
  (step 2) or ``first_dense`` (the first layers listed) hold them; other sets
  are a one-line error.

transformers has no multi-token prediction for Qwen3-MoE: an export leaves
MTP modules out with one line saying so (:func:`moejax.interop.mtp_notes.note_left_out`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from moejax.config import ModelConfig
from moejax.interop import families as fam
from moejax.interop import models as whole
from moejax.interop import mtp_notes
from moejax.interop.errors import InteropError
from moejax.nn.attention_kinds import MHAOptions

MODEL_TYPE = "qwen3_moe"
CAUSAL_LM = "Qwen3MoeForCausalLM"


def _plain(hf: Any) -> dict:
  """The config as a dict (the fields this module reads)."""
  if isinstance(hf, Mapping):
    return dict(hf)
  return hf.to_dict()


def layout_from_hf(hf: Any) -> dict:
  """``moe_layout`` / ``first_dense_layers`` of the MoE layers Qwen3's fields select."""
  n = fam.hf_get(hf, "num_hidden_layers")
  moe = set(fam.moe_layers(hf))
  if moe == set(range(n)):
    return {"moe_layout": "all", "first_dense_layers": 0}
  if moe == {i for i in range(n) if i % 2 == 1}:
    return {"moe_layout": "every_other", "first_dense_layers": 0}
  k = n - len(moe)
  if moe == set(range(k, n)):
    return {"moe_layout": "first_dense", "first_dense_layers": k}
  raise InteropError(
      f"mlp_only_layers={fam.hf_get(hf, 'mlp_only_layers', default=None)!r} with "
      f"decoder_sparse_step={fam.hf_get(hf, 'decoder_sparse_step', default=1)!r} makes layers "
      f"{sorted(moe)} MoE, which no moejax model.moe_layout holds. Fix: import a checkpoint "
      "whose MoE layers are all, the odd ones (decoder_sparse_step=2) or all after the first "
      "few (mlp_only_layers=[0, ..., k-1])")


def model_config(hf: Any, base: ModelConfig) -> ModelConfig:
  """The ModelConfig computing a Qwen3-MoE model (see the module docstring)."""
  plain = _plain(hf)
  if not plain.get("use_sliding_window", False):
    plain["sliding_window"] = None  # transformers ignores the window unless it is switched on
  if plain.get("attention_bias", False):
    raise InteropError("attention_bias=True: moejax's whole-model Qwen3-MoE import reads bias-free "
                       "projections, as Qwen3-MoE's released models have. Fix: import a "
                       "checkpoint with attention_bias=false")
  cfg = whole.llama_config(plain, base)
  return dataclasses.replace(
      cfg, attention="mha", attention_options=MHAOptions(qk_norm=True),
      dense_ff_width=fam.hf_get(plain, "intermediate_size"), dense_activation="swiglu",
      mtp_depth=0, **layout_from_hf(plain))


def dense_reader(cfg: ModelConfig):
  """``read(get, cast)`` of a dense SwiGLU FFN at ``mlp.{gate,up,down}_proj``."""
  f, d = cfg.dense_ff_width, cfg.d_model

  def read(get, cast) -> dict:
    kernel = lambda name, shape: {"kernel": cast(get(f"mlp.{name}.weight", shape, "[out, in]").T)}
    return {"w_gate": kernel("gate_proj", (f, d)), "w_up": kernel("up_proj", (f, d)),
            "w_down": kernel("down_proj", (d, f))}
  return read


def dense_tensors(ffn: Mapping, prefix: str) -> dict:
  """A dense SwiGLU FFN's params as ``{prefix}mlp.{gate,up,down}_proj.weight``."""
  return {f"{prefix}mlp.{hf}.weight": whole.t(ffn[ours]["kernel"])
          for hf, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down"))}


def read(store, hf_config: Any, cfg: ModelConfig, dtype: Any) -> whole.ImportedModel:
  router_state: dict = {"blocks": {}}
  moe = whole.moe_ffn_reader(store, hf_config, cfg, dtype, router_state)
  dense = dense_reader(cfg)
  ffn = lambda i, get, cast: moe(i, get, cast) if cfg.is_moe_layer(i) else dense(get, cast)
  params = whole.decoder_params(store, hf_config, cfg, dtype, ffn, CAUSAL_LM)
  return whole.ImportedModel(cfg, params, router_state)


def _layout_fields(cfg: ModelConfig) -> dict:
  if cfg.moe_layout == "every_other":
    return {"decoder_sparse_step": 2, "mlp_only_layers": []}
  dense = [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]
  return {"decoder_sparse_step": 1, "mlp_only_layers": dense}


def hf_config(cfg: ModelConfig) -> dict:
  out = whole.llama_fields(cfg, MODEL_TYPE, CAUSAL_LM)
  out.pop("sliding_window")
  return {**out, **_layout_fields(cfg), "intermediate_size": cfg.dense_ff_width,
          "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
          "output_router_logits": False}


def write(params: Mapping, router_state: Optional[Mapping], cfg: ModelConfig,
          layout: str) -> dict:
  mtp_notes.note_left_out(cfg, MODEL_TYPE)

  def layer(i, block):
    lp = f"model.layers.{i}."
    out = {f"{lp}self_attn.{k}": v
           for k, v in whole.llama_attention_tensors(block["attn"], cfg).items()}
    if cfg.is_moe_layer(i):
      return {**out, **whole.moe_block_tensors(block, router_state, cfg, MODEL_TYPE, i, layout)}
    return {**out, **dense_tensors(block["ffn"], lp)}
  return whole.decoder_tensors(params, cfg, layer)


def gaps(cfg: ModelConfig) -> list[str]:
  """What the model has outside its MoE blocks that Qwen3-MoE lacks."""
  out = []
  if not cfg.attention_spec.llama_layout:
    out.append(f"model.attention={cfg.attention!r} (needs q / k / v / o projections: 'mha')")
  elif not getattr(cfg.attention_options, "qk_norm", False):
    out.append("model.attention_options.qk_norm=False (Qwen3-MoE normalises queries and keys "
               "per head: True)")
  if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)) \
     and cfg.dense_activation != "swiglu":
    out.append(f"model.dense_activation={cfg.dense_activation!r} (needs 'swiglu')")
  return out + whole.common_gaps(cfg)


SPEC = whole.register_whole_model(whole.WholeModel(
    MODEL_TYPE, CAUSAL_LM, model_config, read, hf_config, write, gaps,
    ("configs/default_mixtral.py", "configs/default.py routed as qwen3_moe routes: softmax "
     "top-K, no selection bias; add --config.model.attention_options.qk_norm=true")))

__all__ = ["CAUSAL_LM", "MODEL_TYPE", "SPEC", "dense_reader", "dense_tensors", "layout_from_hf"]
