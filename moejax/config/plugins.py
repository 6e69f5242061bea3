"""Which plugin modules a run uses, recorded so the run can be read again elsewhere.

A plugin is an idea registered from outside ``moejax`` (a router of a
researcher's own module, registered with ``moejax.routing.register``). A run
whose config names one records, next to its ``config.json``, the module
that registered it: its name, its file and the file's sha256
(``plugins.json``); suite provenance carries the same record next to the
commit. Reading the run back (``moejax.load``, resuming, ``--extend``)
imports the recorded modules first (by name when importable, else from the
recorded file), so the registry knows the kind before the config is built;
a module that cannot be found fails in one line naming it, and one whose
file changed since the run is reported.

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
from typing import Any, Mapping, Optional

from moejax.config.registry import LAYERS, ROUTERS, module_file

PLUGINS_FILE = "plugins.json"


class PluginError(RuntimeError):
  """A run's plugin module cannot be imported again."""


def _sha256(path: str) -> Optional[str]:
  try:
    with open(path, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()
  except OSError:
    return None


def _kinds(tree: Mapping[str, Any]) -> list[tuple[Any, str, str]]:
  """(registry, field, name) of every registered idea an experiment dict names."""
  moe = ((tree.get("model") or {}).get("moe")) or {}
  out = []
  if moe.get("kind") is not None:
    out.append((LAYERS, "model.moe.kind", moe["kind"]))
  routing = moe.get("routing") or {}
  if routing.get("kind") is not None:
    out.append((ROUTERS, "model.moe.routing.kind", routing["kind"]))
  return out


def used(tree: Mapping[str, Any]) -> list[dict]:
  """Records of the plugins an experiment (its ``to_dict``) uses; [] for shipped ideas only."""
  out = []
  for reg, field, name in _kinds(tree):
    module = reg.plugins().get(name)
    if module is None:
      continue
    path = module_file(module)
    out.append({"field": field, "name": name, "registry": reg.what, "module": module,
                "file": os.path.abspath(path) if path else "", "sha256": _sha256(path)})
  return out


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


def _import(record: Mapping[str, Any]) -> None:
  module, path = record["module"], record.get("file") or ""
  if module in sys.modules:
    return
  try:
    importlib.import_module(module)
    return
  except ImportError:
    pass
  if path and os.path.exists(path):
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
      spec.loader.exec_module(mod)
    except BaseException:
      sys.modules.pop(module, None)
      raise
    return
  raise PluginError(
      f"{record['field']}={record['name']!r} is registered by the plugin module {module!r} "
      f"({path or 'no file recorded'}), which cannot be imported here. Fix: put that module on "
      f"PYTHONPATH (or restore {path}) before reading this run")


def load(records: list, say=None) -> None:
  """Imports the recorded plugin modules; reports (via ``say``) a file that changed."""
  for record in records:
    _import(record)
    now = _sha256(module_file(record["module"]) or record.get("file") or "")
    if say is not None and record.get("sha256") and now and now != record["sha256"]:
      say(f"warning: plugin module {record['module']!r} changed since the run was made "
          f"(sha256 {record['sha256'][:12]} -> {now[:12]}); its results came from the old "
          "version")


def load_record(workdir: str, say=None) -> list:
  """Imports the plugins ``workdir``'s run recorded (none recorded: nothing to do)."""
  path = os.path.join(workdir, PLUGINS_FILE)
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    records = json.load(f)
  load(records, say)
  return records
