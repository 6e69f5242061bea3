"""One MoE layer's config, shaped like the four planes.

::

    moe:
      kind          sparse | soft | peer (a registered layer kind)
      layer_options the kind's own options (Soft MoE's slots, PEER's keys)
      topology:     which experts exist (counts, widths, shared, zero-compute)
      routing:      which experts a token uses, with what weight
      balance:      losses, the bias controller, capacity and dropping
      execution:    how the expert computation runs (backend)

Each section checks its own fields; the rules that tie sections together
(``routing.top_k`` against ``topology.num_experts``, ...) are the named
functions of :mod:`moejax.config.rules`. Fine-grained segmentation and
shared-expert isolation (``topology.granularity`` / ``isolate_shared``) are
resolved when the config is built (:mod:`moejax.config.segmentation`): the
built config holds the resulting expert counts, widths and top-k, and
``topology.derived_from`` records what was applied.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from moejax.config import registry as reg
from moejax.config import rules, segmentation
from moejax.config.core import (ConfigError, check_choice, check_count, from_dict,
                                check_number, check_positive)


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  """The decision plane: which experts a token uses, with what weight.

  kind: a registered router (:data:`moejax.config.registry.ROUTERS`; the
    shipped ones: ``topk`` (token choice, covers Switch top-1, Mixtral, Qwen,
    DeepSeek-V2/V3/V4 and group-limited routing), ``expert_choice``,
    ``hash``, ``top_p`` (dynamic k) and ``hierarchical`` (families, then
    experts inside the chosen families); a plugin's own).
  options: the router's own options, an instance of its spec's ``Options``
    dataclass (expert choice's ``capacity``, top-p's ``top_p``, hierarchical's
    ``n_families`` / ``top_k_families``, hash's ``seed``, a plugin's fields).
    None means the kind's defaults; :attr:`opts` is always the instance.
    Configs built from dicts (every binary) hold the instance, so
    ``config.json`` and ``--print_config`` show it.
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
    Node- and device-limited routing (``parallel.route_limit``) is resolved
    into these fields when the experiment config is built.
  router_dtype: dtype of the router matmul and softmax (Switch's selective
    precision: keep float32 under bf16 activations).
  input_jitter: multiplicative uniform noise in [1-eps, 1+eps] on the router
    input, training only (Switch).
  logit_noise: std of additive Gaussian noise on the logits, training only.
  freeze: the router does not train: no gradient reaches its weights, the
    optimizer leaves them untouched (no weight decay) and the bias
    controller stops.
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
  router_dtype: str = "float32"
  input_jitter: float = 0.0
  logit_noise: float = 0.0
  freeze: bool = False
  options: Any = None

  @property
  def spec(self):
    """The registered RouterSpec of ``kind``."""
    return reg.ROUTERS.get(self.kind)

  @property
  def opts(self):
    """The router's options (its spec's defaults when ``options`` is None)."""
    return self.spec.Options() if self.options is None else self.options

  @classmethod
  def options_type(cls, data: Mapping[str, Any]) -> type:
    """The options class of the kind ``data`` names (the spec's ``Options``)."""
    return reg.ROUTERS.get(data.get("kind", cls.kind), "moe.routing.kind").Options

  @classmethod
  def build_field(cls, name: str, value: Any, data: Mapping[str, Any], where: str):
    """``options`` from a mapping, typed by ``kind`` (from_dict's hook; None otherwise)."""
    if name == "options" and (isinstance(value, Mapping) or hasattr(value, "to_dict")):
      return reg.options_from_dict(cls.options_type(data), value, where)
    return None

  @classmethod
  def build(cls, **fields) -> "RoutingConfig":
    """A RoutingConfig from flat fields: the router's own go to its options.

    ``RoutingConfig.build(kind='top_p', top_k=3, top_p=0.5)`` is
    ``RoutingConfig(kind='top_p', top_k=3, options=TopPOptions(top_p=0.5))``.
    """
    own = {f.name for f in dataclasses.fields(cls)}
    common = {k: v for k, v in fields.items() if k in own}
    extra = {k: v for k, v in fields.items() if k not in own}
    if extra:
      if common.get("options") is not None:
        raise ConfigError("moe.routing.options", common["options"],
                          f"given together with option fields {sorted(extra)}",
                          "give the options one way")
      common["options"] = extra
    return from_dict(cls, common, "moe.routing")

  @classmethod
  def complete(cls, kwargs: dict) -> dict:
    """What a built-from-dict config holds besides the given keys: the kind's options."""
    if "options" not in kwargs:
      kwargs = {**kwargs, "options": cls.options_type(kwargs)()}
    return kwargs

  def __post_init__(self):
    p = "moe.routing"
    spec = reg.ROUTERS.get(self.kind, f"{p}.kind")
    check_choice(f"{p}.score_fn", self.score_fn, reg.SCORE_FNS)
    check_choice(f"{p}.gating", self.gating, reg.GATINGS)
    check_choice(f"{p}.group_score", self.group_score, reg.GROUP_SCORES)
    check_choice(f"{p}.router_dtype", self.router_dtype, reg.ROUTER_DTYPES)
    for name in ("top_k", "n_groups", "topk_groups"):
      check_count(f"{p}.{name}", getattr(self, name))
    check_positive(f"{p}.routed_scaling_factor", self.routed_scaling_factor)
    check_number(f"{p}.input_jitter", self.input_jitter, minimum=0, maximum=1, max_open=True,
                 fix="use eps in [0, 1): the input is scaled by [1-eps, 1+eps] (Switch: 1e-2)")
    check_positive(f"{p}.logit_noise", self.logit_noise, allow_zero=True)
    if self.options is not None and type(self.options) is not spec.Options:
      raise ConfigError(f"{p}.options", self.options,
                        f"are not the options of routing.kind={self.kind!r} "
                        f"({spec.Options.__module__}.{spec.Options.__name__})",
                        f"pass {spec.Options.__name__}(...) or options=None for its defaults")
    if self.gating == "topk_softmax" and self.score_fn != "softmax":
      raise ConfigError(f"{p}.gating", self.gating,
                        f"softmax over the top-k logits needs score_fn='softmax', "
                        f"got {self.score_fn!r}",
                        "use gating='normalized' for sigmoid-family scores")
    if self.topk_groups > self.n_groups:
      raise ConfigError(f"{p}.topk_groups", self.topk_groups,
                        f"exceeds {p}.n_groups={self.n_groups}",
                        f"set {p}.topk_groups <= {p}.n_groups")
    if self.n_groups > 1 and not spec.supports_groups:
      raise ConfigError(f"{p}.n_groups", self.n_groups,
                        f"group-limited routing is a token-choice rule that "
                        f"routing.kind={self.kind!r} does not support",
                        f"set {p}.kind='topk' or {p}.n_groups=1")


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
  """The control plane: losses, the bias controller, capacity and dropping.

  aux_loss_coef / aux_loss_scope / aux_loss_convention: the load-balancing
    loss alpha * E * sum_i f_i P_i, computed on the router's decision
    *before* capacity drops (Switch eq. 4-5 counts every token's choice).
    Scope ``batch`` uses this micro-batch's statistics, ``sequence`` computes
    it per sequence and averages (DeepSeek-V3's sequence-wise loss),
    ``global`` reduces f_i over the mesh axes before the product (Qwen's
    LBL+sync). Convention ``switch`` counts each token's top-1 choice;
    ``topk`` counts every one of the K choices and scales by E / (K T)
    (DeepSeek).
  z_loss_coef: router z-loss (ST-MoE), 1e-3 there.
  device_loss_coef / comm_loss_coef / loss_num_devices: DeepSeek-V2's
    device-level and communication balance losses over ``loss_num_devices``
    contiguous expert groups.
  entropy_loss_coef: entropy of the router probabilities (top-p routing's
    sharpening loss).
  bias_update / bias_rate / bias_freeze_step: the aux-loss-free controller,
    applied once per optimizer step by the train step on the loads of the
    whole global batch (the router's decisions before capacity drops);
    ``sign`` b_i += u sign(mean c - c_i), ``proportional`` b_i += u (mean c -
    c_i) / mean c. It stops updating at ``bias_freeze_step`` (-1: never).
  extra_losses: ((name, coefficient), ...) of balance losses registered with
    ``moejax.balance.register_loss`` (a researcher's own), each added to the
    objective times its coefficient. Every loss in the objective, these and
    the shipped ones, is logged under its name (``balance/<name>``).
  capacity_factor: None for dropless; otherwise each FFN expert keeps at most
    ceil(cf * T * K / E) token copies and drops the rest by ``drop_priority``
    (``position``: slot-major, earlier tokens first; ``score``: highest gate
    first).
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
  capacity_factor: Optional[float] = None
  drop_priority: str = "position"
  extra_losses: tuple = ()

  def __post_init__(self):
    p = "moe.balance"
    check_choice(f"{p}.aux_loss_scope", self.aux_loss_scope, reg.AUX_SCOPES)
    check_choice(f"{p}.aux_loss_convention", self.aux_loss_convention, reg.AUX_CONVENTIONS)
    if self.bias_update != "none":  # "none": the controller is off
      reg.BIAS_RULES.get(self.bias_update, f"{p}.bias_update")
    check_choice(f"{p}.drop_priority", self.drop_priority, reg.DROP_PRIORITIES)
    for name in ("aux_loss_coef", "z_loss_coef", "device_loss_coef",
                 "comm_loss_coef", "entropy_loss_coef", "bias_rate"):
      check_positive(f"{p}.{name}", getattr(self, name), allow_zero=True)
    check_count(f"{p}.loss_num_devices", self.loss_num_devices)
    check_count(f"{p}.bias_freeze_step", self.bias_freeze_step, minimum=-1)
    if self.capacity_factor is not None:
      check_positive(f"{p}.capacity_factor", self.capacity_factor)
    for i, item in enumerate(self.extra_losses):
      if not (isinstance(item, tuple) and len(item) == 2):
        raise ConfigError(f"{p}.extra_losses", self.extra_losses,
                          f"entry {i} is {item!r}, not a (name, coefficient) pair",
                          "write extra_losses=(('my_loss', 1e-2),)")
      spec = reg.BALANCE_LOSSES.get(item[0], f"{p}.extra_losses")
      if spec.coef_field:
        raise ConfigError(f"{p}.extra_losses", item[0],
                          f"is a shipped loss with its own coefficient {p}.{spec.coef_field}",
                          f"set {p}.{spec.coef_field} instead")
      check_positive(f"{p}.extra_losses[{item[0]}]", item[1], allow_zero=True)
    names = [n for n, _ in self.extra_losses]
    if len(set(names)) != len(names):
      raise ConfigError(f"{p}.extra_losses", self.extra_losses, "names a loss twice",
                        "give each loss once")


@dataclasses.dataclass(frozen=True)
class TopologyConfig:
  """The object plane: which experts exist.

  num_experts E / expert_width f: routed FFN experts and their hidden width.
  expert_widths: optional per-expert widths (heterogeneous experts); when
    given, it has E entries and expert_width is ignored for routed experts.
  activation: ``swiglu`` or ``gelu`` expert FFNs.
  num_shared_experts / shared_expert_width / shared_expert_gate: always-on
    experts (DeepSeekMoE), optionally scaled by a learned sigmoid gate
    (Qwen-MoE); width defaults to expert_width.
  zero_experts / copy_experts / constant_experts: zero-computation experts
    (MoE++): routed like FFN experts, outputting 0, x, or a*x + b*v.
  granularity m / isolate_shared K_s: DeepSeekMoE's fine-grained
    segmentation (m E experts of width f / m, top m K) and shared-expert
    isolation (K_s of them always on, m K - K_s routed), at equal total and
    active parameters. Resolved when the config is built: the built config
    has the resulting counts and widths, these two fields back at 1 / 0, and
    ``derived_from`` saying what was applied.
  derived_from: written by that resolution (leave empty).
  """

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
  granularity: int = 1
  isolate_shared: int = 0
  derived_from: str = ""

  def __post_init__(self):
    p = "moe.topology"
    if isinstance(self.expert_widths, list):
      object.__setattr__(self, "expert_widths", tuple(self.expert_widths))
    check_choice(f"{p}.activation", self.activation, reg.ACTIVATIONS)
    for name in ("num_experts", "expert_width", "granularity"):
      check_count(f"{p}.{name}", getattr(self, name))
    for name in ("num_shared_experts", "zero_experts", "copy_experts", "constant_experts",
                 "isolate_shared"):
      check_count(f"{p}.{name}", getattr(self, name), minimum=0)
    if self.shared_expert_width is not None:
      check_count(f"{p}.shared_expert_width", self.shared_expert_width)
    if self.expert_widths is not None:
      if len(self.expert_widths) != self.num_experts:
        raise ConfigError(f"{p}.expert_widths", self.expert_widths,
                          f"has {len(self.expert_widths)} entries but "
                          f"{p}.num_experts={self.num_experts}",
                          "give one width per routed expert")
      for w in self.expert_widths:
        check_count(f"{p}.expert_widths", w)

  @property
  def num_zero_compute(self) -> int:
    return self.zero_experts + self.copy_experts + self.constant_experts


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
  """The execution plane: how the routed experts are computed.

  backend: ``auto`` (the default: the fastest backend verified on the
    platform the layer runs on, :func:`moejax.execution.gmm.resolve_backend`:
    ``blocked`` on CPU, ``ragged_dot`` elsewhere until a Pallas kernel is
    verified there), ``reference`` (every expert on every token, the oracle;
    only when asked for) or a grouped-matmul backend of
    :mod:`moejax.execution.gmm` (``blocked``, the fast portable path;
    ``ragged_dot``; ``pallas_tpu``; ``pallas_gpu``). Under expert
    parallelism the local experts use the same backend (``reference`` maps
    to ``ragged_dot`` there). Not part of a model's identity: a run may
    resume with another backend.
  interpret: run a Pallas backend in interpret mode (CPU tests).
  executor: the single-device executor (:data:`moejax.config.registry.EXECUTORS`):
    ``grouped`` (permute -> grouped matmul with ``backend``; the default),
    ``reference`` (the same as ``backend='reference'``) or one of your own.
    Under expert parallelism ``parallel.dispatch_unit`` names the executor.
  derived_from: written when ``auto`` is resolved for a platform
    (``"auto on cpu"``; :meth:`moejax.train.config.ExperimentConfig.for_platform`,
    which the binaries and the trainer apply), so ``--print_config`` and
    ``config.json`` say where the backend came from (leave empty).
  large_group_backend / large_group_rows: the shape rule. A call whose
    balanced group (token copies / experts) has at least
    ``large_group_rows`` rows runs ``large_group_backend`` instead of
    ``backend`` (:mod:`moejax.execution.shape_choice`). Empty / 0: every
    call runs ``backend``. Resolving ``auto`` fills both in from the chosen
    backend's ``auto_large_groups`` for the platform when it has one
    (none on CPU, where the tiled ``blocked`` loop measured faster at every
    shape; ``whole_group`` from 1024 rows on a GPU), so the resolved config
    records the rule and its threshold.
  """

  backend: str = reg.AUTO_BACKEND
  interpret: bool = False
  executor: str = reg.LOCAL_EXECUTOR
  derived_from: str = ""
  large_group_backend: str = ""
  large_group_rows: int = 0

  def __post_init__(self):
    if self.executor != reg.LOCAL_EXECUTOR:  # reading the registry imports the executors
      reg.check_executor("moe.execution.executor", self.executor, expert_parallel=False)
    if self.backend not in reg.EXPERT_BACKENDS:  # a plugin kernel: ask the registry
      check_choice("moe.execution.backend", self.backend, reg.expert_backend_names())
    check_count("moe.execution.large_group_rows", self.large_group_rows, minimum=0)
    if self.large_group_backend and self.large_group_backend not in reg.GMM_BACKENDS:
      check_choice("moe.execution.large_group_backend", self.large_group_backend,
                   reg.gmm_backend_names())
    if bool(self.large_group_backend) != (self.large_group_rows > 0):
      raise ConfigError("moe.execution.large_group_rows", self.large_group_rows,
                        f"goes with large_group_backend={self.large_group_backend!r}: "
                        "a shape rule needs both",
                        "set both (e.g. large_group_backend='whole_group', "
                        "large_group_rows=2048) or neither")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE layer: ``kind`` plus the topology, routing, balance and execution sections.

  kind: a registered layer kind (:data:`moejax.config.registry.LAYERS`; the
    shipped ones: ``sparse`` (routed experts), ``soft`` (Soft MoE slots) or
    ``peer`` (product-key retrieval over singleton experts); a plugin's own).
  layer_options: the kind's own options, an instance of its ``Options``
    dataclass (Soft MoE's ``slots_per_expert``; PEER's ``num_keys``,
    ``heads``, ``top_k``, ``key_dim``; none for ``sparse``). None means the
    kind's defaults; the built config always holds the instance, so
    ``config.json`` and ``--print_config`` show it.
  """

  kind: str = "sparse"
  layer_options: Any = None
  topology: TopologyConfig = dataclasses.field(default_factory=TopologyConfig)
  routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)
  balance: BalanceConfig = dataclasses.field(default_factory=BalanceConfig)
  execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)

  # Derived sizes every plane reads (from the resolved topology).
  @property
  def num_experts(self) -> int:
    """E: routed FFN experts."""
    return self.topology.num_experts

  @property
  def num_zero_compute(self) -> int:
    """Z: zero-computation experts (zero + copy + constant)."""
    return self.topology.num_zero_compute

  @property
  def num_routed(self) -> int:
    """E_r = E + Z: router outputs (FFN plus zero-computation experts)."""
    return self.num_experts + self.num_zero_compute

  @property
  def widths(self) -> tuple:
    """Hidden width of each routed FFN expert, length E."""
    t = self.topology
    return tuple(t.expert_widths) if t.expert_widths is not None else (
        (t.expert_width,) * t.num_experts)

  @property
  def layer(self):
    """The registered layer kind of ``kind`` (moejax.layer's LayerKind)."""
    return reg.LAYERS.get(self.kind)

  @classmethod
  def build_field(cls, name: str, value: Any, data: Mapping[str, Any], where: str):
    """``layer_options`` from a mapping, typed by ``kind`` (from_dict's hook; None otherwise)."""
    if name == "layer_options" and (isinstance(value, Mapping) or hasattr(value, "to_dict")):
      kind = reg.LAYERS.get(data.get("kind", cls.kind), "moe.kind")
      return reg.options_from_dict(kind.Options, value, where, reg.LAYERS, "moe.kind")
    return None

  def config_dict_extras(self) -> dict:
    """Every other registered layer kind's options with their defaults, so
    ``--config.model.moe.kind=peer --config.model.moe.layer_options.num_keys=8``
    works on a file that names ``sparse`` (a name two kinds default differently is left out)."""
    defaults: dict[str, Any] = {}
    clash = set()
    for name in reg.LAYERS.names():
      if name == self.kind:
        continue
      opts = reg.LAYERS.get(name).Options()
      for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if f.name in defaults and defaults[f.name] != value:
          clash.add(f.name)
        defaults.setdefault(f.name, value)
    return {"layer_options": {k: v for k, v in defaults.items() if k not in clash}}

  @property
  def router(self):
    """The registered router spec of ``routing.kind`` (``routing.spec``)."""
    return self.routing.spec

  @property
  def is_resolved(self) -> bool:
    """Whether the segmentation knobs have been applied (see :meth:`resolved`)."""
    return self.topology.granularity == 1 and self.topology.isolate_shared == 0

  def resolved(self) -> "MoEConfig":
    """A new config with ``topology.granularity`` / ``isolate_shared`` applied.

    Configs built from dicts (config files, ``config.json``, overrides) are
    resolved by :func:`moejax.config.core.from_dict`; one built in Python
    with these knobs calls this (``MoEConfig(...).resolved()``). Resolving
    a resolved config returns it unchanged.
    """
    return segmentation.resolve(self)

  def check_resolved(self, where: str) -> None:
    """ValueError when the segmentation knobs were never applied (they would be ignored)."""
    if not self.is_resolved:
      t = self.topology
      raise ValueError(f"{where}: moe.topology.granularity={t.granularity}, isolate_shared="
                       f"{t.isolate_shared} are not applied to this config. Fix: use "
                       f"cfg.resolved() (configs built from files are resolved)")

  def __post_init__(self):
    kind = reg.LAYERS.get(self.kind, "moe.kind")
    if self.layer_options is None:
      # Normalised at construction, so every built config and config.json hold the instance.
      object.__setattr__(self, "layer_options", kind.Options())
    elif type(self.layer_options) is not kind.Options:
      raise ConfigError("moe.layer_options", self.layer_options,
                        f"are not the options of moe.kind={self.kind!r} "
                        f"({kind.Options.__module__}.{kind.Options.__name__})",
                        f"pass {kind.Options.__name__}(...) or layer_options=None for its "
                        "defaults")
    rules.check_moe(self)
