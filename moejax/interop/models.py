"""Whole Hugging Face causal LMs <-> the moejax Transformer (embeddings, attention, norms,
MoE blocks, head), for the families the Transformer expresses exactly: Mixtral here;
Qwen3-MoE (:mod:`moejax.interop.qwen3_moe`) and DeepSeek-V3
(:mod:`moejax.interop.deepseek_v3`) register their own :class:`WholeModel`.

Legend: V vocabulary, d model width, N query heads, M key/value heads, H head
width, L layers.

::

    imported = import_model("/models/tiny-mixtral")        # config.json + safetensors
    model = nnx.merge(graphdef_of(imported.cfg), imported.params, imported.router_state)
    sd, hf_config = export_model(params, router_state, model_cfg)   # back to Mixtral

:func:`model_config_from_hf` maps the HF config to a
:class:`~moejax.config.ModelConfig`: every layer a MoE block
(:func:`moejax.interop.families.moe_config_from_hf`), grouped-query
attention with ``head_dim``, RoPE with ``rope_theta`` in the half-split
layout both use, RMSNorm with ``rms_norm_eps`` (``model.norm_eps``), an
untied float32 head (a tied HF head becomes an untied copy: moejax's tied
head is scaled by d^-1/2). Fields that do not change the forward function
(balance losses, capacity, backend, remat) are kept from ``base``.

Tensor mapping (torch Linear weights are [out, in], moejax kernels [in,
out]): ``model.embed_tokens.weight`` [V, d] -> ``embed.embedding``;
``model.layers.{i}.input_layernorm.weight`` -> ``blocks.{i}.attn_norm.scale``;
``post_attention_layernorm`` -> ``ffn_norm``; ``self_attn.{q,k,v,o}_proj.weight``
-> ``attn.{q,k,v,o}_proj.kernel`` transposed; the MoE block through
:func:`moejax.interop.import_moe_block`; ``model.norm.weight`` ->
``final_norm.scale``; ``lm_head.weight`` [V, d] -> ``lm_head.kernel`` [d, V].
Every tensor is a transpose or a copy, so import -> export returns
bit-identical arrays.

Qwen2-MoE converts block by block (docs/interop.md), but not as a whole
model: it needs an attention the Transformer does not build, named by
:data:`MISSING` in the one-line error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig
from moejax.interop import families as fam
from moejax.interop import mtp_notes
from moejax.interop.convert import _resolve_config, export_moe_block, import_moe_block
from moejax.interop.errors import InteropError, TensorShapeError
from moejax.interop.tensors import TensorStore, open_source
from moejax.routing.topk import TopK

# model_type -> what the moejax Transformer lacks to compute it exactly.
MISSING = {
    "qwen2_moe": "attention with q/k/v biases but no output-projection bias "
                 "(model.attention_bias puts a bias on all four projections or none)",
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass(frozen=True)
class WholeModel:
  """How whole causal LMs of one Hugging Face family convert (Mixtral's is :data:`MIXTRAL`).

  Attributes:
    model_type: the HF ``config.model_type``.
    causal_lm: its transformers class (``architectures`` in config.json).
    model_config: (hf_config, base ModelConfig) -> the ModelConfig computing it.
    read: (store, hf_config, cfg, dtype) -> ImportedModel.
    hf_config: cfg -> the family's complete config.json dict (after :func:`hf_config_of`'s
      checks).
    write: (params, router_state, cfg, layout) -> the HF state dict.
    gaps: cfg -> what the model has outside its MoE blocks that the family lacks.
    export_config: (a shipped config, what it is and how to make it fit the family) for
      the export error's fix.
  """

  model_type: str
  causal_lm: str
  model_config: Callable[[Any, ModelConfig], ModelConfig]
  read: Callable[..., "ImportedModel"]
  hf_config: Callable[[ModelConfig], dict]
  write: Callable[..., dict]
  gaps: Callable[[ModelConfig], list]
  export_config: tuple


WHOLE_MODELS: dict[str, WholeModel] = {}


def register_whole_model(spec: WholeModel) -> WholeModel:
  """Adds (or replaces) the whole-model converter of ``spec.model_type``."""
  WHOLE_MODELS[spec.model_type] = spec
  return spec


def supported() -> tuple[str, ...]:
  """The model_types that convert as whole models."""
  return tuple(WHOLE_MODELS)


class ImportedModel(NamedTuple):
  """A converted model: ``nnx.merge(graphdef, params, router_state)`` of a Transformer(cfg)."""

  cfg: ModelConfig
  params: dict          # the pure-dict params of Transformer(cfg)
  router_state: dict    # its pure-dict router state (bias, step per MoE layer)


class ExportedModel(NamedTuple):
  state_dict: dict      # numpy tensors under transformers' names
  hf_config: dict       # a complete config.json for the family


def check_supported(model_type: Any) -> None:
  """InteropError in one line unless ``model_type`` converts as a whole model."""
  if model_type in WHOLE_MODELS:
    return
  if model_type in MISSING:
    raise InteropError(f"model_type={model_type!r}: the moejax Transformer cannot compute this "
                       f"model exactly; it lacks {MISSING[model_type]}. Fix: import its MoE "
                       f"blocks with moejax.interop.import_moe_block, or fine-tune a "
                       f"{' / '.join(supported())} model")
  fam.get_family(model_type)  # unknown families: the block converter's error
  raise InteropError(f"model_type={model_type!r} has no whole-model converter. Fix: use "
                     f"{', '.join(supported())}")


def rope_theta(hf: Any) -> float:
  params = fam.hf_get(hf, "rope_parameters", "rope_scaling", default=None) or {}
  if not isinstance(params, Mapping):
    params = dict(params)
  kind = params.get("rope_type", params.get("type", "default")) or "default"
  if kind != "default":
    raise InteropError(f"rope_type={kind!r}: moejax's rotary embedding is the unscaled one "
                       "(rope_type='default'). Fix: import a model without RoPE scaling")
  theta = params.get("rope_theta", fam.hf_get(hf, "rope_theta", default=None))
  return float(10000.0 if theta is None else theta)


def model_config_from_hf(hf_config: Any, base: Optional[ModelConfig] = None) -> ModelConfig:
  """The ModelConfig computing the HF model (see the module docstring)."""
  model_type = fam.hf_get(hf_config, "model_type")
  check_supported(model_type)
  return WHOLE_MODELS[model_type].model_config(hf_config, base or ModelConfig())


def llama_config(hf_config: Any, base: ModelConfig) -> ModelConfig:
  """Mixtral's ModelConfig: Llama-layout attention, every layer MoE (the module docstring)."""
  window = fam.hf_get(hf_config, "sliding_window", default=None)
  if window:
    raise InteropError(f"sliding_window={window}: moejax attention is full causal attention. "
                       "Fix: import a checkpoint without sliding-window attention "
                       "(Mixtral's own have sliding_window=null)")
  d = fam.hf_get(hf_config, "hidden_size")
  n = fam.hf_get(hf_config, "num_attention_heads")
  m = fam.hf_get(hf_config, "num_key_value_heads", default=None) or n
  h = fam.hf_get(hf_config, "head_dim", default=None) or d // n
  moe = fam.moe_config_from_hf(hf_config, base.moe)
  return dataclasses.replace(
      base, vocab_size=fam.hf_get(hf_config, "vocab_size"), d_model=d,
      n_layers=fam.hf_get(hf_config, "num_hidden_layers"), n_heads=n,
      n_kv_heads=None if m == n else m, head_dim=None if h * n == d else h,
      attention="mha", attention_options=None, mtp_depth=0,
      attention_bias=False, moe_layout="all", first_dense_layers=0, tie_embeddings=False,
      rope_base=rope_theta(hf_config), norm_eps=float(fam.hf_get(hf_config, "rms_norm_eps")),
      expert_sharing_group=1, mod_every=0, moe_schedule="serial", dense_twin="none", moe=moe)


