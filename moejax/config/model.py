"""ModelConfig: the decoder-only transformer whose FFN slots are dense or MoE.

Every field here is one the model builds (:mod:`moejax.model`); published
architectures with parts the model does not implement (DeepSeek's multi-head
latent attention, Switch's encoder) keep those in the accounting section of
their preset file (:mod:`moejax.config.files`), where only the parameter and
FLOP accounting reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from moejax.config import registry as reg
from moejax.config.core import (ConfigError, check_choice, check_count, check_fraction,
                                check_number, check_positive)
from moejax.config.moe import MoEConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer.

  The FFN slots are dense (width dense_ff_width) or MoE by ``moe_layout``:
  ``all``, ``every_other`` (odd layers MoE) or ``first_dense`` (the first
  ``first_dense_layers`` dense, the rest MoE). Attention is multi-head with
  grouped-query / multi-query variants through ``n_kv_heads``.

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
  moe: Optional[MoEConfig] = dataclasses.field(default_factory=MoEConfig)

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
    check_choice(f"{p}.compute_dtype", self.compute_dtype, reg.COMPUTE_DTYPES)
    check_choice(f"{p}.mod_gate", self.mod_gate, reg.MOD_GATES)
    check_choice(f"{p}.moe_layout", self.moe_layout, reg.MOE_LAYOUTS)
    check_choice(f"{p}.dense_activation", self.dense_activation, reg.ACTIVATIONS)
    check_choice(f"{p}.moe_schedule", self.moe_schedule, reg.MOE_SCHEDULES)
    check_choice(f"{p}.dense_twin", self.dense_twin, reg.DENSE_TWINS)
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "dense_ff_width",
                 "expert_sharing_group"):
      check_count(f"{p}.{name}", getattr(self, name))
    for name in ("n_kv_heads", "head_dim"):
      if getattr(self, name) is not None:
        check_count(f"{p}.{name}", getattr(self, name))
    for name in ("first_dense_layers", "mod_every"):
      check_count(f"{p}.{name}", getattr(self, name), minimum=0)
    check_positive(f"{p}.rope_base", self.rope_base)
    check_number(f"{p}.norm_eps", self.norm_eps, minimum=0, maximum=1e-2, min_open=True,
                 fix="use a small positive epsilon such as 1e-6 or 1e-5")
    check_positive(f"{p}.mod_aux_loss_coef", self.mod_aux_loss_coef, allow_zero=True)
    check_fraction(f"{p}.mod_capacity", self.mod_capacity,
                   fix="use the fraction of tokens a MoD block processes, e.g. 0.125")
    for rule in MODEL_RULES:
      rule(self)


def _sharing_needs_routed_experts(cfg: ModelConfig) -> None:
  if cfg.expert_sharing_group > 1 and (cfg.moe is None or not cfg.moe.layer.expert_bank):
    raise ConfigError("model.expert_sharing_group", cfg.expert_sharing_group,
                      "expert sharing needs routed experts (moe.kind sparse or soft)",
                      "set model.expert_sharing_group=1")


def _heads_divide(cfg: ModelConfig) -> None:
  if cfg.head_dim is None and cfg.d_model % cfg.n_heads:
    raise ConfigError("model.n_heads", cfg.n_heads,
                      f"does not divide model.d_model={cfg.d_model}",
                      "pick a divisor of d_model or set model.head_dim")
  if cfg.n_heads % cfg.kv_heads:
    raise ConfigError("model.n_kv_heads", cfg.n_kv_heads,
                      f"does not divide model.n_heads={cfg.n_heads}",
                      "use a divisor of n_heads (grouped-query attention)")
  if cfg.attn_head_dim % 2:
    raise ConfigError("model.head_dim", cfg.attn_head_dim,
                      "rotary embeddings rotate feature pairs, so the head width must be even",
                      "pick an even head_dim (or d_model / n_heads)")


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


MODEL_RULES = (_sharing_needs_routed_experts, _heads_divide, _dense_layers_fit,
               _scmoe_needs_a_previous_block, _moe_fields_need_moe)
