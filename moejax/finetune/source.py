"""The source of a fine-tuning run: a moejax workdir or a Hugging Face model directory.

:func:`open_source` runs with the trainer's read-only checks (before the
workdir is locked or anything is written): the source exists, has a
checkpoint (at ``finetune.source_step``) or converts (a whole Mixtral,
:mod:`moejax.interop.models`), and its model has exactly the parameter
shapes of the run's model without adapters. A mismatch is one
ConfigError line naming the first differing parameter and the model fields
that differ. :meth:`Source.apply` then replaces a freshly initialised
state's weights and router state by the source's:

- every base weight (LoRA adapters keep their initialisation, B = 0);
- the router state (the aux-loss-free bias and its step counter), so the
  router selects exactly as the source did;
- a fresh optimizer state for the run's own optimizer (the source's Adam
  moments are not carried over: fine-tuning starts its own schedule).

A source that was itself fine-tuned with LoRA has its adapters merged
first. Its own ``finetune.source`` is not followed: its checkpoint holds
every weight.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ConfigError, ModelConfig, to_dict
from moejax.model import Transformer
from moejax.nn import lora as lora_lib
from moejax.train import checkpoint as ckpt_lib
from moejax.train.config import ExperimentConfig, diff

FIELD = "finetune.source"
# Model fields a fine-tuning run may set differently from its source without
# changing a parameter shape or the function the source computed... or that
# the fine-tuning options themselves set; not reported as differences.
_QUIET = ("moe.routing.freeze", "moe.balance.bias_freeze_step", "moe.execution", "remat")


@dataclasses.dataclass
class Source:
  """A checked source; :meth:`load` reads its weights, :meth:`apply` puts them in a state."""

  path: str
  format: str
  step: Optional[int]
  model: ModelConfig
  notes: tuple
  _load: Callable[[], tuple[dict, dict]]

  def describe(self) -> str:
    where = f"checkpoint {self.step} of " if self.step is not None else ""
    return f"{where}{get_format(self.format).describes} {self.path}"

  def load(self) -> tuple[dict, Optional[dict]]:
    """(base params, router state) as pure dicts in the run's model layout (see :func:`_overlay`
    for leaves a source leaves fresh; router state None: the fresh one)."""
    return self._load()

  def apply(self, state, tx):
    """``state`` (a fresh TrainState) with the source's weights, router state, new optimizer."""
    params, router_state = self.load()
    new_params = _overlay(state.params, params)
    new_router = state.router_state if router_state is None else jax.tree.map(
        lambda want, got: jnp.asarray(got, want.dtype), state.router_state, router_state)
    return state.replace(params=new_params, router_state=new_router,
                         opt_state=tx.init(new_params))


def _overlay(params: Any, source: Any, path: tuple = ()) -> Any:
  """``params`` with every leaf the source has replaced by the source's (adapters kept).

  A subtree the source lacks keeps its fresh initialisation (an upcycled
  model's router: the shape checks of :func:`open_source` ran first, so an
  ordinary source lacks none); a callable source leaf maps the fresh leaf
  (a uniform router: ``jnp.zeros_like``).
  """
  if callable(source):
    return jax.tree.map(lambda p: jnp.asarray(source(p), p.dtype), params)
  if isinstance(params, dict):
    return {k: (v if k in ("lora", "adapters") or k not in source
                else _overlay(v, source[k], path + (k,)))
            for k, v in params.items()}
  return jnp.asarray(source, params.dtype)


def _shapes(tree: Any) -> dict[str, tuple]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  name = lambda k: str(getattr(k, "key", getattr(k, "idx", k)))
  return {"/".join(name(k) for k in p): tuple(v.shape) for p, v in flat}


