"""FinetuneConfig: where a run starts from and what of it trains; validated with the config.

The ``finetune`` section of an :class:`~moejax.train.config.ExperimentConfig`::

    finetune:
      source          ''  (a pre-training run) | a moejax workdir | a Hugging Face model dir
      source_format   moejax | hf
      source_step     -1 (the newest checkpoint) | a kept checkpoint step of the source
      freeze          components whose weights stay as the source's:
                      embeddings, norms, attention, dense, router, experts, mod, or all
      lora            components that train through LoRA adapters only:
                      attention, dense, experts
      lora_rank       r of every adapter (>= 1 with lora; 0 without)
      lora_alpha      adapters add (alpha / r) x A B; None: alpha = r (scale 1)
      controller      auto | on | frozen: the aux-loss-free bias controller
      upcycle         with source_format='upcycle' (a dense source made an MoE,
                      moejax.finetune.upcycle): split, noise, drop, renormalize,
                      router_init (:class:`UpcycleConfig`)

Components (:func:`component` classifies every parameter by its path):
``embeddings`` the token embedding and the LM head; ``norms`` the RMSNorm
scales; ``attention`` the q / k / v / o projections; ``dense`` the dense FFN
layers and a MoE layer's shared experts (dense FFNs every token passes
through); ``router`` the MoE routers (their selection bias is state, frozen
with them); ``experts`` the routed experts (with zero-computation and PEER
experts); ``mod`` mixture-of-depths routers. LoRA adapters always train.

Resolved when the experiment config is built (:func:`resolve_model`), so
``config.json`` says what runs and resolving again changes nothing:

- a frozen router (``freeze`` with ``router`` or ``all``) sets
  ``model.moe.routing.freeze``: no gradient, masked out of the optimizer,
  no bias-controller step (the one mechanism of :mod:`moejax.train.optim`);
- ``controller='frozen'`` sets ``model.moe.balance.bias_freeze_step=0``
  (the bias stays the source's, bit for bit, while the router trains);
  ``'on'`` sets it to -1 (the controller keeps balancing); ``'auto'`` keeps
  the model's own setting.

Every option that makes no sense for the model is one ConfigError line:
LoRA rank 0 with adapters, a rank without adapters, freezing or adapting a
component the model does not have (a router in a dense model), a controller
option without a controller, nothing left to train, any option without a
source.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from moejax.config import ConfigError, ModelConfig, check_choice, check_count, check_number

COMPONENTS = ("embeddings", "norms", "attention", "dense", "router", "experts", "mod")
FREEZE_CHOICES = COMPONENTS + ("all",)
LORA_TARGETS = ("attention", "dense", "experts")
CONTROLLERS = ("auto", "on", "frozen")
SOURCE_FORMATS = ("moejax", "hf", "upcycle")
ROUTER_INITS = ("fresh", "uniform")
ADAPTERS = "adapters"   # the component of every LoRA parameter


@dataclasses.dataclass(frozen=True)
class UpcycleConfig:
  """How a dense source becomes the run's MoE (``finetune.source_format='upcycle'``).

  Which layers become MoE, the number of experts, top-k and the gating are
  the run's model config (``model.moe_layout`` / ``first_dense_layers``,
  ``model.moe``); these fields say how the experts start:

  - ``split`` G: the dense FFN's hidden units are cut into G slices of
    width F / G (fine-grained upcycling: ``moe.topology.expert_width`` must
    be F / G); expert e starts as slice e mod G. 1: every expert is a copy
    of the whole dense FFN (Komatsuzaki et al. 2212.05055);
  - ``noise``: each expert's copy gets N(0, (noise x std(W))^2) added,
    independently per expert and tensor W (0: exact copies);
  - ``drop`` r (drop-upcycling, Nakamura et al. 2502.19261): in every
    expert, round(r x f) of its f hidden units, drawn per expert, are
    re-initialised: their W_gate / W_up columns and W_down rows are drawn
    from N(mean(W), std(W)^2) of the dense tensor W;
  - ``renormalize``: scale each expert's W_down by G / routed_scaling_factor,
    so that combine weights summing to 1 (gating ``normalized`` or
    ``topk_softmax``, required) give the dense FFN's output when the K
    chosen experts cover every slice K / G times: the first forward equals
    the dense model's (for G = 1 with any router; for G > 1 with
    ``router_init='uniform'``). False: weights copied unscaled, any gating;
  - ``router_init``: ``fresh`` (the model's own router initialisation) or
    ``uniform`` (zero router weights: every expert scores the same, the tie
    goes to experts 0..K-1, which cover each slice K / G times).
  """

  split: int = 1
  noise: float = 0.0
  drop: float = 0.0
  renormalize: bool = True
  router_init: str = "fresh"

  def __post_init__(self):
    p = "finetune.upcycle"
    check_count(f"{p}.split", self.split)
    check_number(f"{p}.noise", self.noise, minimum=0, maximum=10,
                 fix="use a relative noise std such as 0.01 (0: exact copies)")
    check_number(f"{p}.drop", self.drop, minimum=0, maximum=1,
                 fix="use the re-initialised fraction of each expert's hidden units, e.g. 0.5")
    if not isinstance(self.renormalize, bool):
      raise ConfigError(f"{p}.renormalize", self.renormalize, "must be True or False",
                        f"set {p}.renormalize=True (first forward = the dense model's)")
    check_choice(f"{p}.router_init", self.router_init, ROUTER_INITS)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
  """See the module docstring; the default (no source) is a run from scratch."""

  source: str = ""
  source_format: str = "moejax"
  source_step: int = -1
  freeze: tuple = ()
  lora: tuple = ()
  lora_rank: int = 0
  lora_alpha: Optional[float] = None
  controller: str = "auto"
  upcycle: UpcycleConfig = dataclasses.field(default_factory=UpcycleConfig)

  def __post_init__(self):
    p = "finetune"
    for name in ("freeze", "lora"):
      value = getattr(self, name)
      if isinstance(value, list):
        object.__setattr__(self, name, tuple(value))
      elif isinstance(value, str):
        raise ConfigError(f"{p}.{name}", value, "must be a tuple of names",
                          f"write {p}.{name}=('{value}',)")
    if not isinstance(self.source, str):
      raise ConfigError(f"{p}.source", self.source, "must be a path", "pass a directory")
    if not self.source:
      for f in dataclasses.fields(self):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name != "source" and getattr(self, f.name) != default:
          raise ConfigError(f"{p}.{f.name}", getattr(self, f.name),
                            "is a fine-tuning option, but finetune.source is empty (a run "
                            "from scratch)", "set finetune.source to the run (or Hugging "
                            "Face model directory) to fine-tune, or drop the option")
      return
    check_choice(f"{p}.source_format", self.source_format, SOURCE_FORMATS)
    check_count(f"{p}.source_step", self.source_step, minimum=-1)
    check_choice(f"{p}.controller", self.controller, CONTROLLERS)
    if self.source_format != "upcycle" and self.upcycle != UpcycleConfig():
      raise ConfigError(f"{p}.upcycle", self.upcycle, "sets upcycling options, but "
                        f"{p}.source_format={self.source_format!r} does not upcycle",
                        f"set {p}.source_format='upcycle' (a dense source made an MoE), or "
                        f"drop {p}.upcycle")
    for name, choices in (("freeze", FREEZE_CHOICES), ("lora", LORA_TARGETS)):
      value = getattr(self, name)
      for item in value:
        check_choice(f"{p}.{name}", item, choices)
      if len(set(value)) != len(value):
        raise ConfigError(f"{p}.{name}", value, "names a component twice", "list each once")
    check_count(f"{p}.lora_rank", self.lora_rank, minimum=0)
    if self.lora and self.lora_rank < 1:
      raise ConfigError(f"{p}.lora_rank", self.lora_rank,
                        f"LoRA adapters on {self.lora} need a rank of at least 1",
                        f"set {p}.lora_rank=8 (or drop {p}.lora)")
    if self.lora_rank and not self.lora:
      raise ConfigError(f"{p}.lora_rank", self.lora_rank, f"is ignored without {p}.lora",
                        f"name the adapted components, e.g. {p}.lora=('attention',), or set "
                        f"{p}.lora_rank=0")
    if self.lora_alpha is not None:
      ok = (isinstance(self.lora_alpha, (int, float)) and not isinstance(self.lora_alpha, bool)
            and math.isfinite(self.lora_alpha) and self.lora_alpha > 0)
      if not ok:
        raise ConfigError(f"{p}.lora_alpha", self.lora_alpha, "must be a finite number > 0",
                          "use e.g. the rank (scale 1) or 2x the rank")
      if not self.lora:
        raise ConfigError(f"{p}.lora_alpha", self.lora_alpha, f"is ignored without {p}.lora",
                          f"name the adapted components in {p}.lora, or drop {p}.lora_alpha")

  @property
  def enabled(self) -> bool:
    return bool(self.source)

  @property
  def lora_scale(self) -> float:
    """alpha / r (Hu et al. 2106.09685); 1 when lora_alpha is None."""
    if not self.lora:
      return 0.0
    return 1.0 if self.lora_alpha is None else float(self.lora_alpha) / self.lora_rank

  def frozen_components(self, model: Optional[ModelConfig] = None) -> frozenset:
    """Components whose base weights do not train: ``freeze`` (``all`` expanded), the LoRA
    targets' base weights, and the router of a model with ``routing.freeze``."""
    out = set(COMPONENTS) | {"other"} if "all" in self.freeze else set(self.freeze)
    out |= set(self.lora)
    if model is not None and model.moe is not None and model.moe.routing.freeze:
      out.add("router")
    return frozenset(out)


def present_components(model: ModelConfig) -> frozenset:
  """The components ``model`` has parameters for (see the module docstring)."""
  out = {"embeddings", "norms", "attention"}
  moe = model.moe
  dense_layers = any(not model.is_moe_layer(i) for i in range(model.n_layers))
  if dense_layers or (moe is not None and moe.topology.num_shared_experts):
    out.add("dense")
  if moe is not None:
    out.add("experts")
    if has_router(model):
      out.add("router")
  if model.mod_every:
    out.add("mod")
  return frozenset(out)


def has_router(model: ModelConfig) -> bool:
  """Whether the MoE layers have router weights (its layer kind says: sparse routers with
  parameters, Soft MoE)."""
  moe = model.moe
  return moe is not None and moe.layer.has_router_weights(moe)


def _why_absent(component: str, model: ModelConfig) -> str:
  if model.moe is None and component in ("router", "experts"):
    return "the model has no MoE layer (model.moe is None)"
  if component == "router":
    moe = model.moe
    kind = f"routing.kind={moe.routing.kind!r}" if moe.layer.routed else f"moe.kind={moe.kind!r}"
    return f"its MoE layers have no router weights ({kind})"
  if component == "dense":
    return "the model has no dense FFN layer and no shared expert"
  if component == "mod":
    return "the model has no mixture-of-depths block (model.mod_every=0)"
  return "the model has none"


def resolve_model(model: ModelConfig, ft: FinetuneConfig) -> ModelConfig:
  """``model`` with the fine-tuning options applied (see the module docstring).

  Raises ConfigError for an option the model cannot honour.
  """
  if not ft.enabled:
    return model
  if ft.source_format == "upcycle":
    check_upcycle_model(model, ft.upcycle)
  present = present_components(model)
  for name, wanted in (("freeze", ft.freeze), ("lora", ft.lora)):
    for comp in wanted:
      if comp != "all" and comp not in present:
        verb = "freezes" if name == "freeze" else "adapts"
        raise ConfigError(f"finetune.{name}", wanted, f"{verb} the {comp}, but "
                          f"{_why_absent(comp, model)}", f"remove {comp!r}")
  frozen = ft.frozen_components(None)
  router_frozen = "router" in frozen and "router" in present
  moe = model.moe
  if moe is not None and moe.routing.freeze and not router_frozen:
    raise ConfigError("model.moe.routing.freeze", True,
                      "freezes the router, but finetune.freeze does not say so",
                      "freeze it through finetune.freeze=('router', ...) (one switch)")
  if router_frozen and not moe.routing.freeze:
    moe = dataclasses.replace(moe, routing=dataclasses.replace(moe.routing, freeze=True))
  if ft.controller != "auto":
    has_controller = moe is not None and moe.layer.routed and moe.balance.bias_update != "none"
    if not has_controller:
      raise ConfigError("finetune.controller", ft.controller,
                        "the model has no aux-loss-free bias controller "
                        "(model.moe.balance.bias_update='none')",
                        "use finetune.controller='auto'")
    if ft.controller == "on" and router_frozen:
      raise ConfigError("finetune.controller", ft.controller,
                        "a frozen router's bias is frozen with it",
                        "use 'auto' or 'frozen', or let the router train")
    step = 0 if ft.controller == "frozen" else -1
    moe = dataclasses.replace(moe, balance=dataclasses.replace(moe.balance,
                                                               bias_freeze_step=step))
  trainable = (present - frozen) | ({ADAPTERS} if ft.lora else set())
  if not trainable:
    raise ConfigError("finetune.freeze", ft.freeze, "leaves nothing to train",
                      "freeze fewer components or add LoRA adapters (finetune.lora)")
  return model if moe is model.moe else dataclasses.replace(model, moe=moe)


def check_upcycle_model(model: ModelConfig, up: UpcycleConfig) -> None:
  """ConfigError unless ``model`` is an MoE a dense FFN can be upcycled into with ``up``.

  (The checks against the source itself, its widths and non-FFN fields, run
  when the source is opened: :mod:`moejax.finetune.upcycle`.)
  """
  fmt = "finetune.source_format"
  moe = model.moe
  if moe is None:
    raise ConfigError(fmt, "upcycle", "builds an MoE from a dense source, but model.moe is "
                      "None", "give the run's model an MoE section (model.moe: experts, top-k)")
  if not (moe.layer.routed and moe.layer.expert_bank):
    raise ConfigError(fmt, "upcycle", f"copies the dense FFN into routed experts, but "
                      f"model.moe.kind={moe.kind!r} has none", "use model.moe.kind='sparse'")
  top = moe.topology
  for field, value, bad, fix in (
      ("expert_widths", top.expert_widths, top.expert_widths is not None, "None (equal widths)"),
      ("num_shared_experts", top.num_shared_experts, top.num_shared_experts > 0, "0"),
      ("zero_experts", top.zero_experts, moe.num_zero_compute > 0,
       "0 (and copy_experts = constant_experts = 0)"),
  ):
    if bad:
      raise ConfigError(f"model.moe.topology.{field}", value,
                        "has no dense counterpart to start from when upcycling",
                        f"set it to {fix}, or fine-tune a source of this model")
  if model.expert_sharing_group != 1:
    raise ConfigError("model.expert_sharing_group", model.expert_sharing_group,
                      "shares experts across layers, but every upcycled layer starts from its "
                      "own dense FFN", "set model.expert_sharing_group=1")
  if moe.num_experts % up.split:
    raise ConfigError("finetune.upcycle.split", up.split, f"does not divide "
                      f"model.moe.topology.num_experts={moe.num_experts} (expert e starts as "
                      f"slice e mod split)", "use a divisor of the number of experts")
  if up.renormalize and moe.routing.gating == "scores":
    raise ConfigError("finetune.upcycle.renormalize", True, "needs combine weights that sum to "
                      "1, but model.moe.routing.gating='scores' does not renormalise them",
                      "set model.moe.routing.gating='normalized', or "
                      "finetune.upcycle.renormalize=False")


def component(keys) -> str:
  """The component of the parameter at path ``keys`` (strings) of the model's params tree.

  LoRA adapters (``.../lora/lora_a``, ``.../adapters/...``) are ``adapters``;
  anything unknown is ``other`` (trainable unless ``freeze`` has ``all``).
  """
  keys = [str(k) for k in keys]
  if any(k.startswith("lora") or k == "adapters" for k in keys):
    return ADAPTERS
  if keys and keys[0] in ("embed", "lm_head"):
    return "embeddings"
  if keys and keys[-1] == "scale" and any(k.endswith("norm") for k in keys):
    return "norms"
  if "attn" in keys:
    return "attention"
  if "params" in keys and keys.index("params") + 1 < len(keys):
    sub = keys[keys.index("params") + 1]  # MoEFFN.params: router, experts, shared, ...
    return {"router": "router", "shared": "dense"}.get(sub, "experts")
  if "ffn" in keys:
    return "dense"
  if "router" in keys:
    return "mod"
  return "other"
