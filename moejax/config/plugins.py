"""Which plugin modules a run uses, recorded so the run can be read again elsewhere.

A plugin is an idea registered from outside ``moejax``: a router
(``moejax.routing.register``), a layer kind, a balance loss or bias rule
(``moejax.balance.register_loss`` / ``register_bias_rule``), an
expert-parallel executor. A run whose config names one records, next to its
``config.json``, every module that registered one (``plugins.json``): its
name, its file, the file's sha256 and the ideas of it the config names. A
module that registers several ideas is one record listing all of them.
Suite provenance (each ``result.json``, ``summary.json``) carries the same
records. Reading the run back (``moejax.load``, resuming, ``--extend``)
imports the recorded modules first (by name when importable, else from the
recorded file), so the registries know the names before the config is built;
a module that cannot be imported fails in one line naming it and the folder
to put on ``PYTHONPATH``, and one whose file changed since the run is
reported (:func:`changes`).

This module imports nothing from JAX; importing a plugin imports what the
plugin imports.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Callable, Iterable, Mapping, Optional

from moejax.config.registry import (BALANCE_LOSSES, BIAS_RULES, EXECUTORS, GMM_KERNELS,
                                    LAYERS, OPTIMIZERS, ROUTERS, module_file)

PLUGINS_FILE = "plugins.json"


class PluginError(RuntimeError):
  """A run's plugin module cannot be imported again, or no longer registers its ideas."""