def _prefix(store: TensorStore) -> str:
  for p in ("model.", ""):
    if p + "embed_tokens.weight" in store:
      return p
  raise InteropError("no embed_tokens.weight (model.embed_tokens.weight) in the checkpoint: "
                     "not a causal LM's state dict. Fix: pass the whole model's weights")


def import_model(source: Any, hf_config: Any = None, *, base: Optional[ModelConfig] = None,
                 dtype: Any = jnp.float32) -> ImportedModel:
  """A whole HF model (state dict, safetensors file or checkpoint directory) as moejax params.

  ``hf_config``: the HF config object or config.json dict (default: the
  directory's config.json); ``base``: a ModelConfig whose non-architecture
  fields the result keeps.
  """
  hf_config = _resolve_config(source, hf_config)
  cfg = model_config_from_hf(hf_config, base)
  family = WHOLE_MODELS[fam.hf_get(hf_config, "model_type")]
  return family.read(open_source(source), hf_config, cfg, dtype)


def moe_ffn_reader(store, hf_config: Any, cfg: ModelConfig, dtype: Any,
                   router_state: dict) -> Callable[[int, Callable, Callable], dict]:
  """``ffn(layer, get, cast)`` for :func:`decoder_params` reading layer's MoE block (its
  router state into ``router_state['blocks']``). ``prefix``: the block's key prefix, for a
  layer past the config's decoder layers (an MTP layer)."""

  def ffn(i: int, get, cast, prefix: Optional[str] = None) -> dict:
    where = dict(layer=i) if prefix is None else dict(prefix=prefix)
    block = import_moe_block(store, hf_config, base_cfg=cfg.moe, dtype=dtype, **where)
    router_state["blocks"][i] = {"ffn": {"router_state": {
        "bias": jnp.asarray(block.state.bias, jnp.float32),
        "step": jnp.asarray(block.state.step, jnp.int32)}}}
    return {"params": block.params}
  return ffn


