"""ModelConfig: the decoder-only transformer whose FFN slots are dense or MoE.

Every field here is one the model builds (:mod:`moejax.model`); published
architectures with parts the model does not implement (Switch's encoder)
keep those in the accounting section of their preset file
(:mod:`moejax.config.files`), where only the parameter and FLOP accounting
reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from moejax.config import registry as reg
from moejax.config.core import (ConfigError, check_choice, check_count, check_fraction,
                                check_number, check_positive)
from moejax.config.moe import MoEConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer.

  The FFN slots are dense (width dense_ff_width) or MoE by ``moe_layout``:
  ``all``, ``every_other`` (odd layers MoE) or ``first_dense`` (the first
  ``first_dense_layers`` dense, the rest MoE). Attention is a registered
  kind (``attention``): multi-head with grouped-query / multi-query variants
  through ``n_kv_heads``, or multi-head latent attention.

  compute_dtype: activation dtype (params stay float32; routers keep their
    own ``moe.routing.router_dtype``). rope_base: rotary frequency base.
  norm_eps: the epsilon of every RMSNorm (x / sqrt(mean(x^2) + eps) * scale);
    1e-6 by default, Mixtral's checkpoints use 1e-5 (an imported model keeps
    its own, so its logits are reproduced exactly).
  expert_sharing_group: consecutive MoE layers in groups of this size share
    their routed expert weights (each keeps its own router); 1 = no sharing.
  mod_every / mod_capacity / mod_gate / mod_aux_loss_coef: mixture-of-depths
    (Raposo et al. 2404.02258). Every ``mod_every``-th block (0: none, 1: all,
    2: blocks 1, 3, ...) processes only the top ``mod_capacity`` fraction of
    each sequence by a learned router score; the rest skip the block on the
    residual. Selected outputs are scaled by ``sigmoid`` (or ``raw``) router
    weight. ``mod_aux_loss_coef`` weights the paper's binary cross-entropy
    that teaches sigmoid(score) to predict top-k membership (the causal
    sampling fix; top-k over a sequence itself is not causal).
  moe_schedule: ``serial`` (the MoE FFN reads its own block's
    representation) or ``scmoe`` (Cai et al. 2404.05019, shortcut-connected:
    each MoE block's routed experts read the previous block's normalized FFN
    input, its shared experts the current one; see moejax.nn.scmoe). Same
    parameters and FLOPs as ``serial``.
  dense_twin: ``none``; ``active``: replace every MoE FFN by a dense FFN with
    the same active FFN parameters per token; ``total``: with the same total
    parameters. Resolved when the experiment config is built
    (:func:`moejax.model.dense_twin`): the built config has ``moe=None``,
    the dense width, and this label.
  remat: recompute each block's activations in the backward pass
    (``nnx.remat``) instead of storing them: less memory, ~1/3 more compute,
    the same update.
  attention / attention_options: a registered attention kind
    (:data:`moejax.config.registry.ATTENTIONS`: ``mha``, multi-head with
    GQA / MQA through n_kv_heads and Qwen3's per-head q / k RMSNorm through
    its option ``qk_norm``; ``mla``, DeepSeek-V2/V3 multi-head latent
    attention; :mod:`moejax.nn.attention_kinds`) and its own options, an
    instance of its spec's ``Options`` (None: its defaults).
  mtp_depth / mtp_loss_weight: multi-token prediction (DeepSeek-V3, arXiv
    2412.19437 Sec. 2.2): ``mtp_depth`` D sequential modules, module k
    predicting the token k + 1 positions after the next one, trained with
    loss weight lambda = ``mtp_loss_weight`` times the mean of the D
    modules' cross-entropies (:mod:`moejax.nn.mtp`). 0: none. Inference
    never runs them.
  mtp_ffn: the FFN of each MTP module's block: ``dense`` (``dense_ff_width``
    wide) or ``moe``, an MoE layer of ``moe`` as DeepSeek-V3's MTP layer has
    (its balance losses, bias controller and idea state are the main
    layers', under the names ``mtp_<k>``).
  """

  vocab_size: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  attention_bias: bool = False
  dense_ff_width: int = 1024
  dense_activation: str = "swiglu"
  moe_layout: str = "all"
  first_dense_layers: int = 0
  tie_embeddings: bool = False
  compute_dtype: str = "float32"
  rope_base: float = 10000.0
  norm_eps: float = 1e-6
  expert_sharing_group: int = 1
  mod_every: int = 0
  mod_capacity: float = 0.125
  mod_gate: str = "sigmoid"
  mod_aux_loss_coef: float = 0.0
  moe_schedule: str = "serial"
  dense_twin: str = "none"
  remat: bool = False
  attention: str = "mha"
  attention_options: Any = None
  mtp_depth: int = 0
  mtp_loss_weight: float = 0.3
  mtp_ffn: str = "dense"
  moe: Optional[MoEConfig] = dataclasses.field(default_factory=MoEConfig)

  @property
  def attention_spec(self):
    """The registered AttentionSpec of ``attention``."""
    return reg.ATTENTIONS.get(self.attention, "model.attention")

  @classmethod
  def build_field(cls, name: str, value: Any, data: Mapping[str, Any], where: str):
    """``attention_options`` from a mapping, typed by ``attention`` (from_dict's hook)."""
    if name == "attention_options" and (isinstance(value, Mapping) or hasattr(value, "to_dict")):
      spec = reg.ATTENTIONS.get(data.get("attention", cls.attention), "model.attention")
      return reg.options_from_dict(spec.Options, value, where, reg.ATTENTIONS,
                                   "model.attention")
    return None

  def config_dict_extras(self) -> dict:
    """Every other registered attention kind's options with their defaults, so
    ``--config.model.attention=mla --config.model.attention_options.kv_lora_rank=64``
    works on a file that names ``mha`` (a name two kinds default differently is left out)."""
    defaults: dict[str, Any] = {}
    clash = set()
    for name in reg.ATTENTIONS.names():
      if name == self.attention:
        continue
      opts = reg.ATTENTIONS.get(name).Options()
      for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if f.name in defaults and defaults[f.name] != value:
          clash.add(f.name)
        defaults.setdefault(f.name, value)
    return {"attention_options": {k: v for k, v in defaults.items() if k not in clash}}

  @property
  def kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  @property
  def attn_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  def is_moe_layer(self, i: int) -> bool:
    if self.moe is None:
      return False
    if self.moe_layout == "all":
      return True
    if self.moe_layout == "every_other":
      return i % 2 == 1
    return i >= self.first_dense_layers

  def is_mod_layer(self, i: int) -> bool:
    """Whether block i is a mixture-of-depths block."""
    return self.mod_every > 0 and i % self.mod_every == self.mod_every - 1

  def __post_init__(self):
    p = "model"
    spec = self.attention_spec
    if self.attention_options is None:
      # Normalised at construction, so every built config and config.json hold the instance.
      object.__setattr__(self, "attention_options", spec.Options())
    elif type(self.attention_options) is not spec.Options:
      raise ConfigError(f"{p}.attention_options", self.attention_options,
                        f"are not the options of model.attention={self.attention!r} "
                        f"({spec.Options.__module__}.{spec.Options.__name__})",
                        f"pass {spec.Options.__name__}(...) or attention_options=None for its "
                        "defaults")
    check_choice(f"{p}.compute_dtype", self.compute_dtype, reg.COMPUTE_DTYPES)
    check_choice(f"{p}.mod_gate", self.mod_gate, reg.MOD_GATES)
    check_choice(f"{p}.moe_layout", self.moe_layout, reg.MOE_LAYOUTS)
    check_choice(f"{p}.dense_activation", self.dense_activation, reg.ACTIVATIONS)
    check_choice(f"{p}.moe_schedule", self.moe_schedule, reg.MOE_SCHEDULES)
    check_choice(f"{p}.dense_twin", self.dense_twin, reg.DENSE_TWINS)
    check_choice(f"{p}.mtp_ffn", self.mtp_ffn, reg.MTP_FFNS)
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "dense_ff_width",
                 "expert_sharing_group"):
      check_count(f"{p}.{name}", getattr(self, name))
    for name in ("n_kv_heads", "head_dim"):
      if getattr(self, name) is not None:
        check_count(f"{p}.{name}", getattr(self, name))
    for name in ("first_dense_layers", "mod_every", "mtp_depth"):
      check_count(f"{p}.{name}", getattr(self, name), minimum=0)
    check_positive(f"{p}.rope_base", self.rope_base)
    check_number(f"{p}.norm_eps", self.norm_eps, minimum=0, maximum=1e-2, min_open=True,
                 fix="use a small positive epsilon such as 1e-6 or 1e-5")
    check_positive(f"{p}.mod_aux_loss_coef", self.mod_aux_loss_coef, allow_zero=True)
    check_positive(f"{p}.mtp_loss_weight", self.mtp_loss_weight, allow_zero=True)
    check_fraction(f"{p}.mod_capacity", self.mod_capacity,
                   fix="use the fraction of tokens a MoD block processes, e.g. 0.125")
    for rule in MODEL_RULES:
      rule(self)


