"""Attention kinds as registered ideas, chosen by ``model.attention``.

Each kind is an :class:`AttentionSpec` registered in
:data:`moejax.config.registry.ATTENTIONS`, with its own frozen ``Options``
dataclass (``model.attention_options``, checked when the config is built and
shown by ``--print_config``). The model builds a block's attention by asking
the spec (:meth:`AttentionSpec.build`); the parameter and FLOP accounting
(:mod:`moejax.topology.accounting`) and the serving memory
(:mod:`moejax.topology.memory`) ask it for its counts, so a kind is counted
from the same numbers the module it builds holds (the parameter audit,
:mod:`moejax.train.audit`, compares the two).

- ``mha``: rotary multi-head attention; grouped-query and multi-query through
  ``model.n_kv_heads``, head width ``model.head_dim``, biases by
  ``model.attention_bias``, Qwen3's per-head q / k RMSNorm by the option
  ``qk_norm`` (:class:`moejax.nn.attention.CausalSelfAttention`).
- ``mla``: DeepSeek-V2/V3 multi-head latent attention
  (:class:`moejax.nn.mla.LatentAttention`): low-rank KV compression with a
  decoupled rotary key, optionally a low-rank query; its cache holds the
  latent and the rotary key only.

Counting conventions (:mod:`moejax.topology.accounting`'s): ``params`` are
the projection weights of one layer (biases included), ``norm_params`` the
norms inside the attention (counted with the model's norms), ``mix_flops``
the QK^T and AV FLOPs of one token over S positions, ``cache_numbers`` the
numbers one token adds to one layer's cache.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flax import nnx

from moejax.config import ConfigError, check_count
from moejax.config.registry import ATTENTIONS
from moejax.nn.attention import CausalSelfAttention
from moejax.nn.mla import LatentAttention

if TYPE_CHECKING:
  from moejax.config import ModelConfig

OPTIONS_FIELD = "model.attention_options"


class AttentionSpec:
  """An attention kind: its options, what it costs, and how to build it.

  Capabilities: ``llama_layout``: its weights are Hugging Face's Llama-family
  attention (q / k / v / o projections, half-split rotary), what a whole-model
  export to Mixtral writes.
  """

  name = ""
  Options: type = None
  llama_layout = False

  def check(self, cfg: "ModelConfig", opts) -> None:
    """Raises ConfigError for model fields that do not fit this kind."""

  def params(self, cfg: "ModelConfig", opts) -> int:
    """Weights of one attention block (its norms excluded)."""
    raise NotImplementedError

  def norm_params(self, cfg: "ModelConfig", opts) -> int:
    """Norm scales inside one attention block."""
    return 0

  def matrices(self, cfg: "ModelConfig", opts) -> list[tuple]:
    """(I, O, count) of one block's projection matrices (biases not included)."""
    raise NotImplementedError

  def mix_flops(self, cfg: "ModelConfig", opts, seq_len: int) -> float:
    """QK^T and AV FLOPs of one token attending to ``seq_len`` positions."""
    raise NotImplementedError

  def cache_numbers(self, cfg: "ModelConfig", opts) -> int:
    """Numbers one token adds to one layer's KV cache."""
    raise NotImplementedError

  def options_from_architecture(self, arch):
    """This kind's options from a preset's accounting section (ArchitectureConfig)."""
    return self.Options(**{f.name: getattr(arch, f.name) for f in dataclasses.fields(self.Options)
                           if hasattr(arch, f.name)})

  def build(self, cfg: "ModelConfig", *, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """The attention module of one block (``__call__``, ``init_cache``, ``extend``)."""
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"<attention {self.name!r} ({type(self).__module__}.{type(self).__name__})>"


def register(spec: AttentionSpec) -> AttentionSpec:
  """Registers an attention kind (an instance); a name already registered is an error."""
  return ATTENTIONS.register(spec)


@dataclasses.dataclass(frozen=True)
class MHAOptions:
  """Multi-head attention's options (``model.attention_options`` with ``model.attention='mha'``);
  it also reads ``model.n_kv_heads``, ``head_dim`` and ``attention_bias``.

  Attributes:
    qk_norm: an RMSNorm over each head's query and key (one scale [H] for the
      queries, one for the keys, epsilon ``model.norm_eps``) before the
      rotation, as Qwen3 (and Qwen3-MoE) computes.
  """

  qk_norm: bool = False

  def __post_init__(self):
    if not isinstance(self.qk_norm, bool):
      raise ConfigError(f"{OPTIONS_FIELD}.qk_norm", self.qk_norm, "is not a bool",
                        "use true or false")


class MultiHead(AttentionSpec):
  """Rotary multi-head attention (GQA / MQA through ``model.n_kv_heads``)."""

  name = "mha"
  Options = MHAOptions
  llama_layout = True

  def check(self, cfg, opts):
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

  def params(self, cfg, opts):
    d, nh, h, kvh = cfg.d_model, cfg.n_heads, cfg.attn_head_dim, cfg.kv_heads
    params = d * nh * h + 2 * d * kvh * h + nh * h * d
    if cfg.attention_bias:
      params += nh * h + 2 * kvh * h + d
    return params

  def norm_params(self, cfg, opts):
    return 2 * cfg.attn_head_dim if opts.qk_norm else 0

  def matrices(self, cfg, opts):
    d, nh, h, kvh = cfg.d_model, cfg.n_heads, cfg.attn_head_dim, cfg.kv_heads
    return [(d, nh * h, 1), (d, kvh * h, 2), (nh * h, d, 1)]

  def mix_flops(self, cfg, opts, seq_len):
    return 2.0 * seq_len * cfg.n_heads * 2 * cfg.attn_head_dim

  def cache_numbers(self, cfg, opts):
    return 2 * cfg.kv_heads * cfg.attn_head_dim

  def build(self, cfg, *, dtype, rngs):
    return CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim,
                               use_bias=cfg.attention_bias, rope_base=cfg.rope_base,
                               qk_norm=cfg.attention_options.qk_norm, norm_eps=cfg.norm_eps,
                               dtype=dtype, rngs=rngs)