def _read_mixtral(store, hf_config: Any, cfg: ModelConfig, dtype: Any) -> "ImportedModel":
  router_state: dict = {"blocks": {}}
  ffn = moe_ffn_reader(store, hf_config, cfg, dtype, router_state)
  params = decoder_params(store, hf_config, cfg, dtype, ffn, "MixtralForCausalLM")
  return ImportedModel(cfg, params, router_state)


def llama_attention(cfg: ModelConfig) -> Callable[[Callable, Callable], dict]:
  """``attn(get, cast)`` reading one layer's q / k / v / o projections (and Qwen3's q / k
  norms with ``qk_norm``)."""
  d, h, n, m = cfg.d_model, cfg.attn_head_dim, cfg.n_heads, cfg.kv_heads
  shapes = {"q_proj": (n * h, d), "k_proj": (m * h, d), "v_proj": (m * h, d),
            "o_proj": (d, n * h)}

  def attn(get, cast) -> dict:
    out = {name: {"kernel": cast(get(f"self_attn.{name}.weight", shapes[name],
                                     "[out, in]").T)} for name in ATTENTION}
    if getattr(cfg.attention_options, "qk_norm", False):
      for name in ("q_norm", "k_norm"):
        out[name] = {"scale": cast(get(f"self_attn.{name}.weight", (h,), "[head_dim]"))}
    return out
  return attn


