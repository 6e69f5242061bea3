"""One line for each way a config file or a ``--config.*`` override can be wrong.

:func:`describe_config_error` turns what ``ml_collections.config_flags``
raises (a misspelt key with its "did you mean", a key that moved, a missing
or broken config file) into the text of one ``error:`` line;
:func:`describe_bad_value` does the same for a value of the wrong type
(``--config.train.steps=abc``): absl's flag parser says only "invalid literal
for int()", the line names the override, the value, the field's type and an
example from the config itself.

``experiment_at`` is where the experiment tree sits in the binary's config
tree: ``""`` for train (``--config.model...``), ``"base"`` for ablate
(``--config.base.model...``), None where no experiment tree is overridable.
A first key that is not in the tree but names a section or field of the
experiment (``--config.model.d_model`` on a suite, ``--config.balance.x`` on
train) is pointed to its full override.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import typing
from typing import Any, Callable, Optional, Sequence

from absl import flags
from ml_collections.config_flags import config_flags as config_flags_lib
from ml_collections.config_flags import tuple_parser


def _last_line(text: str) -> str:
  lines = [l.strip() for l in str(text).strip().splitlines() if l.strip()]
  return lines[-1] if lines else str(text)


def _config_flag_names(flag_values) -> list[str]:
  return [name for name, flag in flag_values._flags().items()  # pylint: disable=protected-access
          if config_flags_lib.is_config_flag(flag)]


def _config_file_arg(argv: Sequence[str], flag_values) -> tuple[str, str] | None:
  for name in _config_flag_names(flag_values) or ["config"]:
    for a in argv:
      if a.startswith(f"--{name}="):
        return name, a.split("=", 1)[1]
  return None


# --- Where a name lives in the experiment tree. ------------------------------

def experiment_paths() -> dict[str, list[tuple[str, bool]]]:
  """Every section and field name of an ExperimentConfig -> its (dotted path, is a section)s."""
  # pylint: disable=g-import-not-at-top
  from moejax.config import unwrap_optional
  from moejax.train.config import ExperimentConfig
  out: dict[str, list[tuple[str, bool]]] = {}

  def walk(cls, prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      path, tp = f"{prefix}{f.name}", unwrap_optional(hints[f.name])
      out.setdefault(f.name, []).append((path, dataclasses.is_dataclass(tp)))
      if dataclasses.is_dataclass(tp):
        walk(tp, path + ".")

  walk(ExperimentConfig, "")
  return out


def _section_hint(flag: str, key: str, rest: str, experiment_at: str) -> Optional[str]:
  """For ``--{flag}.{key}{rest}`` whose ``key`` is no field of the tree: its full override."""
  # With a rest (``.name``) the key is a section (data, not parallel.data); without, any field.
  paths = [p for p, section in experiment_paths().get(key, ()) if section or not rest]
  if not paths:
    return None
  root = f"{experiment_at}." if experiment_at else ""
  full = " or ".join(f"--{flag}.{root}{p}{rest}" for p in paths)
  if experiment_at:
    return (f"{key!r} is not a field of the suite; the experiment's fields are under "
            f"{experiment_at!r}: use {full} (it changes every arm)")
  return f"{key!r} is not a top-level field; use {full}"


def _unknown_key(e: BaseException, argv: Sequence[str], experiment_at: Optional[str]) -> str:
  # ml_collections: KeyError("'stepz'\nDid you mean \"steps\" instead of \"stepz\"?")
  raw = str(e.args[0]) if e.args else str(e)
  m = re.search(r'Did you mean "([\w.]+)" instead of "([\w.]+)"', raw)
  if m:
    key = m.group(2)
  else:
    q = re.search(r"'([\w.]+)", raw)
    key = q.group(1) if q else _last_line(raw)
  hint = f'; did you mean "{m.group(1)}"?' if m else ""
  arg = next((a for a in argv if re.match(rf"--\w+\.(?:[\w.]+\.)?{re.escape(key)}(=|$|\.)", a)),
             None)
  where = arg.split("=", 1)[0] if arg else key
  if arg:
    flag, dotted = where[2:].split(".", 1)
    if experiment_at is not None and dotted.split(".", 1)[0] == key:
      section = _section_hint(flag, key, dotted[len(key):], experiment_at)
      if section:
        return f"{where}: {section}"
    # A key the config tree moved (model.moe.num_experts -> ...topology...).
    from moejax.config import moved_hint  # pylint: disable=g-import-not-at-top
    moved = moved_hint(dotted)
    if moved:
      hint = f"; {moved}"
  return (f"{where}: {key!r} is not a config field{hint} (--print_config lists every field "
          "with its default)")


def describe_config_error(e: BaseException, argv: Sequence[str],
                          experiment_at: Optional[str] = None, flag_values=None) -> str:
  """One line for an exception raised while loading a config file or applying an override."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  if isinstance(e, (KeyError, AttributeError)):
    return _unknown_key(e, argv, experiment_at)
  text = str(e)
  file_arg = _config_file_arg(argv, flag_values)
  flag = f"--{file_arg[0]}={file_arg[1]}" if file_arg else "--config"
  if isinstance(e, SyntaxError):
    return f"{flag}: cannot load it: SyntaxError: {e.msg} (line {e.lineno})"
  if isinstance(e, ImportError):
    return f"{flag}: cannot load it: {_import_problem(e, file_arg[1] if file_arg else '')}"
  if "Errno 2" in text or "No such file" in text:
    return f"{flag}: no such file. Fix: {_config_files_fix(file_arg[1] if file_arg else '')}"
  if "config file" in text:
    return f"{flag}: cannot load it: {_last_line(text)}"
  return _last_line(text)


_LISTED = 12  # config file names shown at most