def _sharing_needs_routed_experts(cfg: ModelConfig) -> None:
  if cfg.expert_sharing_group > 1 and (cfg.moe is None or not cfg.moe.layer.expert_bank):
    raise ConfigError("model.expert_sharing_group", cfg.expert_sharing_group,
                      "expert sharing needs routed experts (moe.kind sparse or soft)",
                      "set model.expert_sharing_group=1")


def _dense_layers_fit(cfg: ModelConfig) -> None:
  if cfg.first_dense_layers > cfg.n_layers:
    raise ConfigError("model.first_dense_layers", cfg.first_dense_layers,
                      f"exceeds model.n_layers={cfg.n_layers}", "use at most n_layers dense layers")


def _scmoe_needs_a_previous_block(cfg: ModelConfig) -> None:
  if cfg.moe_schedule != "scmoe":
    return
  if cfg.moe is None or not cfg.moe.layer.routed:
    raise ConfigError("model.moe_schedule", cfg.moe_schedule,
                      "ScMoE reschedules routed experts; it needs moe.kind='sparse'",
                      "set model.moe_schedule='serial' or configure a sparse moe")
  if cfg.is_moe_layer(0):
    raise ConfigError("model.moe_schedule", cfg.moe_schedule,
                      f"layer 0 is an MoE layer (moe_layout={cfg.moe_layout!r}) and has no "
                      "previous block to take the shortcut from",
                      "use moe_layout='every_other' (ScMoE's dense/MoE pairs) or "
                      "'first_dense' with first_dense_layers >= 1")
  if cfg.mod_every:
    raise ConfigError("model.mod_every", cfg.mod_every,
                      "mixture-of-depths blocks skip tokens, so a block's shortcut would not "
                      "cover every token", "set mod_every=0 with ScMoE")


def _moe_fields_need_moe(cfg: ModelConfig) -> None:
  if cfg.moe is not None:
    return
  for name, default in (("moe_layout", "all"), ("first_dense_layers", 0),
                        ("moe_schedule", "serial")):
    if getattr(cfg, name) != default:
      raise ConfigError(f"model.{name}", getattr(cfg, name),
                        "has no effect in a dense model (model.moe is None)",
                        f"remove it (default {default!r})")


def _moe_mtp_needs_moe(cfg: ModelConfig) -> None:
  if cfg.mtp_ffn == "moe" and cfg.moe is None:
    raise ConfigError("model.mtp_ffn", cfg.mtp_ffn, "builds the MTP blocks' FFN from "
                      "model.moe, and this model is dense (model.moe is None)",
                      "set mtp_ffn='dense' or configure model.moe")


def _attention_fits(cfg: ModelConfig) -> None:
  cfg.attention_spec.check(cfg, cfg.attention_options)


MODEL_RULES = (_attention_fits, _sharing_needs_routed_experts, _dense_layers_fit,
               _scmoe_needs_a_previous_block, _moe_fields_need_moe, _moe_mtp_needs_moe)