def decoder_params(store, hf_config: Any, cfg: ModelConfig, dtype: Any,
                   ffn: Callable[[int, Callable, Callable], dict], causal_lm: str,
                   attn: Optional[Callable[[Callable, Callable], dict]] = None) -> dict:
  """moejax params of a whole HF decoder: embedding, norms and head read here, each
  block's ``ffn`` from ``ffn(layer, get, cast)`` (``get(key, shape, why)`` reads a
  tensor of the layer and checks its shape; ``cast`` converts to ``dtype``), its attention
  from ``attn(get, cast)`` (default: :func:`llama_attention`). ``causal_lm``: the HF class
  the missing-head error names."""
  p = _prefix(store)
  d, v = cfg.d_model, cfg.vocab_size
  attn = attn or llama_attention(cfg)

  def get(key: str, want: tuple, why: str) -> np.ndarray:
    w = store.get(key)
    if tuple(w.shape) != tuple(want):
      raise TensorShapeError(key, w.shape, want, why)
    return np.asarray(w)

  cast = lambda a: jnp.asarray(a, dtype)
  params: dict = {"embed": {"embedding": cast(get(p + "embed_tokens.weight", (v, d), "[V, d]"))},
                  "blocks": {}, "final_norm": {"scale": cast(get(p + "norm.weight", (d,),
                                                                  "[d]"))}}
  for i in range(cfg.n_layers):
    lp = f"{p}layers.{i}."
    layer_get = lambda key, want, why, lp=lp: get(lp + key, want, why)
    params["blocks"][i] = {
        "attn_norm": {"scale": cast(get(lp + "input_layernorm.weight", (d,), "[d]"))},
        "attn": attn(layer_get, cast),
        "ffn_norm": {"scale": cast(get(lp + "post_attention_layernorm.weight", (d,), "[d]"))},
        "ffn": ffn(i, layer_get, cast),
    }
  if "lm_head.weight" in store:
    head = get("lm_head.weight", (v, d), "[V, d]")
  elif fam.hf_get(hf_config, "tie_word_embeddings", default=False):
    head = np.asarray(params["embed"]["embedding"])  # tied: an untied copy (see import_model)
  else:
    raise InteropError("no lm_head.weight and tie_word_embeddings is false. Fix: pass the causal "
                       f"LM's weights ({causal_lm}), not the base model's")
  params["lm_head"] = {"kernel": cast(np.asarray(head).T)}
  return params


def common_gaps(cfg: ModelConfig) -> list[str]:
  """What the model has outside attention and its FFN layout that no whole-model family
  holds."""
  gaps = []
  for field, ok, what in (("attention_bias", not cfg.attention_bias, "False"),
                          ("tie_embeddings", not cfg.tie_embeddings, "False (moejax scales a "
                           "tied head by d^-1/2)"),
                          ("mod_every", cfg.mod_every == 0, "0"),
                          ("moe_schedule", cfg.moe_schedule == "serial", "'serial'"),
                          ("expert_sharing_group", cfg.expert_sharing_group == 1, "1")):
    if not ok:
      gaps.append(f"model.{field}={getattr(cfg, field)!r} (needs {what})")
  return gaps


def _mixtral_gaps(cfg: ModelConfig) -> list[str]:
  """What the model has outside its MoE blocks that Mixtral lacks."""
  gaps = []
  if cfg.moe is not None and not all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
    gaps.append(f"model.moe_layout={cfg.moe_layout!r} (every layer must be MoE)")
  if not cfg.attention_spec.llama_layout:
    gaps.append(f"model.attention={cfg.attention!r} (needs q / k / v / o projections: 'mha')")
  elif getattr(cfg.attention_options, "qk_norm", False):
    gaps.append("model.attention_options.qk_norm=True (Mixtral has no q / k norms)")
  return gaps + common_gaps(cfg)


def _block_gaps(cfg: ModelConfig, model_type: str) -> list[str]:
  """What the model's MoE blocks have that ``model_type``'s block lacks."""
  # The Hugging Face blocks' router is moejax's linear top-k (an object check:
  # a plugin router, even one derived from it, has no HF counterpart).
  if type(cfg.moe.router) is not TopK:
    return [f"model.moe.routing.kind={cfg.moe.routing.kind!r} (the Hugging Face blocks route "
            "with a linear top-k: kind='topk')"]
  return [f"model.{gap}" if gap.startswith("moe.") else gap
          for gap in fam.block_gaps(cfg.moe, model_type, cfg.d_model)]


