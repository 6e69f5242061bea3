"""Whole DeepSeek-V3-family causal LMs <-> the moejax Transformer.

Legend: d model width, N heads, r_q / r_kv query / KV latent widths, h_n
content, h_r rotary, h_v value widths per head, L layers, D MTP depth.

What the import builds (:func:`model_config`):

- attention ``mla`` with ``attention_options`` from ``q_lora_rank`` (null:
  0), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``;
- the first ``first_k_dense_replace`` layers dense SwiGLU FFNs of width
  ``intermediate_size`` (``moe_layout='first_dense'``), the rest DeepSeek-V3
  MoE blocks (:mod:`moejax.interop.families`: sigmoid scores, the selection
  bias ``e_score_correction_bias`` as the router state's bias, ``n_group`` /
  ``topk_group`` group-limited selection, ``routed_scaling_factor``,
  ``n_shared_experts`` ungated shared experts);
- unscaled RoPE (``rope_type='default'``; YaRN is a one-line error).

The rotary layout: with ``rope_interleave`` (transformers' default, and how
DeepSeek's checkpoints are laid out) the rotary features of a query or key
pair up as (0, 1), (2, 3), ...; moejax's rotation pairs i with i + h_r / 2.
Both write their result in the half-split order, so permuting the rotary
rows of the query projection (``q_proj`` / ``q_b_proj``, per head) and of
``kv_a_proj_with_mqa`` to evens-then-odds on import (and back on export)
computes the same scores exactly. Without ``rope_interleave`` the rows are
copied as they are.

transformers normalises the two latents with epsilon 1e-6 whatever
``rms_norm_eps`` says, while moejax's MLA uses ``model.norm_eps`` there too,
so only ``rms_norm_eps=1e-6`` (DeepSeek-V3's) converts exactly.

Multi-token prediction: transformers builds none (it skips DeepSeek-V3's MTP
layer on load). An export leaves moejax's MTP modules out with one line
saying so (:mod:`moejax.interop.mtp_notes`) and writes
``num_nextn_predict_layers=0``. An import of a checkpoint that holds MTP
layers (decoder layers L .. L + D - 1, as DeepSeek releases them) keeps them
as moejax MTP modules (``model.mtp_depth``; the mapping is
:func:`_read_mtp`'s): an MoE FFN (DeepSeek-V3's own MTP layer) as an MoE
block (``model.mtp_ffn='moe'``) with its selection bias, a dense one as a
dense block.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping, Optional

import numpy as np

from moejax.config import ModelConfig
from moejax.interop import families as fam
from moejax.interop import models as whole
from moejax.interop import mtp_notes
from moejax.interop.errors import InteropError
from moejax.interop.qwen3_moe import dense_reader, dense_tensors
from moejax.nn.attention_kinds import MLAOptions

MODEL_TYPE = "deepseek_v3"
CAUSAL_LM = "DeepseekV3ForCausalLM"
# transformers' DeepseekV3RMSNorm default, which the q / kv latent norms use.
LATENT_EPS = 1e-6


def _check(hf: Any) -> None:
  """One-line errors for HF fields whose value moejax does not compute."""
  for name, ok in (("scoring_func", (None, "sigmoid")), ("topk_method", (None, "noaux_tc"))):
    value = fam.hf_get(hf, name, default=None)
    if value not in ok:
      raise InteropError(f"{name}={value!r}: moejax imports DeepSeek-V3's router (sigmoid "
                         f"scores, selection bias: scoring_func='sigmoid', topk_method="
                         f"'noaux_tc'). Fix: import a DeepSeek-V3 checkpoint, or drop {name} "
                         "from its config.json if it is DeepSeek-V3's router")
  if fam.hf_get(hf, "attention_bias", default=False):
    raise InteropError("attention_bias=True: moejax's multi-head latent attention has no "
                       "projection biases. Fix: import a checkpoint with attention_bias=false")
  eps = float(fam.hf_get(hf, "rms_norm_eps", default=LATENT_EPS))
  if eps != LATENT_EPS:
    raise InteropError(f"rms_norm_eps={eps!r}: transformers normalises DeepSeek-V3's q / kv "
                       f"latents with epsilon {LATENT_EPS} whatever rms_norm_eps says, and "
                       "moejax uses model.norm_eps for every norm, so the two cannot agree. "
                       f"Fix: import a checkpoint with rms_norm_eps={LATENT_EPS}")
  n = fam.hf_get(hf, "num_attention_heads")
  m = fam.hf_get(hf, "num_key_value_heads", default=None) or n
  if m != n:
    raise InteropError(f"num_key_value_heads={m} with num_attention_heads={n}: multi-head "
                       "latent attention expands one latent into every head. Fix: set "
                       f"num_key_value_heads={n}")


def options_from_hf(hf: Any) -> MLAOptions:
  return MLAOptions(q_lora_rank=fam.hf_get(hf, "q_lora_rank", default=None) or 0,
                    kv_lora_rank=fam.hf_get(hf, "kv_lora_rank"),
                    qk_nope_head_dim=fam.hf_get(hf, "qk_nope_head_dim"),
                    qk_rope_head_dim=fam.hf_get(hf, "qk_rope_head_dim"),
                    v_head_dim=fam.hf_get(hf, "v_head_dim"))


def model_config(hf: Any, base: ModelConfig) -> ModelConfig:
  """The ModelConfig computing a DeepSeek-V3-family model (see the module docstring)."""
  _check(hf)
  n_layers = fam.hf_get(hf, "num_hidden_layers")
  first = fam.hf_get(hf, "first_k_dense_replace", default=0) or 0
  if first > n_layers:
    raise InteropError(f"first_k_dense_replace={first} exceeds num_hidden_layers={n_layers}. "
                       "Fix: pass the model's own config")
  return dataclasses.replace(
      base, vocab_size=fam.hf_get(hf, "vocab_size"), d_model=fam.hf_get(hf, "hidden_size"),
      n_layers=n_layers, n_heads=fam.hf_get(hf, "num_attention_heads"), n_kv_heads=None,
      head_dim=None, attention="mla", attention_options=options_from_hf(hf),
      attention_bias=False, dense_ff_width=fam.hf_get(hf, "intermediate_size"),
      dense_activation="swiglu", moe_layout="first_dense" if first else "all",
      first_dense_layers=first, tie_embeddings=False, rope_base=whole.rope_theta(hf),
      norm_eps=LATENT_EPS, expert_sharing_group=1, mod_every=0, moe_schedule="serial",
      dense_twin="none", mtp_depth=0, moe=fam.moe_config_from_hf(hf, base.moe))


def _rope_order(h_r: int, interleaved: bool) -> np.ndarray:
  """moejax's rotary feature j is HF's feature order[j] (evens, then odds, if interleaved)."""
  if not interleaved:
    return np.arange(h_r)
  return np.concatenate([np.arange(0, h_r, 2), np.arange(1, h_r, 2)])


def _rows(w: np.ndarray, heads: int, keep: int, order: np.ndarray) -> np.ndarray:
  """w [heads * (keep + h_r), in] with each head's last h_r rows taken in ``order``."""
  w = np.asarray(w).reshape(heads, keep + len(order), -1)
  w = np.concatenate([w[:, :keep], w[:, keep:][:, order]], axis=1)
  return w.reshape(heads * (keep + len(order)), -1)


