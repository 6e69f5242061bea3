"""Config files: ``get_config()`` Python files loaded by path, and the presets.

Experiment configs (``configs/*.py``), suites (``configs/ablations/*.py``)
and published architectures (``configs/presets/*.py``) are Python files with
a ``get_config()`` returning an ``ml_collections.ConfigDict`` or a dict.
``configs/`` is not a Python package; files are loaded by path, located from
the installed ``moejax`` package (repository root = parent of ``moejax/``).

A preset file has ``model`` (a :class:`~moejax.config.model.ModelConfig`
tree with the real published hyperparameters), optionally ``accounting`` (an
:class:`~moejax.config.architecture.ArchitectureConfig` tree for parts the
model does not build) and ``published`` ({'total', 'active',
'active_convention', 'source'}). Presets are data, not code branches: nothing
in moejax tests a model name.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
from typing import Any, NamedTuple

from moejax.config.architecture import ArchitectureConfig
from moejax.config.core import from_dict
from moejax.config.model import ModelConfig


def repo_root() -> pathlib.Path:
  """The repository root: the parent of the ``moejax`` package directory."""
  return pathlib.Path(__file__).resolve().parent.parent.parent


def presets_dir() -> pathlib.Path:
  """``<repo>/configs/presets``."""
  return repo_root() / "configs" / "presets"


def list_presets() -> list[str]:
  """Names of the preset files, sorted."""
  d = presets_dir()
  if not d.is_dir():
    return []
  return sorted(p.stem for p in d.glob("*.py") if not p.stem.startswith("_"))


def load_config_file(path: str | pathlib.Path) -> Any:
  """Runs ``get_config()`` of a Python config file given by path."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"config file {str(path)!r} does not exist")
  spec = importlib.util.spec_from_file_location(f"_moejax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise AttributeError(f"config file {str(path)!r} defines no get_config()")
  return module.get_config()


class Preset(NamedTuple):
  """A published architecture: the model, accounting-only facts, published counts."""

  model: ModelConfig
  architecture: ArchitectureConfig
  published: dict


def _plain(tree: Any) -> dict:
  return tree.to_dict() if hasattr(tree, "to_dict") else dict(tree)


def load_preset(name: str) -> Preset:
  """The :class:`Preset` named ``name``.

  Raises:
    ValueError: unknown name; the message lists the valid ones.
  """
  names = list_presets()
  if name not in names:
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown preset {name!r}. Fix: {hint}use one of: {', '.join(names)}")
  cfg = load_config_file(presets_dir() / f"{name}.py")
  model = from_dict(ModelConfig, cfg.model, "model")
  arch = from_dict(ArchitectureConfig, _plain(cfg.accounting), "accounting") \
      if "accounting" in cfg else ArchitectureConfig()
  return Preset(model, arch, _plain(cfg.published))