def _other_families(cfg: ModelConfig, model_type: str) -> str:
  """Where the model's MoE blocks do fit, and why that family is no whole-model export."""
  if type(cfg.moe.router) is not TopK:
    return ""
  others = [f for f in fam.expressing_families(cfg.moe, cfg.d_model) if f != model_type]
  if not others:
    return ""
  whole = [f for f in others if f in WHOLE_MODELS]
  for f in whole:
    if not WHOLE_MODELS[f].gaps(cfg):
      return f" Its MoE blocks are {f} blocks and the rest fits: export it as model_type={f!r}."
  if whole:
    f = whole[0]
    return (f" Its MoE blocks are {' / '.join(others)} blocks (moejax.interop.export_moe_block "
            f"writes them one by one); as a whole {f} model it has "
            f"{'; '.join(WHOLE_MODELS[f].gaps(cfg))} ({WHOLE_MODELS[f].export_config[0]} is "
            "a model that fits).")
  lacks = "; ".join(f"{f}'s {MISSING[f]}" for f in others if f in MISSING)
  return (f" Its MoE blocks are {' / '.join(others)} blocks (moejax.interop.export_moe_block "
          f"writes them one by one), but no whole model of that family can be written: the "
          f"moejax Transformer lacks {lacks or 'its attention'}.")


def check_export_family(model_type: str) -> None:
  """InteropError in one line unless whole moejax models export as ``model_type``."""
  if model_type in WHOLE_MODELS:
    return
  if model_type in MISSING:
    first = supported()[0]
    raise InteropError(f"model_type={model_type!r}: a whole moejax model cannot be written as "
                       f"{model_type}: its attention is {MISSING[model_type]}, which the moejax "
                       f"Transformer lacks (its MoE blocks alone export: "
                       f"moejax.interop.export_moe_block). Fix: export as model_type="
                       f"{first!r} a model {first} expresses (e.g. a run of "
                       f"{WHOLE_MODELS[first].export_config[0]})")
  check_supported(model_type)   # an unknown family: its own error


def _check_exportable(cfg: ModelConfig, model_type: str) -> None:
  """One InteropError naming everything ``cfg`` has that ``model_type`` lacks, and the fix."""
  check_export_family(model_type)
  if cfg.moe is None or not cfg.moe.layer.routed:
    kind = None if cfg.moe is None else cfg.moe.kind
    gaps, other = [f"model.moe={'None' if kind is None else f'kind={kind!r}'}: no sparse MoE "
                   f"layer (a {model_type} model's MoE layers are sparse MoE blocks)"], ""
  else:
    gaps, other = _block_gaps(cfg, model_type), _other_families(cfg, model_type)
  gaps += WHOLE_MODELS[model_type].gaps(cfg)
  if gaps:
    path, what = WHOLE_MODELS[model_type].export_config
    raise InteropError(f"{model_type} cannot express this model: {'; '.join(gaps)}.{other} "
                       f"Fix: train a model with those fields as {model_type} has them and "
                       f"export that run ({path} is {what})")


def hf_config_of(cfg: ModelConfig, model_type: str = "mixtral") -> dict:
  """A complete HF config.json dict for ``cfg`` (InteropError if ``model_type`` cannot hold it)."""
  _check_exportable(cfg, model_type)
  return WHOLE_MODELS[model_type].hf_config(cfg)


def llama_fields(cfg: ModelConfig, model_type: str, causal_lm: str) -> dict:
  """The config.json of a Llama-layout MoE model (Mixtral, Qwen3-MoE): the MoE block's
  fields and the attention, norm, rotary and head fields."""
  fields = fam.hf_fields_from_moe(cfg.moe, model_type, cfg.d_model)
  return {
      **fields, "architectures": [causal_lm], "vocab_size": cfg.vocab_size,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attn_head_dim,
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
      "sliding_window": None, "tie_word_embeddings": False, "attention_dropout": 0.0,
      "max_position_embeddings": 4096, "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.0,
      "torch_dtype": "float32", "dtype": "float32",
  }