def _attention_reader(cfg: ModelConfig, interleaved: bool):
  o, d, n = cfg.attention_options, cfg.d_model, cfg.n_heads
  qk = o.qk_nope_head_dim + o.qk_rope_head_dim
  order = _rope_order(o.qk_rope_head_dim, interleaved)

  def read(get, cast) -> dict:
    k = lambda w: {"kernel": cast(np.asarray(w).T)}
    out = {}
    if o.q_lora_rank:
      out["q_a"] = k(get("self_attn.q_a_proj.weight", (o.q_lora_rank, d), "[r_q, d]"))
      out["q_norm"] = {"scale": cast(get("self_attn.q_a_layernorm.weight", (o.q_lora_rank,),
                                         "[r_q]"))}
      q = get("self_attn.q_b_proj.weight", (n * qk, o.q_lora_rank), "[N (h_n + h_r), r_q]")
      out["q_b"] = k(_rows(q, n, o.qk_nope_head_dim, order))
    else:
      q = get("self_attn.q_proj.weight", (n * qk, d), "[N (h_n + h_r), d]")
      out["q_proj"] = k(_rows(q, n, o.qk_nope_head_dim, order))
    kv_a = get("self_attn.kv_a_proj_with_mqa.weight", (o.kv_lora_rank + o.qk_rope_head_dim, d),
               "[r_kv + h_r, d]")
    out["kv_a"] = k(_rows(kv_a, 1, o.kv_lora_rank, order))
    out["kv_norm"] = {"scale": cast(get("self_attn.kv_a_layernorm.weight", (o.kv_lora_rank,),
                                        "[r_kv]"))}
    out["kv_b"] = k(get("self_attn.kv_b_proj.weight",
                        (n * (o.qk_nope_head_dim + o.v_head_dim), o.kv_lora_rank),
                        "[N (h_n + h_v), r_kv]"))
    out["o_proj"] = k(get("self_attn.o_proj.weight", (d, n * o.v_head_dim), "[d, N h_v]"))
    return out
  return read


