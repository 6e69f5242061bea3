"""TrainConfig and ExperimentConfig: what one training run is, validated early.

An experiment config file (``configs/*.py``) returns an ``ml_collections``
tree ``{model: ..., data: ..., train: ..., parallel: ...}``; :func:`experiment_from_dict`
turns it into a frozen :class:`ExperimentConfig` through
:func:`moejax.config.from_dict`, so an unknown key anywhere is an error with
a "did you mean" hint, and every value is checked (field, value, fix) before
a single array is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Mapping, Optional

from moejax.balance import capacity as capacity_lib
from moejax.config import (ConfigError, ModelConfig, ParallelConfig, check_choice, check_count,
                           check_experts, check_fraction, check_number, check_positive, from_dict,
                           resolve_route_limit, to_dict, unwrap_optional)
from moejax.config import registry as reg
from moejax.config.finetune import FinetuneConfig, resolve_model
from moejax.data import DataConfig, check_vocab_size
from moejax.execution import executor as executor_lib
from moejax.model import check_buildable, dense_twin


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The optimisation and bookkeeping of one run.

  Attributes:
    steps: optimizer steps in total (the batch size is ``data.batch_size``).
    learning_rate: peak learning rate, reached after ``warmup_steps`` of
      linear warmup from 0, then cosine-decayed to
      ``learning_rate * min_lr_ratio`` at ``steps``.
    weight_decay: AdamW decoupled weight decay, applied to matrices only
      (params with >= 2 dims: projections, experts, embeddings); norms scales
      and biases are not decayed, as in most LM recipes.
    b1 / b2 / eps: Adam moments.
    optimizer: a registered optimizer (:data:`moejax.config.registry.OPTIMIZERS`;
      shipped: ``adamw``, and ``muon`` on the hidden matrices with AdamW on
      the rest, :mod:`moejax.train.optimizers`). The learning rate, schedule,
      clipping and the AdamW fields above apply to every one.
    optimizer_options: the optimizer's own options, an instance of its
      spec's ``Options`` (Muon's momentum, Newton-Schulz steps, RMS scale);
      None at construction means its defaults, and the built config holds
      the instance, so ``config.json`` and ``--print_config`` show it.
    grad_clip: clip the global gradient norm to this (0: no clipping).
    seed: model initialisation and router noise.
    log_every: steps between metric lines (train metrics are averaged over
      the steps since the previous line).
    eval_every: steps between validation passes (0: only at the end).
    eval_batches: validation batches per periodic evaluation (None: the
      whole validation split). The final evaluation always reads the whole
      split.
    checkpoint_every: steps between checkpoints (0: only at the end).
    keep_checkpoints: how many recent checkpoints to keep.
    progress: print a progress line with ETA at each log step.
    nan_at_step: test hook: make the loss of step s (1-based, as logged)
      NaN (-1: off), to exercise the non-finite-loss guard.
    microbatches: gradient accumulation: each step's batch is split into this
      many equal micro-batches whose gradients (and router loads) are summed
      before one optimizer update and one bias-controller update. The update
      equals the one-batch update up to float rounding for losses that are
      per-token or per-sequence (cross-entropy, z-loss, sequence-scope
      balance loss); a ``batch``- or ``global``-scope balance loss is
      computed per micro-batch, as in every framework.
    peak_tflops: the peak TFLOP/s of one device that MFU is measured against
      (None: the device's datasheet peak for model.compute_dtype from
      moejax.train.mfu's table, else this machine's calibration cached by
      ``python -m experiments.bench --suite=peak``, else MFU is n/a).
    profile_steps: ``(a, b)``: write a ``jax.profiler`` trace of steps a+1 .. b
      (from the end of step a to the end of step b; a >= 1 keeps the
      compiling first step out) under ``WORKDIR/profile`` (None: no trace).
    wandb_project: also log to this Weights & Biases project, with the names
      TensorBoard gets (empty: no W&B; needs the ``wandb`` extra;
      :mod:`moejax.train.wandb_sink`).
    wandb_mode: ``offline`` (written under ``WORKDIR/wandb``, uploaded later
      with ``wandb sync``) or ``online``.
  """

  steps: int = 1000
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0
  seed: int = 0
  log_every: int = 20
  eval_every: int = 0
  eval_batches: Optional[int] = None
  checkpoint_every: int = 0
  keep_checkpoints: int = 2
  progress: bool = True
  nan_at_step: int = -1
  microbatches: int = 1
  peak_tflops: Optional[float] = None
  profile_steps: Optional[tuple] = None
  optimizer: str = "adamw"
  optimizer_options: Any = None
  wandb_project: str = ""
  wandb_mode: str = "offline"

  @property
  def optimizer_spec(self):
    """The registered OptimizerSpec of ``optimizer``."""
    return reg.OPTIMIZERS.get(self.optimizer, "train.optimizer")

  @property
  def opts(self):
    """The optimizer's options (an instance of its spec's ``Options``)."""
    return self.optimizer_options

  @classmethod
  def build_field(cls, name: str, value: Any, data: Mapping[str, Any], where: str):
    """``optimizer_options`` from a mapping, typed by ``optimizer`` (from_dict's hook)."""
    if name == "optimizer_options" and (isinstance(value, Mapping) or hasattr(value, "to_dict")):
      spec = reg.OPTIMIZERS.get(data.get("optimizer", cls.optimizer), "train.optimizer")
      return reg.options_from_dict(spec.Options, value, where, reg.OPTIMIZERS,
                                   "train.optimizer")
    return None

  def config_dict_extras(self) -> dict:
    """Keys a config file's tree holds besides this config's own: every registered
    optimizer's options with their defaults, so ``--config.train.optimizer=muon
    --config.train.optimizer_options.ns_steps=3`` works on a file that names AdamW
    (building the config drops the other optimizers' defaults). A name two optimizers
    give different defaults is left out."""
    defaults: dict[str, Any] = {}
    tree: dict[str, Any] = {}
    clash = set()
    for name in reg.OPTIMIZERS.names():
      if name == self.optimizer:
        continue
      opts = reg.OPTIMIZERS.get(name).Options()
      for key, value in _to_config_dict_tree(opts).items():
        default = getattr(opts, key)
        if key in defaults and defaults[key] != default:
          clash.add(key)
        defaults.setdefault(key, default)
        tree.setdefault(key, value)
    return {"optimizer_options": {k: v for k, v in tree.items() if k not in clash}}

  def __post_init__(self):
    p = "train"
    spec = self.optimizer_spec
    if self.optimizer_options is None:
      # Normalised at construction (like finetune's tuples), so every built
      # config, config.json and a resumed run's stored config agree.
      object.__setattr__(self, "optimizer_options", spec.Options())
    elif type(self.optimizer_options) is not spec.Options:
      raise ConfigError(f"{p}.optimizer_options", self.optimizer_options,
                        f"are not the options of train.optimizer={self.optimizer!r} "
                        f"({spec.Options.__module__}.{spec.Options.__name__})",
                        f"pass {spec.Options.__name__}(...) or optimizer_options=None for "
                        "its defaults")
    for name in ("steps", "log_every", "keep_checkpoints", "microbatches"):
      check_count(f"{p}.{name}", getattr(self, name), minimum=1)
    for name in ("warmup_steps", "seed", "eval_every", "checkpoint_every"):
      check_count(f"{p}.{name}", getattr(self, name), minimum=0)
    check_count(f"{p}.nan_at_step", self.nan_at_step, minimum=-1)
    if self.eval_batches is not None:
      check_count(f"{p}.eval_batches", self.eval_batches, minimum=1)
    check_positive(f"{p}.learning_rate", self.learning_rate)
    if self.warmup_steps >= self.steps:
      raise ConfigError(f"{p}.warmup_steps", self.warmup_steps,
                        f"is not below train.steps={self.steps}",
                        "use a warmup of a few percent of the run")
    check_fraction(f"{p}.min_lr_ratio", self.min_lr_ratio, allow_zero=True,
                   fix="use e.g. 0.1 (decay to a tenth of the peak)")
    for name in ("weight_decay", "grad_clip", "eps"):
      check_positive(f"{p}.{name}", getattr(self, name), allow_zero=True)
    for name in ("b1", "b2"):
      check_number(f"{p}.{name}", getattr(self, name), minimum=0, maximum=1, max_open=True,
                   fix="use e.g. b1=0.9, b2=0.95")
    if self.peak_tflops is not None:
      check_positive(f"{p}.peak_tflops", self.peak_tflops)
    if self.profile_steps is not None:
      _check_profile_steps(f"{p}.profile_steps", self.profile_steps, self.steps)
    check_choice(f"{p}.wandb_mode", self.wandb_mode, ("offline", "online"))