def export_model(params: Mapping, router_state: Optional[Mapping], cfg: ModelConfig,
                 model_type: str = "mixtral", layout: str = "checkpoint") -> ExportedModel:
  """A moejax Transformer's pure-dict params as a whole HF model (see the module docstring).

  ``params`` must be base weights (merge or split LoRA adapters first:
  :mod:`moejax.finetune.export`). ``layout``: ``checkpoint`` (per-expert
  tensors: released-file names, what ``from_pretrained`` reads) or ``fused``
  (transformers >= 5's in-memory module parameters).
  """
  hf_config = hf_config_of(cfg, model_type)
  return ExportedModel(WHOLE_MODELS[model_type].write(params, router_state, cfg, layout),
                       hf_config)


def t(a: Any) -> np.ndarray:
  """A moejax kernel [in, out] as a torch Linear weight [out, in]."""
  return np.ascontiguousarray(np.asarray(a).T)


def llama_attention_tensors(attn: Mapping, cfg: ModelConfig) -> dict:
  """One layer's q / k / v / o weights (and q / k norms with ``qk_norm``), keys relative to
  ``self_attn.``."""
  out = {f"{name}.weight": t(attn[name]["kernel"]) for name in ATTENTION}
  if getattr(cfg.attention_options, "qk_norm", False):
    out.update({f"{n}.weight": np.asarray(attn[n]["scale"]) for n in ("q_norm", "k_norm")})
  return out


def moe_block_tensors(block: Mapping, router_state: Optional[Mapping], cfg: ModelConfig,
                      model_type: str, i: int, layout: str) -> dict:
  """Layer ``i``'s MoE block under the family's full key names."""
  from moejax.routing.types import RouterState  # pylint: disable=g-import-not-at-top
  state = None
  if router_state is not None:
    rs = router_state["blocks"][i]["ffn"]["router_state"]
    state = RouterState(bias=jnp.asarray(rs["bias"]), step=jnp.asarray(rs["step"]))
  return export_moe_block(block["ffn"]["params"], state, cfg.moe, model_type, layer=i,
                          layout=layout).state_dict


def decoder_tensors(params: Mapping, cfg: ModelConfig,
                    layer: Callable[[int, Mapping], dict]) -> dict:
  """The HF state dict of a decoder: embedding, block norms, final norm and head here,
  each block's attention and FFN tensors from ``layer(i, block_params)`` (full keys)."""
  sd = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
        "model.norm.weight": np.asarray(params["final_norm"]["scale"]),
        "lm_head.weight": t(params["lm_head"]["kernel"])}
  for i in range(cfg.n_layers):
    block = params["blocks"][i]
    lp = f"model.layers.{i}."
    sd[lp + "input_layernorm.weight"] = np.asarray(block["attn_norm"]["scale"])
    sd[lp + "post_attention_layernorm.weight"] = np.asarray(block["ffn_norm"]["scale"])
    sd.update(layer(i, block))
  return sd


def _write_mixtral(params: Mapping, router_state: Optional[Mapping], cfg: ModelConfig,
                   layout: str) -> dict:
  mtp_notes.note_left_out(cfg, "mixtral")

  def layer(i, block):
    out = {f"model.layers.{i}.self_attn.{k}": v
           for k, v in llama_attention_tensors(block["attn"], cfg).items()}
    return {**out, **moe_block_tensors(block, router_state, cfg, "mixtral", i, layout)}
  return decoder_tensors(params, cfg, layer)


# configs/default.py's model routed as Mixtral routes: the export error's fix names it (the
# default model is what a new user has trained, and it routes DeepSeek-V3 style).
MIXTRAL = register_whole_model(WholeModel(
    "mixtral", "MixtralForCausalLM", llama_config, _read_mixtral,
    lambda cfg: llama_fields(cfg, "mixtral", "MixtralForCausalLM"), _write_mixtral,
    _mixtral_gaps, ("configs/default_mixtral.py", "configs/default.py routed as mixtral routes: "
                    "softmax top-2, no selection bias")))


__all__ = ["ExportedModel", "ImportedModel", "MISSING", "WHOLE_MODELS", "WholeModel",
           "check_export_family", "check_supported", "export_model", "hf_config_of",
           "import_model", "model_config_from_hf", "register_whole_model", "supported"]