def attention_tensors(attn: Mapping, cfg: ModelConfig) -> dict:
  """One layer's MLA weights under transformers' names (relative to ``self_attn.``), the
  rotary rows interleaved as DeepSeek's checkpoints hold them."""
  o, n = cfg.attention_options, cfg.n_heads
  back = np.argsort(_rope_order(o.qk_rope_head_dim, True))
  out = {}
  if o.q_lora_rank:
    out["q_a_proj.weight"] = whole.t(attn["q_a"]["kernel"])
    out["q_a_layernorm.weight"] = np.asarray(attn["q_norm"]["scale"])
    out["q_b_proj.weight"] = _rows(whole.t(attn["q_b"]["kernel"]), n, o.qk_nope_head_dim, back)
  else:
    out["q_proj.weight"] = _rows(whole.t(attn["q_proj"]["kernel"]), n, o.qk_nope_head_dim, back)
  out["kv_a_proj_with_mqa.weight"] = _rows(whole.t(attn["kv_a"]["kernel"]), 1, o.kv_lora_rank,
                                           back)
  out["kv_a_layernorm.weight"] = np.asarray(attn["kv_norm"]["scale"])
  out["kv_b_proj.weight"] = whole.t(attn["kv_b"]["kernel"])
  out["o_proj.weight"] = whole.t(attn["o_proj"]["kernel"])
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _mtp_layers(store, cfg: ModelConfig) -> list[int]:
  """Indices of the MTP layers the checkpoint holds (L, L + 1, ... while present)."""
  prefix = next(p for p in ("model.", "") if p + "embed_tokens.weight" in store)
  out, i = [], cfg.n_layers
  while f"{prefix}layers.{i}.eh_proj.weight" in store:
    out.append(i)
    i += 1
  return out