def _check_profile_steps(path: str, value, steps: int) -> None:
  """(a, b) integers with 0 < a < b <= steps."""
  fix = f"use two step numbers (a, b) with 0 < a < b <= train.steps={steps}, e.g. (5, 8)"
  if (not isinstance(value, (tuple, list)) or len(value) != 2
      or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
    raise ConfigError(path, value, "must be a pair of integers (a, b)", fix)
  a, b = value
  if not 0 < a < b <= steps:
    raise ConfigError(path, tuple(value), f"needs 0 < a < b <= train.steps={steps}", fix)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """One training run: the model, its data, its optimisation, its device layout and, for a
  fine-tuning run, where it starts from (``finetune``, :mod:`moejax.config.finetune`).

  ``parallel`` (:class:`moejax.config.ParallelConfig`): the default
  (``expert=1``) is data parallelism over every device. ``expert > 1`` runs
  every MoE layer expert-parallel (``ep_moe_layer``) on a ('data', 'fsdp',
  'expert') mesh; the device count is checked when the run starts.

  Built configs are resolved (:meth:`resolved`, a new config; ``from_dict``
  and so every config file, ``config.json`` and override return it):
  ``model.dense_twin`` has replaced the MoE by its dense twin, node/device-
  limited routing (``parallel.route_limit``) is written into
  ``model.moe.routing``, and the fine-tuning options into the model they
  apply to (a frozen router's ``routing.freeze``, the bias controller's
  ``balance.bias_freeze_step``), so the saved config.json says exactly what
  runs, and resolving it again changes nothing. Construction only checks
  (the resolved model); it never rewrites a field. The trainer resolves a
  config built in Python (or by ``dataclasses.replace``) before it runs.
  """

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  finetune: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)

  def _resolved_model(self) -> ModelConfig:
    model = self.model
    if model.dense_twin != "none" and model.moe is not None:
      model = dense_twin(model, model.dense_twin)
    if model.moe is not None and self.parallel.route_limit != "none":
      model = dataclasses.replace(model, moe=resolve_route_limit(model.moe, self.parallel))
    return resolve_model(model, self.finetune)

  def resolved(self) -> "ExperimentConfig":
    """This config with its model resolved (``self`` when it already is)."""
    model = self._resolved_model()
    return self if model == self.model else dataclasses.replace(self, model=model)

  def for_platform(self, platform: Optional[str] = None) -> "ExperimentConfig":
    """This config with ``model.moe.execution.backend='auto'`` resolved for ``platform``.

    ``platform`` defaults to JAX's (``jax.default_backend()``). The result
    names the backend that runs and says ``derived_from="auto on cpu"``; a
    config naming its backend is returned unchanged. Not part of
    :meth:`resolved`: building a config (a config file at flag parsing)
    must not start JAX's backend before ``jax.distributed.initialize``; the
    binaries call this once the launch is set up, and the trainer on every
    config it runs.
    """
    moe = self.model.moe
    if moe is None:
      return self
    new = executor_lib.resolve_execution(moe, platform)
    return self if new is moe else dataclasses.replace(
        self, model=dataclasses.replace(self.model, moe=new))

  def __post_init__(self):
    model = self._resolved_model()  # every check reads what will run
    check_buildable(model)
    if self.data.batch_size % self.train.microbatches:
      raise ConfigError("train.microbatches", self.train.microbatches,
                        f"does not divide data.batch_size={self.data.batch_size}",
                        "pick a divisor of the batch size")
    check_vocab_size(model.vocab_size, self.data)  # the tokenizer's V (moejax.data)
    _check_parallel(self.parallel, model)
    _check_capacity(model, self.data, self.train, self.parallel, None)