def _config_files_fix(given: str) -> str:
  """The config files that exist where ``given`` points: its directory, else ./configs."""
  path = given.split(":", 1)[0]  # a config file may take an argument: FILE.py:ARG
  folder = os.path.dirname(path)
  if (not folder or not os.path.isdir(folder)) and os.path.isdir("configs"):
    folder = "configs"
  if not folder or not os.path.isdir(folder):
    return "pass the path of an existing config file"
  entries = sorted(os.listdir(folder))
  names = [n for n in entries if n.endswith(".py") and not n.startswith("_")]
  subdirs = [f"{os.path.join(folder, n)}/" for n in entries
             if not n.startswith((".", "_")) and os.path.isdir(os.path.join(folder, n))
             and any(f.endswith(".py") for f in os.listdir(os.path.join(folder, n)))]
  if not names:
    return f"pass the path of an existing config file ({folder}/ holds none)"
  close = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.75)
  hint = f"did you mean {os.path.join(folder, close[0])}? " if close else ""
  shown = ", ".join(names[:_LISTED]) + (", ..." if len(names) > _LISTED else "")
  more = f" (more in {', '.join(subdirs[:4])})" if subdirs else ""
  return f"{hint}the config files in {folder}/ are {shown}{more}"


def _import_problem(e: ImportError, config_file: str) -> str:
  """What a failed import in a config file (a plugin module, usually) needs, and the fix."""
  name = getattr(e, "name", None)
  if not isinstance(e, ModuleNotFoundError) or not name:
    return (f"{type(e).__name__}: {_last_line(e)}. Fix: correct that import in the config "
            "file or in the module it imports")
  top = name.split(".")[0]
  # A module next to the config file (a researcher's plugin) is found from that folder.
  here = os.path.dirname(os.path.abspath(config_file)) if config_file else ""
  beside = here and (os.path.exists(os.path.join(here, f"{top}.py"))
                     or os.path.isdir(os.path.join(here, top)))
  where = (f"it sits in {here}: run with PYTHONPATH={here}" if beside else
           f"put the folder that holds {top}.py (or the package {top}/) on PYTHONPATH "
           f"(PYTHONPATH=DIR python -m ...), or pip install it")
  return (f"it imports the module {name!r}, which is not importable (neither on PYTHONPATH "
          f"nor installed). Fix: {where}; a plugin module must be importable wherever the "
          "config is loaded")


# --- A value of the wrong type. ----------------------------------------------

def _tuple_literal(value) -> str:
  # Double quotes inside, so that the whole literal can sit in single quotes in a shell.
  items = [json.dumps(v) if isinstance(v, str) else repr(v) for v in value]
  return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


@dataclasses.dataclass(frozen=True)
class _FieldType:
  """What a wrong value of one field type is told: the problem, the fix, an example.

  The example is the config's own value of the field (``show`` writes it as
  it is typed on a command line) where it has one, else ``unset_example``.
  """

  problem: str
  fix: str
  unset_example: str
  show: Callable[[Any], str] = repr
  switches: bool = False  # a bool: --config.a.b / --noconfig.a.b work too

  def example(self, name: str, default: Any) -> str:
    value = self.show(default) if default not in (None, (), []) else self.unset_example
    return f"--{name}={value}" + (f" (or --{name} / --no{name})" if self.switches else "")


class _Section(_FieldType):
  """A whole sub-tree (``--config.model.moe=3``): its fields are what take values."""

  def example(self, name: str, default: Any) -> str:
    return f"--{name}.FIELD=VALUE (--print_config lists the fields)"


# The parsers config_flags gives an override of each field type.
_FIELD_TYPES = {
    flags.IntegerParser: _FieldType("not an integer", "pass a whole number (the field is an int)",
                                    "8"),
    flags.FloatParser: _FieldType("not a number", "pass a number (the field is a float)", "0.5"),
    flags.BooleanParser: _FieldType("not a boolean", "pass true or false (the field is a bool)",
                                    "false", show=lambda v: str(v).lower(), switches=True),
    tuple_parser.TupleParser: _FieldType(
        "not a tuple", "pass a Python tuple in single quotes (the field is a tuple)", "'(1, 2)'",
        show=lambda v: f"'{_tuple_literal(v)}'"),
    config_flags_lib._ConfigDictParser: _Section(  # pylint: disable=protected-access
        "a config section, not a value", "set its fields instead", ""),
}


def _flag_and_rest(message: str, flag_values) -> tuple[str, str] | None:
  """(NAME, ``VALUE: why``) of absl's ``flag --NAME=VALUE: why`` (the longest defined NAME)."""
  defined = flag_values._flags()  # pylint: disable=protected-access
  names = [n for n in defined if message.startswith(f"flag --{n}=")]
  if not names:
    return None
  name = max(names, key=len)
  rest = message[len(f"flag --{name}="):]
  return name, rest


def describe_bad_value(e: BaseException, flag_values=None) -> Optional[str]:
  """One line for ``--config.a.b=VALUE`` whose VALUE is not of the field's type (else None)."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  found = _flag_and_rest(str(e), flag_values)
  if found is None:
    return None
  name, rest = found
  flag = flag_values[name]
  field_type = _FIELD_TYPES.get(type(flag.parser))
  if field_type is None or name.split(".", 1)[0] not in _config_flag_names(flag_values):
    return None  # not a --config.* override of a typed field: absl's own message is clear
  why = str(e.__context__) if e.__context__ is not None else ""
  value = rest[: -len(why) - 2] if why and rest.endswith(f": {why}") else rest.split(": ", 1)[0]
  return (f"--{name}={value!r}: {field_type.problem}. Fix: {field_type.fix}, e.g. "
          f"{field_type.example(name, flag.default)}")