def _read_mtp(store, cfg: ModelConfig, dtype: Any, attn, dense, moe,
              router_state: dict) -> tuple[list[dict], str]:
  """The checkpoint's MTP layers as moejax MTP modules' params, and their FFN kind.

  DeepSeek's ``eh_proj`` [d, 2d] reads [enorm(embedding); hnorm(hidden)]; moejax's
  ``proj.kernel`` [2d, d] reads [hidden_norm(hidden); embed_norm(embedding)], so the two
  column halves swap. ``shared_head.norm`` is the module's head norm; DeepSeek's copies of
  the embedding and the head in the layer (``embed_tokens``, ``shared_head.head``) are the
  main model's, which moejax shares. A layer with ``mlp.gate`` has an MoE FFN (DeepSeek-V3's
  own; ``model.mtp_ffn='moe'``), read like a main layer's, its selection bias into
  ``router_state['mtp']``; one kind holds for all modules, so a later layer of the other
  kind is left out with a note.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  cast = lambda a: jnp.asarray(a, dtype)
  d = cfg.d_model
  prefix = next(p for p in ("model.", "") if p + "embed_tokens.weight" in store)
  modules, kind = [], "dense"
  for k, i in enumerate(_mtp_layers(store, cfg)):
    lp = f"{prefix}layers.{i}."
    this = "moe" if lp + "mlp.gate.weight" in store else "dense"
    if k == 0:
      kind = this
    elif this != kind:
      print(f"note: MTP layer {i} of this checkpoint has a {this} FFN and the ones before it "
            f"a {kind} one; moejax's MTP modules share one kind (model.mtp_ffn), so it and "
            "any later MTP layer are left out of the import", file=sys.stderr)
      break

    def get(key, want, why, lp=lp):
      w = np.asarray(store.get(lp + key))
      if tuple(w.shape) != tuple(want):
        raise InteropError(f"tensor {lp + key!r} has shape {w.shape}, expected {want} ({why}). "
                           "Fix: pass the config this checkpoint was saved with")
      return w
    if kind == "moe":
      ffn = moe(i, get, cast, prefix=lp + "mlp")
      router_state.setdefault("mtp", {})[k] = {"block": router_state["blocks"].pop(i)}
    else:
      ffn = dense(get, cast)
    eh = get("eh_proj.weight", (d, 2 * d), "[d, 2d]")
    scale = lambda key: {"scale": cast(get(key, (d,), "[d]"))}
    modules.append({
        "hidden_norm": scale("hnorm.weight"), "embed_norm": scale("enorm.weight"),
        "proj": {"kernel": cast(np.concatenate([eh[:, d:], eh[:, :d]], axis=1).T)},
        "head_norm": scale("shared_head.norm.weight"),
        "block": {"attn_norm": scale("input_layernorm.weight"), "attn": attn(get, cast),
                  "ffn_norm": scale("post_attention_layernorm.weight"), "ffn": ffn}})
  return modules, kind


def read(store, hf_config: Any, cfg: ModelConfig, dtype: Any) -> whole.ImportedModel:
  router_state: dict = {"blocks": {}}
  moe = whole.moe_ffn_reader(store, hf_config, cfg, dtype, router_state)
  dense = dense_reader(cfg)
  attn = _attention_reader(cfg, bool(fam.hf_get(hf_config, "rope_interleave", default=True)))
  ffn = lambda i, get, cast: moe(i, get, cast) if cfg.is_moe_layer(i) else dense(get, cast)
  params = whole.decoder_params(store, hf_config, cfg, dtype, ffn, CAUSAL_LM, attn=attn)
  mtp, kind = _read_mtp(store, cfg, dtype, attn, dense, moe, router_state)
  if mtp:
    params["mtp"] = dict(enumerate(mtp))
    cfg = dataclasses.replace(cfg, mtp_depth=len(mtp), mtp_ffn=kind)
  return whole.ImportedModel(cfg, params, router_state)


def hf_config(cfg: ModelConfig) -> dict:
  o = cfg.attention_options
  fields = fam.hf_fields_from_moe(cfg.moe, MODEL_TYPE, cfg.d_model)
  return {
      **fields, "architectures": [CAUSAL_LM], "vocab_size": cfg.vocab_size,
      "intermediate_size": cfg.dense_ff_width, "num_hidden_layers": cfg.n_layers,
      "first_k_dense_replace": cfg.first_dense_layers if cfg.moe_layout == "first_dense" else 0,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
      "q_lora_rank": o.q_lora_rank or None, "kv_lora_rank": o.kv_lora_rank,
      "qk_nope_head_dim": o.qk_nope_head_dim, "qk_rope_head_dim": o.qk_rope_head_dim,
      "v_head_dim": o.v_head_dim, "head_dim": o.qk_rope_head_dim, "rope_interleave": True,
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
      "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "attention_bias": False,
      "attention_dropout": 0.0, "max_position_embeddings": 4096, "torch_dtype": "float32",
      "dtype": "float32",
  }


def write(params: Mapping, router_state: Optional[Mapping], cfg: ModelConfig,
          layout: str) -> dict:
  mtp_notes.note_left_out(cfg, MODEL_TYPE)

  def layer(i, block):
    lp = f"model.layers.{i}."
    out = {f"{lp}self_attn.{k}": v for k, v in attention_tensors(block["attn"], cfg).items()}
    if cfg.is_moe_layer(i):
      return {**out, **whole.moe_block_tensors(block, router_state, cfg, MODEL_TYPE, i, layout)}
    return {**out, **dense_tensors(block["ffn"], lp)}
  return whole.decoder_tensors(params, cfg, layer)


def gaps(cfg: ModelConfig) -> list[str]:
  """What the model has outside its MoE blocks that DeepSeek-V3 lacks."""
  out = []
  if cfg.attention != "mla":
    out.append(f"model.attention={cfg.attention!r} (DeepSeek-V3 attends with multi-head "
               "latent attention: 'mla')")
  if cfg.moe is not None and cfg.moe_layout not in ("all", "first_dense"):
    out.append(f"model.moe_layout={cfg.moe_layout!r} (DeepSeek-V3's dense layers come first: "
               "'all' or 'first_dense')")
  if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)) \
     and cfg.dense_activation != "swiglu":
    out.append(f"model.dense_activation={cfg.dense_activation!r} (needs 'swiglu')")
  if cfg.norm_eps != LATENT_EPS:
    out.append(f"model.norm_eps={cfg.norm_eps!r} (transformers' latent norms use "
               f"{LATENT_EPS})")
  return out + whole.common_gaps(cfg)


SPEC = whole.register_whole_model(whole.WholeModel(
    MODEL_TYPE, CAUSAL_LM, model_config, read, hf_config, write, gaps,
    ("configs/deepseek_v3_small.py", "configs/default.py with DeepSeek-V3's multi-head latent "
     "attention (its MTP module is left out of an export)")))

__all__ = ["CAUSAL_LM", "MODEL_TYPE", "SPEC", "attention_tensors", "options_from_hf"]