CAPACITY_FIELD = "model.moe.balance.capacity_factor"


def check_capacity(cfg: ExperimentConfig, num_devices: int) -> None:
  """ConfigError when the capacity factor leaves an expert under one slot per group, on
  ``num_devices`` devices (the construction check only knows a lower bound of the groups)."""
  _check_capacity(cfg._resolved_model(), cfg.data, cfg.train, cfg.parallel, num_devices)


def _check_capacity(model, data, train, pcfg: ParallelConfig, num_devices) -> None:
  """Capacity is applied per group of T tokens: the whole micro-batch under data parallelism
  (one jit over the global batch), each device's rows under expert parallelism. T counts
  every token of the group (a mixture-of-depths block routes fewer), so a refusal is certain."""
  cf = model.moe.balance.capacity_factor if model.moe is not None else None
  if cf is None:
    return
  groups = 1
  if pcfg.expert > 1:
    groups = num_devices or (max(pcfg.data, 1) * pcfg.fsdp * pcfg.expert)
  rows = data.batch_size // train.microbatches // groups
  tokens, e, k = rows * data.seq_len, model.moe.num_experts, model.moe.routing.top_k
  slots = capacity_lib.slots_per_expert(tokens, e, k, cf)
  if rows >= 1 and slots < 1:
    where = f"{groups} devices' groups of" if groups > 1 else "micro-batches of"
    raise ConfigError(
        CAPACITY_FIELD, cf,
        f"gives each of the {e} experts {slots:.3g} slots (cf * T * K / E with {where} "
        f"T={tokens} tokens, K={k}), rounded up to 1: at most {e} of {tokens * k} token copies "
        "per group would reach an expert",
        f"use capacity_factor >= {e / (tokens * k):.3g} (one slot per expert), e.g. 1.25 "
        "(Switch), or None (dropless)")


