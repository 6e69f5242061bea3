"""Published MoE architectures as config files: ``configs/presets/<name>.py``.

Each preset file defines ``get_config()`` returning an ml_collections
ConfigDict with ``model`` (a :class:`~moejax.config.ModelConfig` tree, the
real published hyperparameters) and ``published`` ({'total', 'active',
'active_convention', 'source'}: the publisher's parameter counts and how they
count the embedding table). The presets are data, not code branches: nothing
in moejax tests a model name.

``configs/`` is not a Python package; files are loaded by path, located from
the installed ``moejax`` package (repository root = parent of ``moejax/``).
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
from typing import Any

import moejax
from moejax.config import ModelConfig, from_dict


def presets_dir() -> pathlib.Path:
  """``<repo>/configs/presets``, found next to the moejax package."""
  return pathlib.Path(moejax.__file__).resolve().parent.parent / "configs" / "presets"


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


def load_preset(name: str) -> tuple[ModelConfig, dict]:
  """(ModelConfig, published dict) of preset ``name``.

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
  published = cfg.published.to_dict() if hasattr(cfg.published, "to_dict") else dict(cfg.published)
  return model, published