def _sha256(path: str) -> Optional[str]:
  try:
    with open(path, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()
  except OSError:
    return None


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
  for key in dotted.split("."):
    tree = (tree or {}).get(key) if isinstance(tree, Mapping) else None
  return tree


def _one(value: Any) -> list:
  return [] if value in (None, "", "none") else [value]


def _loss_names(value: Any) -> list:
  return [pair[0] for pair in value or ()]


# Every config field that names a registered idea: (registry, field, names in its value).
# A registry added later (row gathers, say) is one more row.
IDEA_FIELDS: tuple[tuple[Any, str, Callable[[Any], list]], ...] = (
    (LAYERS, "model.moe.kind", _one),
    (ROUTERS, "model.moe.routing.kind", _one),
    (BALANCE_LOSSES, "model.moe.balance.extra_losses", _loss_names),
    (BIAS_RULES, "model.moe.balance.bias_update", _one),
    (EXECUTORS, "parallel.dispatch_unit", _one),
    (EXECUTORS, "model.moe.execution.executor", _one),
    (GMM_KERNELS, "model.moe.execution.backend", _one),
    (GMM_KERNELS, "model.moe.execution.large_group_backend", _one),
    (OPTIMIZERS, "train.optimizer", _one),
)


def used(tree: Mapping[str, Any]) -> list[dict]:
  """Records of the plugin modules an experiment (its ``to_dict``) uses; [] for shipped ideas.

  One record per module, in the order the config names them: ``module``,
  ``file``, ``sha256`` and ``ideas`` (``registry``, ``name``, ``field`` of
  each idea of that module the config names).
  """
  by_module: dict[str, dict] = {}
  for reg, field, names in IDEA_FIELDS:
    for name in names(_get(tree, field)):
      module = reg.plugins().get(name)
      if module is None:
        continue
      if module not in by_module:
        path = module_file(module)
        by_module[module] = {"module": module, "file": os.path.abspath(path) if path else "",
                             "sha256": _sha256(path), "ideas": []}
      idea = {"registry": reg.what, "name": name, "field": field}
      if idea not in by_module[module]["ideas"]:
        by_module[module]["ideas"].append(idea)
  return list(by_module.values())


def normalise(records: Iterable[Mapping[str, Any]]) -> list[dict]:
  """Records in the per-module form; ``plugins.json`` files written one record per idea
  (``field``, ``name``, ``registry`` at the top) are grouped by module."""
  out: dict[str, dict] = {}
  for rec in records:
    ideas = rec.get("ideas")
    if ideas is None:
      ideas = [{"registry": rec.get("registry", ""), "name": rec["name"],
                "field": rec.get("field", "")}]
    key = (rec["module"], rec.get("sha256"))
    entry = out.setdefault(key, {"module": rec["module"], "file": rec.get("file") or "",
                                 "sha256": rec.get("sha256"), "ideas": []})
    entry["ideas"] += [dict(i) for i in ideas if i not in entry["ideas"]]
  return list(out.values())


def merge(record_lists: Iterable[Iterable[Mapping[str, Any]]]) -> list[dict]:
  """One record per (module, sha256) over several runs' records, with the union of ideas."""
  return normalise(rec for records in record_lists for rec in normalise(records))


def describe_ideas(record: Mapping[str, Any]) -> str:
  return ", ".join(f"{i['registry']} {i['name']!r}" for i in record.get("ideas", ()))


def write_record(workdir: str, tree: Mapping[str, Any]) -> None:
  """Writes ``plugins.json`` into ``workdir`` when the run uses a plugin."""
  records = used(tree)
  if not records:
    return
  path = os.path.join(workdir, PLUGINS_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(records, f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def read_record(workdir: str) -> list[dict]:
  """The records of ``workdir``'s ``plugins.json`` (per module), imported nothing; [] if none."""
  path = os.path.join(workdir, PLUGINS_FILE)
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return normalise(json.load(f))


def search_root(module: str, path: str) -> str:
  """The folder that, on ``PYTHONPATH``, makes ``module`` (recorded at ``path``) importable."""
  if not path:
    return ""
  levels = module.count(".") + (os.path.basename(path) == "__init__.py")
  folder = os.path.dirname(os.path.abspath(path))
  for _ in range(levels):
    folder = os.path.dirname(folder)
  return folder


def _fix(module: str, path: str) -> str:
  package = os.path.basename(path) == "__init__.py"
  held = module.replace(".", "/") + ("/" if package else ".py")
  root = search_root(module, path)
  was = f" (the run had it in {root}: PYTHONPATH={root})" if root else ""
  return f"Fix: put the folder that holds {held} on PYTHONPATH{was} before reading this run"


def _last_line(e: BaseException) -> str:
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _import(record: Mapping[str, Any]) -> None:
  module, path = record["module"], record.get("file") or ""
  if module in sys.modules:
    return
  what = f"plugin module {module!r} (which registers {describe_ideas(record)})"
  try:
    importlib.import_module(module)
    return
  except ModuleNotFoundError as e:
    if e.name not in _parents(module):  # the module exists; something it imports does not
      raise PluginError(f"{what} cannot be imported here: it imports {e.name!r}, which is not "
                        f"importable. Fix: install {e.name!r} or put the folder that holds it "
                        "on PYTHONPATH before reading this run") from None
  except Exception as e:  # pylint: disable=broad-except
    raise PluginError(f"{what} fails to import: {_last_line(e)}. Fix: repair {path or module}"
                      " (its recorded sha256 says which version made the run)") from None
  if not (path and os.path.exists(path)):
    raise PluginError(f"{what} cannot be imported here and its file {path or '(none recorded)'}"
                      f" does not exist. {_fix(module, path)}")
  spec = importlib.util.spec_from_file_location(module, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[module] = mod
  try:
    spec.loader.exec_module(mod)
  except Exception as e:  # pylint: disable=broad-except
    sys.modules.pop(module, None)
    raise PluginError(f"{what} fails to import from {path}: {_last_line(e)}. "
                      f"{_fix(module, path)}") from None


def _parents(module: str) -> set:
  parts = module.split(".")
  return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


_REGISTRIES = {reg.what: reg for reg, _, _ in IDEA_FIELDS}


def _check_registered(record: Mapping[str, Any]) -> None:
  """The imported module still registers every idea the run recorded for it."""
  for idea in record.get("ideas", ()):
    reg = _REGISTRIES.get(idea.get("registry"))
    if reg is None:
      continue
    if reg.plugins().get(idea["name"]) != record["module"]:
      raise PluginError(
          f"plugin module {record['module']!r} ({record.get('file') or 'no file recorded'}) "
          f"no longer registers the {idea['registry']} {idea['name']!r} the run used "
          f"({idea.get('field')}). Fix: restore the version the run was made with (sha256 "
          f"{(record.get('sha256') or '?')[:12]})")


def changes(recorded: Iterable[Mapping[str, Any]]) -> list[str]:
  """One line per recorded module whose file now differs from the recorded sha256."""
  out = []
  for rec in normalise(recorded):
    now = _sha256(module_file(rec["module"]) or rec.get("file") or "")
    if rec.get("sha256") and now and now != rec["sha256"]:
      out.append(f"plugin module {rec['module']!r} changed since the run was made (sha256 "
                 f"{rec['sha256'][:12]} -> {now[:12]})")
  return out


def load(records: Iterable[Mapping[str, Any]], say=None) -> list[dict]:
  """Imports the recorded plugin modules; reports (via ``say``) a file that changed.

  Raises :class:`PluginError` (one line naming the module and the fix) when a
  module cannot be imported or no longer registers a recorded idea.
  """
  records = normalise(records)
  for record in records:
    _import(record)
    _check_registered(record)
  if say is not None:
    for line in changes(records):
      say(f"warning: {line}; its results came from the old version")
  return records


def load_record(workdir: str, say=None) -> list:
  """Imports the plugins ``workdir``'s run recorded (none recorded: nothing to do)."""
  return load(read_record(workdir), say)