def drop_warning(cfg: ExperimentConfig, row: dict) -> Optional[str]:
  """The one-line warning when a train row's drop rate is above
  :data:`moejax.balance.capacity.DROP_WARN_BOUND` (the loop checks its first row)."""
  cf = cfg.model.moe.balance.capacity_factor if cfg.model.moe is not None else None
  return capacity_lib.drop_warning(row.get("drop_rate"), cf, CAPACITY_FIELD)


def _check_parallel(pcfg: ParallelConfig, model: ModelConfig) -> None:
  """The device-count-free part of the layout checks (the rest needs the devices)."""
  if pcfg.expert == 1:
    if pcfg.route_limit != "none":
      raise ConfigError("parallel.route_limit", pcfg.route_limit,
                        "routing limits group the experts by device / node of the expert axis",
                        "set parallel.expert > 1, or route_limit='none'")
    if pcfg.fsdp > 1:
      raise ConfigError("parallel.fsdp", pcfg.fsdp,
                        "shards only the routed experts of the expert-parallel layer",
                        "set parallel.expert > 1 as well, or parallel.fsdp=1")
    return
  if model.moe is None:
    raise ConfigError("parallel.expert", pcfg.expert, "the model has no MoE layer",
                      "set parallel.expert=1 (data parallelism)")
  if model.moe.execution.executor != reg.LOCAL_EXECUTOR:
    raise ConfigError("model.moe.execution.executor", model.moe.execution.executor,
                      f"is a single-device executor; with parallel.expert={pcfg.expert} "
                      f"parallel.dispatch_unit={pcfg.dispatch_unit!r} computes the experts",
                      f"leave it at {reg.LOCAL_EXECUTOR!r}, or set parallel.expert=1")
  check_experts(pcfg, model.moe)
  if model.d_model % pcfg.fsdp:
    raise ConfigError("parallel.fsdp", pcfg.fsdp,
                      f"does not divide model.d_model={model.d_model}",
                      f"pick fsdp among the divisors of {model.d_model}")


