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

from moejax.config import ConfigError, ModelConfig, unwrap_optional, from_dict, to_dict
from moejax.data import DataConfig, check_vocab_size
from moejax.execution.mesh import ParallelConfig, check_experts, limited_moe_config


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

  def __post_init__(self):
    p = "train"
    for name in ("steps", "log_every", "keep_checkpoints"):
      _check_int(f"{p}.{name}", getattr(self, name), minimum=1)
    for name in ("warmup_steps", "seed", "eval_every", "checkpoint_every"):
      _check_int(f"{p}.{name}", getattr(self, name), minimum=0)
    _check_int(f"{p}.nan_at_step", self.nan_at_step, minimum=-1)
    if self.eval_batches is not None:
      _check_int(f"{p}.eval_batches", self.eval_batches, minimum=1)
    if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
      raise ConfigError(f"{p}.learning_rate", self.learning_rate, "must be > 0",
                        "use e.g. 3e-3 for a small model")
    if self.warmup_steps >= self.steps:
      raise ConfigError(f"{p}.warmup_steps", self.warmup_steps,
                        f"is not below train.steps={self.steps}",
                        "use a warmup of a few percent of the run")
    if not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ConfigError(f"{p}.min_lr_ratio", self.min_lr_ratio, "must lie in [0, 1]",
                        "use e.g. 0.1 (decay to a tenth of the peak)")
    for name in ("weight_decay", "grad_clip", "eps"):
      v = getattr(self, name)
      if not isinstance(v, (int, float)) or v < 0:
        raise ConfigError(f"{p}.{name}", v, "must be a number >= 0", f"set {p}.{name} >= 0")
    for name in ("b1", "b2"):
      v = getattr(self, name)
      if not 0.0 <= v < 1.0:
        raise ConfigError(f"{p}.{name}", v, "must lie in [0, 1)", "use e.g. b1=0.9, b2=0.95")


def _check_int(path: str, value: Any, minimum: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ConfigError(path, value, f"must be an int >= {minimum}", f"set {path} >= {minimum}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """One training run: the model, its data, its optimisation and its device layout.

  ``parallel`` (:class:`moejax.execution.mesh.ParallelConfig`): the default
  (``expert=1``) is data parallelism over every device. ``expert > 1`` runs
  every MoE layer expert-parallel (``ep_moe_layer``) on a ('data', 'fsdp',
  'expert') mesh; the device count is checked when the run starts.
  """

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

  def __post_init__(self):
    from moejax.model import check_buildable  # the model's own "valid but not built" rules
    check_buildable(self.model)
    check_vocab_size(self.model.vocab_size, self.data)  # the tokenizer's V (moejax.data)
    _check_parallel(self.parallel, self.model)


def _check_parallel(pcfg: ParallelConfig, model: ModelConfig) -> None:
  """The device-count-free part of the layout checks (the rest needs the devices)."""
  if pcfg.expert == 1:
    if pcfg.fsdp > 1:
      raise ConfigError("parallel.fsdp", pcfg.fsdp,
                        "shards only the routed experts of the expert-parallel layer",
                        "set parallel.expert > 1 as well, or parallel.fsdp=1")
    return
  if model.moe is None:
    raise ConfigError("parallel.expert", pcfg.expert, "the model has no MoE layer",
                      "set parallel.expert=1 (data parallelism)")
  check_experts(pcfg, model.moe)
  if model.moe_schedule == "scmoe":
    raise ConfigError("model.moe_schedule", model.moe_schedule,
                      "the ScMoE block calls the single-device layer; expert "
                      "parallelism is wired for the serial schedule only",
                      "use model.moe_schedule='serial' or parallel.expert=1")
  if model.d_model % pcfg.fsdp:
    raise ConfigError("parallel.fsdp", pcfg.fsdp,
                      f"does not divide model.d_model={model.d_model}",
                      f"pick fsdp among the divisors of {model.d_model}")
  if pcfg.route_limit == "devices" or (pcfg.route_limit == "nodes"
                                       and pcfg.devices_per_node is not None):
    limited_moe_config(model.moe, pcfg)  # node counts from processes are known only at run time


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