@dataclasses.dataclass(frozen=True)
class MLAOptions:
  """Multi-head latent attention's options (``model.attention_options`` with
  ``model.attention='mla'``); DeepSeek-V3's values are the defaults.

  Attributes:
    q_lora_rank: width r_q of the query latent (0: queries projected from x
      directly, as DeepSeek-V2-Lite).
    kv_lora_rank: width r_kv of the KV latent, what the cache holds per token.
    qk_nope_head_dim: per-head width of the content part of queries and keys.
    qk_rope_head_dim: width of the rotary part (per query head; one rotary
      key shared by the heads); even, as the rotation turns feature pairs.
    v_head_dim: per-head value width.
  """

  q_lora_rank: int = 0
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128

  def __post_init__(self):
    p = OPTIONS_FIELD
    check_count(f"{p}.q_lora_rank", self.q_lora_rank, minimum=0)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      check_count(f"{p}.{name}", getattr(self, name))


class LatentSpec(AttentionSpec):
  """DeepSeek-V2/V3 multi-head latent attention (:mod:`moejax.nn.mla`)."""

  name = "mla"
  Options = MLAOptions

  def check(self, cfg, opts):
    # MLA's head widths are its options; multi-head attention's fields would be ignored.
    for name in ("n_kv_heads", "head_dim"):
      if getattr(cfg, name) is not None:
        raise ConfigError(f"model.{name}", getattr(cfg, name),
                          "has no effect with model.attention='mla' (its head widths are "
                          f"{OPTIONS_FIELD}.qk_nope_head_dim / qk_rope_head_dim / v_head_dim)",
                          f"remove model.{name} from the config (a config file that sets it "
                          "cannot switch to 'mla' on the command line)")
    if opts.qk_rope_head_dim % 2:  # a model's check: the accounting counts odd widths too
      raise ConfigError(f"{OPTIONS_FIELD}.qk_rope_head_dim", opts.qk_rope_head_dim,
                        "rotary embeddings rotate feature pairs, so the rotary width must be "
                        "even", f"use {opts.qk_rope_head_dim + 1} (DeepSeek-V3: 64)")
    if cfg.attention_bias:
      raise ConfigError("model.attention_bias", True,
                        "multi-head latent attention has no projection biases",
                        "set model.attention_bias=False")

  def matrices(self, cfg, opts):
    d, nh, o = cfg.d_model, cfg.n_heads, opts
    qk = o.qk_nope_head_dim + o.qk_rope_head_dim
    q = ([(d, o.q_lora_rank, 1), (o.q_lora_rank, nh * qk, 1)] if o.q_lora_rank
         else [(d, nh * qk, 1)])
    return q + [(d, o.kv_lora_rank + o.qk_rope_head_dim, 1),
                (o.kv_lora_rank, nh * (o.qk_nope_head_dim + o.v_head_dim), 1),
                (nh * o.v_head_dim, d, 1)]

  def params(self, cfg, opts):
    return sum(i * o * c for i, o, c in self.matrices(cfg, opts))

  def norm_params(self, cfg, opts):
    return opts.kv_lora_rank + opts.q_lora_rank

  def mix_flops(self, cfg, opts, seq_len):
    d_qk = opts.qk_nope_head_dim + opts.qk_rope_head_dim
    return 2.0 * seq_len * cfg.n_heads * (d_qk + opts.v_head_dim)

  def cache_numbers(self, cfg, opts):
    return opts.kv_lora_rank + opts.qk_rope_head_dim

  def build(self, cfg, *, dtype, rngs):
    return LatentAttention(cfg.d_model, cfg.n_heads, cfg.attention_options,
                           norm_eps=cfg.norm_eps, rope_base=cfg.rope_base, dtype=dtype,
                           rngs=rngs)


for _spec in (MultiHead(), LatentSpec()):
  register(_spec)