def experiment_from_dict(tree: Mapping[str, Any] | Any) -> ExperimentConfig:
  """ExperimentConfig from a nested mapping or ConfigDict; unknown keys are errors."""
  if hasattr(tree, "to_dict"):
    tree = tree.to_dict()
  return from_dict(ExperimentConfig, tree)


def _to_config_dict_tree(obj) -> dict:
  """A dataclass as a nested dict in which every None field is a typed placeholder."""
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top
  hints = typing.get_type_hints(type(obj))
  out = {}
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = _to_config_dict_tree(value)
    elif value is None:
      tp = unwrap_optional(hints[f.name])
      # A placeholder keeps the key overridable from the command line
      # (--config.data.data_dir=...); a None sub-config (a dense model's moe)
      # stays None.
      out[f.name] = (None if dataclasses.is_dataclass(tp) or tp not in (int, float, str, bool, tuple)
                     else config_dict.placeholder(tp))
    else:
      out[f.name] = value
  extras = getattr(obj, "config_dict_extras", None)
  for key, extra in (extras() if callable(extras) else {}).items():
    out[key] = {**extra, **out[key]}
  return out


def experiment_config_dict(**sections: Mapping[str, Any]):
  """A complete, validated ``ml_collections.ConfigDict`` for a ``get_config()`` file.

  ``experiment_config_dict(model={...}, data={...}, train={...})`` builds the
  ExperimentConfig (so the file itself is checked when loaded) and returns
  every field, defaults included: a command-line override of a key that
  does not exist (a typo) is then an error in ``config_flags`` itself, and
  :func:`experiment_from_dict` rechecks the values after the overrides.
  """
  import ml_collections  # pylint: disable=g-import-not-at-top
  cfg = experiment_from_dict(sections)
  return ml_collections.ConfigDict(_to_config_dict_tree(cfg))


def experiment_to_json(cfg: ExperimentConfig) -> str:
  """The config as JSON (tuples become lists; :func:`experiment_from_dict` reads it)."""
  return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def diff(a: Any, b: Any, path: str = "") -> list[str]:
  """Dotted paths where two config dicts differ, as ``path: a -> b`` lines."""
  if isinstance(a, Mapping) and isinstance(b, Mapping):
    out = []
    for key in sorted(set(a) | set(b), key=str):
      where = f"{path}.{key}" if path else str(key)
      if key not in a or key not in b:
        out.append(f"{where}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
      else:
        out.extend(diff(a[key], b[key], where))
    return out
  norm = lambda v: list(v) if isinstance(v, tuple) else v
  return [] if norm(a) == norm(b) else [f"{path}: {a!r} -> {b!r}"]


def current_layout(tree: Mapping[str, Any]) -> Any:
  """A stored experiment tree (a run's config.json, a record's config) in today's layout.

  Loading applies the moved-field tables (:data:`moejax.config.MOVED`), so a
  field that moved (a layer kind's option out of the topology section) is
  compared at its new place and an option dropped at its default is not a
  change; a tree that no longer loads is returned as it is.
  """
  try:
    return json.loads(experiment_to_json(experiment_from_dict(tree)))
  except Exception:  # pylint: disable=broad-except  (compared as stored, as before)
    return tree
