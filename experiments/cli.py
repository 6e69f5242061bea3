"""What the binaries share: one ``error:`` line per failure, quiet libraries, config loading.

- :func:`run` is ``absl.app.run`` with a flag parser that turns the errors of
  ``ml_collections.config_flags`` (a misspelt ``--config.a.b`` key, a missing
  or broken ``--config`` file) into one ``error:`` line with the "did you
  mean" ml_collections computes, instead of a 50-line traceback.
- :func:`config_tree` reads the config flag's value (a config file that
  failed to load fails here, on first access).
- :func:`fail` prints ``error: ...`` to stderr and exits with status 1.
- :func:`quiet_logs`: absl INFO/WARNING from TFDS and orbax stay out of the
  output unless ``--verbosity`` is given.
"""

from __future__ import annotations

import logging as py_logging
import os
import re
import sys
from typing import NoReturn, Sequence

from absl import app, flags, logging


def fail(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(1)


def _last_line(text: str) -> str:
  lines = [l.strip() for l in str(text).strip().splitlines() if l.strip()]
  return lines[-1] if lines else str(text)


def _config_flag_names() -> list[str]:
  return [name for name, flag in flags.FLAGS._flags().items()  # pylint: disable=protected-access
          if type(flag).__name__ == "_ConfigFlag"]


def _config_file_arg(argv: Sequence[str]) -> tuple[str, str] | None:
  for name in _config_flag_names() or ["config"]:
    for a in argv:
      if a.startswith(f"--{name}="):
        return name, a.split("=", 1)[1]
  return None


def describe_config_error(e: BaseException, argv: Sequence[str]) -> str:
  """One line for an exception raised while loading a config file or applying an override."""
  text = str(e)
  if isinstance(e, (KeyError, AttributeError)):
    # ml_collections: KeyError("'stepz'\nDid you mean \"steps\" instead of \"stepz\"?")
    raw = str(e.args[0]) if e.args else text
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
    if arg:  # a key the config tree moved (model.moe.num_experts -> ...topology...)
      from moejax.config import moved_hint  # pylint: disable=g-import-not-at-top
      moved = moved_hint(where.split(".", 1)[1] if "." in where else where)
      if moved:
        hint = f"; {moved}"
    return (f"{where}: {key!r} is not a config field{hint} (--print_config lists every field "
            "with its default)")
  file_arg = _config_file_arg(argv)
  flag = f"--{file_arg[0]}={file_arg[1]}" if file_arg else "--config"
  if isinstance(e, SyntaxError):
    return f"{flag}: cannot load it: SyntaxError: {e.msg} (line {e.lineno})"
  if "Errno 2" in text or "No such file" in text:
    return f"{flag}: no such file"
  if "config file" in text:
    return f"{flag}: cannot load it: {_last_line(text)}"
  return _last_line(text)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing, with config-file and override errors as one ``error:`` line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if "config" in str(e).lower() and any(a.startswith("--config") for a in argv):
      fail(describe_config_error(e, argv))
    fail(f"{str(e).rstrip('.')}. Pass --helpshort or --helpfull to see help on flags")
  except (KeyError, AttributeError, OSError, ValueError, TypeError, SyntaxError) as e:
    fail(describe_config_error(e, argv))


def config_tree(holder) -> object:
  """The config flag's value; a file that failed to load is one ``error:`` line."""
  try:
    value = holder.value
    hasattr(value, "to_dict")  # a file that failed to load raises on first attribute access
    return value
  except (OSError, KeyError, AttributeError, ValueError, SyntaxError) as e:
    fail(describe_config_error(e, sys.argv))


class _DropLibraryChatter(py_logging.Filter):
  """Drops INFO / WARNING records of TFDS and orbax (preparing, reading, saving notes)."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    path = record.pathname or ""
    noisy = "tensorflow_datasets" in path or "orbax" in path
    return not (noisy and record.levelno < py_logging.ERROR)


def quiet_logs(level=logging.WARNING) -> None:
  """Unless ``--verbosity`` was given: absl at ``level``, TFDS / orbax notes dropped."""
  if flags.FLAGS["verbosity"].present:
    return
  logging.set_verbosity(level)
  for handler in py_logging.getLogger().handlers + [logging.get_absl_handler()]:
    handler.addFilter(_DropLibraryChatter())


COMPILE_CACHE_DIR = "compile_cache"


def compilation_cache(workdir: str) -> str:
  """Turns on JAX's persistent compilation cache in ``workdir/compile_cache``; returns the dir.

  A suite trains the same programs again and again (every seed of an arm
  compiles the same train, evaluation and analysis steps; a resumed suite
  compiles them once more): with the cache, each compiles once. A cache
  named by ``JAX_COMPILATION_CACHE_DIR`` is used instead.
  """
  import jax  # pylint: disable=g-import-not-at-top
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(workdir, COMPILE_CACHE_DIR)
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return path


def run(main) -> None:
  app.run(main, flags_parser=parse_flags)