def abstract_base(model: ModelConfig) -> tuple[dict, dict]:
  """(params, router state) of Transformer(model) as pure dicts of ShapeDtypeStructs."""
  def build():
    m = Transformer(model, rngs=nnx.Rngs(0))
    _, params, router_state, _ = nnx.split(m, nnx.Param, nnx.Variable, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(router_state)
  return jax.eval_shape(build)


def base_shapes(model: ModelConfig) -> tuple[dict, dict]:
  """({param path: shape}, {router-state path: shape}) of Transformer(model), no compute."""
  params, router_state = abstract_base(model)
  return _shapes(params), _shapes(router_state)


def _check_shapes(cfg: ExperimentConfig, src: ModelConfig, where: str) -> list[str]:
  """ConfigError when the shapes differ; returns notes on the model fields that differ."""
  fields = [c for c in diff(to_dict(src), to_dict(cfg.model))
            if not any(c.startswith(q) for q in _QUIET)]
  fields = [c.replace(": ", ": source ", 1).replace(" -> ", ", here ") for c in fields]
  want, want_state = base_shapes(cfg.model)
  have, have_state = base_shapes(src)
  bad = None
  for name, (a, b) in (("params", (have, want)), ("router state", (have_state, want_state))):
    for key in sorted(set(a) | set(b)):
      if a.get(key) != b.get(key):
        bad = (f"{name} {key}: source {a.get(key, 'absent')}, here {b.get(key, 'absent')}")
        break
    if bad:
      break
  if bad:
    model_diff = "; ".join(f"model.{c}" for c in fields[:4]) or "no model field differs"
    raise ConfigError(FIELD, where, f"its model has other parameter shapes than this run's "
                      f"({bad}; {model_diff})",
                      "fine-tune with the source's model config (experiments.finetune takes "
                      "it from the source), or pick a source of this model")
  return [f"model.{c}" for c in fields]


def moejax_run(cfg: ExperimentConfig, path: str) -> tuple[ExperimentConfig, int]:
  """(config, checkpoint step) of the moejax run at ``path`` that ``cfg`` starts from; checked."""
  from moejax.train import load as load_lib  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(path):
    raise ConfigError(FIELD, path, "is not a directory", "pass the --workdir of a trained run")
  try:
    src_cfg = load_lib.run_config(path)
  except ckpt_lib.WorkdirError as e:
    raise ConfigError(FIELD, path, "is not a moejax run directory (no config.json)",
                      "pass the --workdir of experiments.train (or a suite run directory), or "
                      "finetune.source_format='hf' for a Hugging Face model") from e
  steps = ckpt_lib.checkpoint_steps(path)
  if not steps:
    raise ConfigError(FIELD, path, "has no checkpoint", "train it first (experiments.train)")
  want = cfg.finetune.source_step
  if want >= 0 and want not in steps:
    raise ConfigError("finetune.source_step", want, f"{path} has no checkpoint there",
                      f"pick one of {steps}, or -1 for the newest")
  return src_cfg, (steps[-1] if want < 0 else want)


def moejax_weights(src_cfg: ExperimentConfig, path: str, step: int) -> tuple[dict, dict]:
  """(base params, router state) of a run's checkpoint, LoRA adapters merged."""
  from moejax.train import load as load_lib  # pylint: disable=g-import-not-at-top
  model, _ = load_lib.model_at(src_cfg, path, step)
  _, params, router_state, _ = nnx.split(model, nnx.Param, nnx.Variable, ...)
  params, router_state = nnx.to_pure_dict(params), nnx.to_pure_dict(router_state)
  if src_cfg.finetune.lora:
    params = lora_lib.merge_tree(params, src_cfg.finetune.lora_scale)
  return params, router_state


def _moejax_source(cfg: ExperimentConfig, path: str) -> Source:
  src_cfg, step = moejax_run(cfg, path)
  notes = _check_shapes(cfg, src_cfg.model, path)
  return Source(path, "moejax", step, src_cfg.model, tuple(notes),
                lambda: moejax_weights(src_cfg, path, step))


def _hf_source(cfg: ExperimentConfig, path: str) -> Source:
  from moejax.interop import InteropError, load_hf_config  # pylint: disable=g-import-not-at-top
  from moejax.interop import models as hf_models  # pylint: disable=g-import-not-at-top
  if cfg.finetune.source_step >= 0:
    raise ConfigError("finetune.source_step", cfg.finetune.source_step,
                      "a Hugging Face model directory has no checkpoint steps", "use -1")
  try:
    hf_config = load_hf_config(path)
    model_cfg = hf_models.model_config_from_hf(hf_config, cfg.model)
  except InteropError as e:
    raise ConfigError(FIELD, path, f"does not convert: {e}".rstrip("."),
                      "pass a Hugging Face Mixtral, Qwen3-MoE or DeepSeek-V3 checkpoint "
                      "directory (config.json + safetensors)") from e
  notes = _check_shapes(cfg, model_cfg, path)

  def load():
    imported = hf_models.import_model(path, hf_config, base=cfg.model)
    return imported.params, imported.router_state

  return Source(path, "hf", None, model_cfg, tuple(notes), load)


@dataclasses.dataclass(frozen=True)
class SourceFormat:
  """A kind of source (``finetune.source_format``): how it is opened and what model it holds.

  ``open(cfg, path) -> Source`` (checks, reads nothing heavy); ``model(path, tree) ->
  ModelConfig``: the model a run from this source trains (``tree``: the run's config tree,
  whose ``model`` section an upcycling source reads for the MoE); ``describes``: in words.
  """

  name: str
  open: Callable[[ExperimentConfig, str], Source]
  model: Callable[[str, dict], ModelConfig]
  describes: str


_FORMATS: dict[str, SourceFormat] = {}
# Formats registered by their own modules (imported on first use: they import this one).
_FORMAT_MODULES = {"upcycle": "moejax.finetune.upcycle"}


def register_format(fmt: SourceFormat) -> SourceFormat:
  _FORMATS[fmt.name] = fmt
  return fmt


def get_format(name: str) -> SourceFormat:
  if name not in _FORMATS and name in _FORMAT_MODULES:
    import importlib  # pylint: disable=g-import-not-at-top
    importlib.import_module(_FORMAT_MODULES[name])
  if name not in _FORMATS:
    raise ConfigError("finetune.source_format", name, "is not a source format",
                      f"use one of {', '.join(sorted(set(_FORMATS) | set(_FORMAT_MODULES)))}")
  return _FORMATS[name]


def open_source(cfg: ExperimentConfig) -> Source:
  """The checked source of ``cfg`` (a fine-tuning run); reads only. See the module doc."""
  ft = cfg.finetune
  if not ft.enabled:
    raise ValueError("open_source: finetune.source is empty (not a fine-tuning run)")
  path = os.path.expanduser(ft.source)
  if not os.path.exists(path):
    raise ConfigError(FIELD, ft.source, "does not exist",
                      "pass an existing run directory or Hugging Face model directory")
  return get_format(ft.source_format).open(cfg, path)


def detect_format(path: str) -> str:
  """``moejax`` for a directory with checkpoints/, ``hf`` for one whose config.json has a
  ``model_type``; ``moejax`` otherwise (its opener then says what is missing)."""
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return "moejax"
  config = os.path.join(path, "config.json")
  if os.path.exists(config):
    try:
      with open(config, encoding="utf-8") as f:
        if "model_type" in json.load(f):
          return "hf"
    except (OSError, ValueError):
      pass
  return "moejax"


def _moejax_model(ft_source: str, tree: Optional[dict] = None) -> ModelConfig:
  del tree
  from moejax.train import load as load_lib  # pylint: disable=g-import-not-at-top
  try:
    return load_lib.run_config(os.path.expanduser(ft_source)).model
  except ckpt_lib.WorkdirError as e:
    raise ConfigError(FIELD, ft_source, "is not a moejax run directory (no config.json)",
                      "pass the --workdir of a trained run, or --source_format=hf") from e


def _hf_model(ft_source: str, tree: Optional[dict] = None) -> ModelConfig:
  del tree
  from moejax.interop import InteropError, load_hf_config  # pylint: disable=g-import-not-at-top
  from moejax.interop import models as hf_models  # pylint: disable=g-import-not-at-top
  try:
    return hf_models.model_config_from_hf(load_hf_config(os.path.expanduser(ft_source)),
                                          ExperimentConfig().model)
  except InteropError as e:
    raise ConfigError(FIELD, ft_source, f"does not convert: {e}".rstrip("."),
                      "pass a Hugging Face Mixtral, Qwen3-MoE or DeepSeek-V3 checkpoint "
                      "directory") from e


register_format(SourceFormat("moejax", _moejax_source, _moejax_model, "moejax run"))
register_format(SourceFormat("hf", _hf_source, _hf_model, "Hugging Face model"))


def source_model(ft_source: str, source_format: str = "moejax",
                 tree: Optional[dict] = None) -> ModelConfig:
  """The model config of a run from this source (experiments.finetune builds its run with it;
  ``tree``: the run's config tree, read by formats that take the model from it)."""
  return get_format(source_format).model(ft_source, tree or {})
