"""Typed, frozen configuration for moejax, validated before any compute.

Every config class is a frozen dataclass whose ``__post_init__`` checks its
own fields and, for the classes that own sub-configs, the cross-field rules
(``moe.router.top_k`` against ``moe.num_experts``, groups dividing experts,
...). A failure raises :class:`ConfigError` with the dotted field name, the
offending value and a fix.

Configs are built from plain nested dicts (what an ``ml_collections``
``get_config()`` file produces) by :func:`from_dict`; an unknown key anywhere
in the tree is an error with a "did you mean" hint, never silently ignored.
:func:`apply_overrides` applies ``a.b.c=value`` style overrides the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Mapping, Optional

SCORE_FNS = ("softmax", "sigmoid", "sqrtsoftplus")
GATINGS = ("topk_softmax", "scores", "normalized")
ROUTER_KINDS = ("topk", "expert_choice", "hash", "top_p", "hierarchical")
GROUP_SCORES = ("auto", "top2_sum", "max")
# Kept in step with moejax.execution.gmm.BACKENDS (a test checks it); config
# must not import JAX-heavy modules.
EXPERT_BACKENDS = ("reference", "blocked", "ragged_dot", "pallas_tpu", "pallas_gpu")
LAYER_KINDS = ("sparse", "soft", "peer")
ACTIVATIONS = ("swiglu", "gelu")
AUX_SCOPES = ("batch", "sequence", "global")
AUX_CONVENTIONS = ("switch", "topk")
BIAS_UPDATES = ("none", "sign", "proportional")
DROP_PRIORITIES = ("position", "score")
ATTENTIONS = ("mha", "mla")
MOE_LAYOUTS = ("all", "every_other", "first_dense")
MOE_SCHEDULES = ("serial", "scmoe")


class ConfigError(ValueError):
  """A config value is invalid; the message names field, value and fix."""

  def __init__(self, field: str, value: Any, problem: str, fix: str):
    self.field, self.value = field, value
    super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


def check_choice(path: str, value: Any, choices: tuple) -> None:
  if value not in choices:
    hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    fix = f"use one of {', '.join(map(str, choices))}"
    if hint:
      fix = f"did you mean {hint[0]!r}? ({fix})"
    raise ConfigError(path, value, "unknown value", fix)


def check_positive(path: str, value: Any, allow_zero: bool = False) -> None:
  if value is None or (value < 0 if allow_zero else value <= 0):
    bound = ">= 0" if allow_zero else "> 0"
    raise ConfigError(path, value, f"must be {bound}", f"set {path} {bound}")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """The decision plane: which experts a token uses, with what weight.

  kind: ``topk`` (token choice, covers Switch top-1, Mixtral, Qwen,
    DeepSeek-V2/V3/V4 and group-limited routing), ``expert_choice``,
    ``hash``, ``top_p`` (dynamic k) or ``hierarchical`` (families, then
    experts inside the chosen families).
  score_fn: softmax | sigmoid | sqrtsoftplus, applied to the router logits.
  gating: how gate weights come from the selected experts' unbiased scores:
    ``topk_softmax`` softmax over the top-k logits (Mixtral);
    ``scores`` the scores as they are (Switch, Qwen norm_topk_prob=False);
    ``normalized`` scores divided by their sum over the selection (Qwen
    norm_topk_prob=True, DeepSeek-V3).
  routed_scaling_factor: multiplies the gates (DeepSeek-V3 uses 2.5).
  use_bias: select on score + bias (aux-loss-free balancing); the bias lives
    in the router state, never in the params.
  n_groups / topk_groups / group_score: group-limited routing (DeepSeek-V2/V3);
    ``auto`` means the sum of the top-2 scores with a bias, max without.
  expert_choice_capacity: c in k = T * c / E tokens per expert.
  top_p: cumulative-probability threshold for ``top_p``; top_k is its max k.
  n_families / top_k_families: hierarchical routing; experts are split into
    contiguous families of E / n_families and top_k experts are picked inside
    the top_k_families chosen families.
  hash_seed: seed of the balanced token-id -> expert table of ``hash``.
  router_dtype: dtype of the router matmul and softmax (Switch's selective
    precision: keep float32 under bf16 activations).
  input_jitter: multiplicative uniform noise in [1-eps, 1+eps] on the router
    input, training only (Switch).
  logit_noise: std of additive Gaussian noise on the logits, training only.
  freeze: no gradient flows into the router weights.
  """

  kind: str = "topk"
  score_fn: str = "softmax"
  top_k: int = 2
  gating: str = "normalized"
  routed_scaling_factor: float = 1.0
  use_bias: bool = False
  n_groups: int = 1
  topk_groups: int = 1
  group_score: str = "auto"
  expert_choice_capacity: float = 2.0
  top_p: float = 0.5
  n_families: int = 1
  top_k_families: int = 1
  hash_seed: int = 0
  router_dtype: str = "float32"
  input_jitter: float = 0.0
  logit_noise: float = 0.0
  freeze: bool = False

  def __post_init__(self):
    p = "moe.router"
    check_choice(f"{p}.kind", self.kind, ROUTER_KINDS)
    check_choice(f"{p}.score_fn", self.score_fn, SCORE_FNS)
    check_choice(f"{p}.gating", self.gating, GATINGS)
    check_choice(f"{p}.group_score", self.group_score, GROUP_SCORES)
    check_choice(f"{p}.router_dtype", self.router_dtype,
                  ("float32", "bfloat16", "float16"))
    check_positive(f"{p}.top_k", self.top_k)
    check_positive(f"{p}.routed_scaling_factor", self.routed_scaling_factor)
    check_positive(f"{p}.n_groups", self.n_groups)
    check_positive(f"{p}.topk_groups", self.topk_groups)
    check_positive(f"{p}.expert_choice_capacity", self.expert_choice_capacity)
    check_positive(f"{p}.n_families", self.n_families)
    check_positive(f"{p}.top_k_families", self.top_k_families)
    check_positive(f"{p}.input_jitter", self.input_jitter, allow_zero=True)
    check_positive(f"{p}.logit_noise", self.logit_noise, allow_zero=True)
    if self.input_jitter >= 1.0:
      raise ConfigError(f"{p}.input_jitter", self.input_jitter,
                        "jitter scales the input by [1-eps, 1+eps]",
                        "use eps < 1 (Switch used 1e-2)")
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f"{p}.top_p", self.top_p, "must be in (0, 1]",
                        "pick a cumulative-probability threshold such as 0.4")
    if self.gating == "topk_softmax" and self.score_fn != "softmax":
      raise ConfigError(f"{p}.gating", self.gating,
                        f"softmax over the top-k logits needs score_fn='softmax', "
                        f"got {self.score_fn!r}",
                        "use gating='normalized' for sigmoid-family scores")
    if self.topk_groups > self.n_groups:
      raise ConfigError(f"{p}.topk_groups", self.topk_groups,
                        f"exceeds {p}.n_groups={self.n_groups}",
                        f"set {p}.topk_groups <= {p}.n_groups")
    if self.top_k_families > self.n_families:
      raise ConfigError(f"{p}.top_k_families", self.top_k_families,
                        f"exceeds {p}.n_families={self.n_families}",
                        f"set {p}.top_k_families <= {p}.n_families")
    if self.n_groups > 1 and self.kind != "topk":
      raise ConfigError(f"{p}.n_groups", self.n_groups,
                        f"group-limited routing is a token-choice rule, not {self.kind!r}",
                        f"set {p}.kind='topk' or {p}.n_groups=1")
    if self.n_families > 1 and self.kind != "hierarchical":
      raise ConfigError(f"{p}.n_families", self.n_families,
                        f"families are only used by kind='hierarchical', not {self.kind!r}",
                        f"set {p}.kind='hierarchical' or {p}.n_families=1")
    if self.kind == "hierarchical" and self.n_families < 2:
      raise ConfigError(f"{p}.n_families", self.n_families,
                        "hierarchical routing needs at least 2 families",
                        f"set {p}.n_families >= 2")


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
  """The control plane: losses, the bias controller and capacity.

  aux_loss_coef / aux_loss_scope / aux_loss_convention: the load-balancing
    loss alpha * E * sum_i f_i P_i. Scope ``batch`` uses this micro-batch's
    statistics, ``sequence`` computes it per sequence and averages
    (DeepSeek-V3's sequence-wise loss), ``global`` reduces f_i over the mesh
    axes before the product (Qwen's LBL+sync). Convention ``switch`` counts
    each token's top-1 choice; ``topk`` counts every one of the K choices and
    scales by E / (K T) (DeepSeek).
  z_loss_coef: router z-loss (ST-MoE), 1e-3 there.
  device_loss_coef / comm_loss_coef / loss_num_devices: DeepSeek-V2's
    device-level and communication balance losses over ``loss_num_devices``
    contiguous expert groups.
  entropy_loss_coef: entropy of the router probabilities (top-p routing's
    sharpening loss).
  bias_update / bias_rate / bias_freeze_step: the aux-loss-free controller;
    ``sign`` b_i += u sign(mean c - c_i), ``proportional`` b_i += u (mean c -
    c_i) / mean c. It stops updating at ``bias_freeze_step`` (-1: never).
  """

  aux_loss_coef: float = 0.0
  aux_loss_scope: str = "batch"
  aux_loss_convention: str = "topk"
  z_loss_coef: float = 0.0
  device_loss_coef: float = 0.0
  comm_loss_coef: float = 0.0
  loss_num_devices: int = 1
  entropy_loss_coef: float = 0.0
  bias_update: str = "none"
  bias_rate: float = 1e-3
  bias_freeze_step: int = -1

  def __post_init__(self):
    p = "moe.balance"
    check_choice(f"{p}.aux_loss_scope", self.aux_loss_scope, AUX_SCOPES)
    check_choice(f"{p}.aux_loss_convention", self.aux_loss_convention, AUX_CONVENTIONS)
    check_choice(f"{p}.bias_update", self.bias_update, BIAS_UPDATES)
    for name in ("aux_loss_coef", "z_loss_coef", "device_loss_coef",
                 "comm_loss_coef", "entropy_loss_coef", "bias_rate"):
      check_positive(f"{p}.{name}", getattr(self, name), allow_zero=True)
    check_positive(f"{p}.loss_num_devices", self.loss_num_devices)
    if self.bias_freeze_step < -1:
      raise ConfigError(f"{p}.bias_freeze_step", self.bias_freeze_step,
                        "must be -1 (never freeze) or a step >= 0",
                        "use -1 or the step at which the bias stops updating")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE layer: topology, routing, balance and execution choices.

  kind: ``sparse`` (routed experts), ``soft`` (Soft MoE slots) or ``peer``
    (product-key retrieval over singleton experts).
  num_experts E / expert_width f: routed FFN experts and their hidden width.
  expert_widths: optional per-expert widths (heterogeneous experts); when
    given, it has E entries and expert_width is ignored for routed experts.
  num_shared_experts / shared_expert_width / shared_expert_gate: always-on
    experts (DeepSeekMoE), optionally scaled by a learned sigmoid gate
    (Qwen-MoE); width defaults to expert_width.
  zero_experts / copy_experts / constant_experts: zero-computation experts
    (MoE++): routed like FFN experts, outputting 0, x, or a*x + b*v.
  capacity_factor: None for dropless; otherwise each expert keeps at most
    ceil(cf * T * K / E) token copies and drops the rest by drop_priority.
  slots_per_expert: Soft MoE slots p per expert.
  peer_*: PEER, N = peer_num_keys**2 singleton experts, peer_heads heads,
    peer_top_k experts per head, peer_key_dim query width.
  backend: execution backend for the expert computation: ``reference`` (every
    expert on every token, the oracle) or a grouped-matmul backend of
    ``moejax.execution.gmm`` (``blocked``, the fast portable path;
    ``ragged_dot``; ``pallas_tpu``; ``pallas_gpu``).
  backend_interpret: run a Pallas backend in interpret mode (CPU tests).
  """

  kind: str = "sparse"
  num_experts: int = 8
  expert_width: int = 256
  expert_widths: Optional[tuple] = None
  activation: str = "swiglu"
  num_shared_experts: int = 0
  shared_expert_width: Optional[int] = None
  shared_expert_gate: bool = False
  zero_experts: int = 0
  copy_experts: int = 0
  constant_experts: int = 0
  capacity_factor: Optional[float] = None
  drop_priority: str = "position"
  slots_per_expert: int = 1
  peer_num_keys: int = 32
  peer_heads: int = 4
  peer_top_k: int = 8
  peer_key_dim: int = 128
  backend: str = "reference"
  backend_interpret: bool = False
  router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
  balance: BalanceConfig = dataclasses.field(default_factory=BalanceConfig)

  @property
  def num_zero_compute(self) -> int:
    return self.zero_experts + self.copy_experts + self.constant_experts

  @property
  def num_routed(self) -> int:
    """Router outputs: FFN experts plus zero-computation experts."""
    return self.num_experts + self.num_zero_compute

  @property
  def widths(self) -> tuple:
    """Hidden width of each routed FFN expert, length E."""
    if self.expert_widths is not None:
      return tuple(self.expert_widths)
    return (self.expert_width,) * self.num_experts

  def __post_init__(self):
    p, r, b = "moe", self.router, self.balance
    if isinstance(self.expert_widths, list):
      object.__setattr__(self, "expert_widths", tuple(self.expert_widths))
    check_choice(f"{p}.kind", self.kind, LAYER_KINDS)
    check_choice(f"{p}.activation", self.activation, ACTIVATIONS)
    check_choice(f"{p}.drop_priority", self.drop_priority, DROP_PRIORITIES)
    check_choice(f"{p}.backend", self.backend, EXPERT_BACKENDS)
    check_positive(f"{p}.num_experts", self.num_experts)
    check_positive(f"{p}.expert_width", self.expert_width)
    check_positive(f"{p}.slots_per_expert", self.slots_per_expert)
    for name in ("num_shared_experts", "zero_experts", "copy_experts", "constant_experts"):
      check_positive(f"{p}.{name}", getattr(self, name), allow_zero=True)
    if self.shared_expert_width is not None:
      check_positive(f"{p}.shared_expert_width", self.shared_expert_width)
    if self.capacity_factor is not None:
      check_positive(f"{p}.capacity_factor", self.capacity_factor)
    if self.expert_widths is not None:
      if len(self.expert_widths) != self.num_experts:
        raise ConfigError(f"{p}.expert_widths", self.expert_widths,
                          f"has {len(self.expert_widths)} entries but "
                          f"{p}.num_experts={self.num_experts}",
                          "give one width per routed expert")
      if any(w <= 0 for w in self.expert_widths):
        raise ConfigError(f"{p}.expert_widths", self.expert_widths,
                          "every width must be > 0", "drop the non-positive entries")
    if self.kind == "peer":
      for name in ("peer_num_keys", "peer_heads", "peer_top_k", "peer_key_dim"):
        check_positive(f"{p}.{name}", getattr(self, name))
      if self.peer_top_k > self.peer_num_keys:
        raise ConfigError(f"{p}.peer_top_k", self.peer_top_k,
                          f"exceeds {p}.peer_num_keys={self.peer_num_keys} "
                          "(top-k is taken per sub-key set)",
                          f"set {p}.peer_top_k <= {p}.peer_num_keys")
      if self.peer_key_dim % 2:
        raise ConfigError(f"{p}.peer_key_dim", self.peer_key_dim,
                          "the query is split into two halves for product keys",
                          "use an even key dimension")
      return
    if self.kind == "soft":
      if self.num_shared_experts or self.num_zero_compute or self.capacity_factor:
        raise ConfigError(f"{p}.kind", self.kind,
                          "Soft MoE has no token routing, so shared, zero-computation "
                          "experts and capacity do not apply",
                          "set them to 0/None or use kind='sparse'")
      return
    # Sparse layer: routing rules that depend on the expert count.
    e = self.num_routed
    if r.kind in ("topk", "hierarchical", "top_p") and r.top_k > e:
      raise ConfigError(f"{p}.router.top_k", r.top_k,
                        f"exceeds {p}.num_experts={self.num_experts}"
                        + (f" + {self.num_zero_compute} zero-computation experts"
                           if self.num_zero_compute else ""),
                        f"set {p}.router.top_k <= {e}")
    if r.n_groups > 1:
      if e % r.n_groups:
        raise ConfigError(f"{p}.router.n_groups", r.n_groups,
                          f"does not divide {p}.num_experts={e}",
                          f"pick n_groups among the divisors of {e}")
      per = (e // r.n_groups) * r.topk_groups
      if r.top_k > per:
        raise ConfigError(f"{p}.router.top_k", r.top_k,
                          f"exceeds the {per} experts left in topk_groups="
                          f"{r.topk_groups} groups of {e // r.n_groups}",
                          "raise topk_groups or lower top_k")
    if r.kind == "hierarchical":
      if e % r.n_families:
        raise ConfigError(f"{p}.router.n_families", r.n_families,
                          f"does not divide {p}.num_experts={e}",
                          f"pick n_families among the divisors of {e}")
      per = (e // r.n_families) * r.top_k_families
      if r.top_k > per:
        raise ConfigError(f"{p}.router.top_k", r.top_k,
                          f"exceeds the {per} experts inside top_k_families="
                          f"{r.top_k_families} families of {e // r.n_families}",
                          "raise top_k_families or lower top_k")
    if self.num_shared_experts and r.kind == "expert_choice":
      raise ConfigError(f"{p}.num_shared_experts", self.num_shared_experts,
                        "expert-choice routing already gives tokens a variable number "
                        "of experts; an always-on shared path is not defined for it here",
                        "set num_shared_experts=0 or use router.kind='topk'")
    if self.num_zero_compute and r.kind in ("expert_choice", "hash"):
      raise ConfigError(f"{p}.router.kind", r.kind,
                        "zero-computation experts need a router that scores them",
                        "use router.kind='topk' or 'top_p'")
    if self.capacity_factor is not None and r.kind == "expert_choice":
      raise ConfigError(f"{p}.capacity_factor", self.capacity_factor,
                        "expert choice sets its own per-expert capacity",
                        "use moe.router.expert_choice_capacity and capacity_factor=None")
    if r.use_bias and r.kind not in ("topk", "top_p"):
      raise ConfigError(f"{p}.router.use_bias", r.use_bias,
                        f"a selection bias is defined for token-choice routers, not {r.kind!r}",
                        "set use_bias=False or router.kind='topk'")
    if b.bias_update != "none" and not r.use_bias:
      raise ConfigError(f"{p}.balance.bias_update", b.bias_update,
                        "the controller updates a bias the router does not use",
                        f"set {p}.router.use_bias=True or bias_update='none'")
    if r.kind == "hash" and (b.aux_loss_coef or b.z_loss_coef):
      raise ConfigError(f"{p}.router.kind", r.kind,
                        "hash routing has no router parameters to balance",
                        "set balance.aux_loss_coef=0 and z_loss_coef=0")
    if b.loss_num_devices > 1 and self.num_experts % b.loss_num_devices:
      raise ConfigError(f"{p}.balance.loss_num_devices", b.loss_num_devices,
                        f"does not divide {p}.num_experts={self.num_experts}",
                        "pick a divisor of num_experts")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only (or, for Switch, encoder-decoder) transformer.

  The FFN slots are dense (width dense_ff_width) or MoE by ``moe_layout``:
  ``all``, ``every_other`` (odd layers MoE) or ``first_dense`` (the first
  ``first_dense_layers`` dense, the rest MoE). ``attention`` is ``mha``
  (covers GQA/MQA through n_kv_heads) or ``mla`` (DeepSeek multi-head latent
  attention). ``encoder_layers`` > 0 adds an encoder stack with the same
  layout and cross-attention in every decoder layer (T5 / Switch).

  compute_dtype: activation dtype (params stay float32; routers keep their
    own ``moe.router.router_dtype``). rope_base: rotary frequency base.
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
    input, its shared experts the current one, so the routed all-to-all can
    overlap the previous FFN and the current attention; see
    moejax.nn.scmoe). Same parameters and FLOPs as ``serial``.
  """

  vocab_size: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  attention: str = "mha"
  attention_bias: bool = False
  q_lora_rank: int = 0
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  dense_ff_width: int = 1024
  dense_activation: str = "swiglu"
  moe_layout: str = "all"
  first_dense_layers: int = 0
  encoder_layers: int = 0
  tie_embeddings: bool = False
  compute_dtype: str = "float32"
  rope_base: float = 10000.0
  expert_sharing_group: int = 1
  mod_every: int = 0
  mod_capacity: float = 0.125
  mod_gate: str = "sigmoid"
  mod_aux_loss_coef: float = 0.0
  moe_schedule: str = "serial"
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
    check_choice(f"{p}.compute_dtype", self.compute_dtype, ("float32", "bfloat16"))
    check_choice(f"{p}.mod_gate", self.mod_gate, ("sigmoid", "raw"))
    check_positive(f"{p}.rope_base", self.rope_base)
    check_positive(f"{p}.expert_sharing_group", self.expert_sharing_group)
    check_positive(f"{p}.mod_every", self.mod_every, allow_zero=True)
    check_positive(f"{p}.mod_aux_loss_coef", self.mod_aux_loss_coef, allow_zero=True)
    if not 0.0 < self.mod_capacity <= 1.0:
      raise ConfigError(f"{p}.mod_capacity", self.mod_capacity, "must be in (0, 1]",
                        "use the fraction of tokens a MoD block processes, e.g. 0.125")
    if self.expert_sharing_group > 1 and (self.moe is None or self.moe.kind == "peer"):
      raise ConfigError(f"{p}.expert_sharing_group", self.expert_sharing_group,
                        "expert sharing needs routed experts (moe.kind sparse or soft)",
                        f"set {p}.expert_sharing_group=1")
    check_choice(f"{p}.attention", self.attention, ATTENTIONS)
    check_choice(f"{p}.moe_layout", self.moe_layout, MOE_LAYOUTS)
    check_choice(f"{p}.dense_activation", self.dense_activation, ACTIVATIONS)
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "dense_ff_width"):
      check_positive(f"{p}.{name}", getattr(self, name))
    check_positive(f"{p}.first_dense_layers", self.first_dense_layers, allow_zero=True)
    check_positive(f"{p}.encoder_layers", self.encoder_layers, allow_zero=True)
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ConfigError(f"{p}.n_heads", self.n_heads,
                        f"does not divide {p}.d_model={self.d_model}",
                        f"pick a divisor of d_model or set {p}.head_dim")
    if self.n_heads % self.kv_heads:
      raise ConfigError(f"{p}.n_kv_heads", self.n_kv_heads,
                        f"does not divide {p}.n_heads={self.n_heads}",
                        "use a divisor of n_heads (grouped-query attention)")
    if self.first_dense_layers > self.n_layers:
      raise ConfigError(f"{p}.first_dense_layers", self.first_dense_layers,
                        f"exceeds {p}.n_layers={self.n_layers}",
                        "use at most n_layers dense layers")
    check_choice(f"{p}.moe_schedule", self.moe_schedule, MOE_SCHEDULES)
    if self.moe_schedule == "scmoe":
      if self.moe is None or self.moe.kind != "sparse":
        raise ConfigError(f"{p}.moe_schedule", self.moe_schedule,
                          "ScMoE reschedules routed experts; it needs moe.kind='sparse'",
                          f"set {p}.moe_schedule='serial' or configure a sparse moe")
      if self.is_moe_layer(0):
        raise ConfigError(f"{p}.moe_schedule", self.moe_schedule,
                          f"layer 0 is an MoE layer (moe_layout={self.moe_layout!r}) and "
                          "has no previous block to take the shortcut from",
                          "use moe_layout='every_other' (ScMoE's dense/MoE pairs) or "
                          "'first_dense' with first_dense_layers >= 1")
      if self.mod_every:
        raise ConfigError(f"{p}.mod_every", self.mod_every,
                          "mixture-of-depths blocks skip tokens, so a block's shortcut "
                          "would not cover every token", "set mod_every=0 with ScMoE")


# ---------------------------------------------------------------------------
# Building configs from dicts and overrides.

def unwrap_optional(tp):
  """Optional[X] -> X; anything else unchanged."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1:
      return args[0]
  return tp


def from_dict(cls, data: Mapping[str, Any] | None, path: str = ""):
  """Builds dataclass ``cls`` from a nested mapping; unknown keys are errors."""
  if data is None:
    return None
  if dataclasses.is_dataclass(data):
    return data
  if hasattr(data, "to_dict"):  # ml_collections.ConfigDict
    data = data.to_dict()
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  kwargs = {}
  for key, value in data.items():
    where = f"{path}.{key}" if path else key
    if key not in fields:
      close = difflib.get_close_matches(key, list(fields), n=1)
      fix = f"did you mean {close[0]!r}?" if close else (
          f"valid keys: {', '.join(sorted(fields))}")
      raise ConfigError(where, value, f"unknown key for {cls.__name__}", fix)
    tp = unwrap_optional(hints[key])
    if dataclasses.is_dataclass(tp) and isinstance(value, Mapping | type(None)) \
        or (dataclasses.is_dataclass(tp) and hasattr(value, "to_dict")):
      value = from_dict(tp, value, where)
    elif isinstance(value, list):
      value = tuple(value)
    kwargs[key] = value
  return cls(**kwargs)


def to_dict(cfg) -> dict:
  """The inverse of :func:`from_dict` (tuples stay tuples)."""
  return dataclasses.asdict(cfg)


def _parse_scalar(text: str):
  import ast
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a bare string such as sigmoid


def apply_overrides(cfg, overrides: Mapping[str, Any] | list[str]):
  """Returns ``cfg`` with ``{"moe.router.top_k": 4}`` (or ``["a.b=1"]``) applied.

  The result is validated like any config; a typo in a key is an error.
  """
  if isinstance(overrides, list):
    pairs = {}
    for item in overrides:
      if "=" not in item:
        raise ConfigError("override", item, "expected key=value", "write e.g. moe.router.top_k=4")
      k, v = item.split("=", 1)
      pairs[k.strip()] = _parse_scalar(v.strip())
    overrides = pairs
  tree = to_dict(cfg)
  for dotted, value in overrides.items():
    node, parts = tree, dotted.split(".")
    for i, part in enumerate(parts):
      here = ".".join(parts[: i + 1])
      if not isinstance(node, dict) or part not in node:
        keys = list(node) if isinstance(node, dict) else []
        close = difflib.get_close_matches(part, keys, n=1)
        raise ConfigError(here, value, "unknown override key",
                          f"did you mean {close[0]!r}?" if close else
                          f"valid keys here: {', '.join(sorted(keys))}")
      if i == len(parts) - 1:
        node[part] = value
      else:
        if node[part] is None:
          node[part] = {}
        node = node[part]
  return from_dict(type(cfg), tree)
