"""What the binaries share: one ``error:`` line per failure, quiet libraries, config loading.

- :func:`run` is ``absl.app.run`` with a flag parser that turns the errors of
  ``ml_collections.config_flags`` (a misspelt ``--config.a.b`` key, a value
  of the wrong type, a missing or broken ``--config`` file) into one
  ``error:`` line (:mod:`experiments.flag_errors`) instead of a 50-line
  traceback, then makes the logs quiet.
- :func:`config_tree` reads the config flag's value (a config file that
  failed to load fails here, on first access).
- :func:`fail` prints ``error: ...`` to stderr and exits with status 1.
- :func:`check_writable` (a directory flag) and :func:`check_writable_file` (a file flag:
  ``--json_out``, ``--csv``, ``--out``): the pre-flight of what a binary writes, one
  ``error:`` line naming the flag's value before any output or compute.
- :func:`preempted` prints the line of a run stopped by SIGTERM / SIGINT
  (:mod:`moejax.train.preempt`) and exits with 143 / 130.
- :func:`quiet_logs`: absl INFO, TFDS / orbax notes below ERROR, and
  orbax's error records of a failed checkpoint write (the ``error:`` line
  reports it) stay out of the output unless ``--verbosity`` (``-v``) is given.
"""

from __future__ import annotations

import functools
import logging as py_logging
import os
import sys
import tempfile
import threading
import time
from typing import NoReturn, Optional, Sequence

from absl import app, flags, logging

from experiments import distributed as distributed_lib
from experiments import flag_errors
from moejax import chatter


# Seconds a failing binary waits for library threads before it exits without them.
EXIT_GRACE_SECONDS = 5.0


def fail(message: str) -> NoReturn:
  """Prints ``error: message`` and exits 1, within EXIT_GRACE_SECONDS.

  After a failed checkpoint save, orbax's threads wait up to 20 minutes for
  the signals of the operation that failed, and Python's exit would wait for
  them (a job holding its allocation until walltime): threads still alive
  after the grace period are abandoned (``os._exit``, output flushed first).
  """
  print(f"error: {message}", file=sys.stderr, flush=True)
  _exit_soon(1)


def _exit_soon(status: int) -> NoReturn:
  others = lambda: [t for t in threading.enumerate()
                    if t is not threading.current_thread() and not t.daemon and t.is_alive()]
  # Polled, not joined: orbax's threads override join() with a wait of their own.
  deadline = time.monotonic() + EXIT_GRACE_SECONDS
  while others() and time.monotonic() < deadline:
    time.sleep(0.05)
  # Only when a binary is the process (python -m experiments.X): a test or notebook calling
  # main() in-process gets SystemExit, never the end of its own process.
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  if others() and getattr(spec, "name", "").startswith("experiments."):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access
  sys.exit(status)


def check_writable(flag: str, path: Optional[str]) -> None:
  """The pre-flight of every binary that writes a directory: one ``error:`` line, before any
  output or compute, unless ``path`` can be created and written (tried, not read from the
  permission bits: moejax.train.writable). None: nothing to check."""
  if not path:
    return
  # pylint: disable=g-import-not-at-top
  from moejax.train.checkpoint import WorkdirError, check_writable as check
  try:
    check(path, flag)
  except WorkdirError as e:
    fail(f"{type(e).__name__}: {e}")


def check_writable_file(flag: str, path: Optional[str], name: str = "results.json") -> None:
  """The pre-flight of a binary that writes one file (``--json_out``, ``--csv``, ``--out``):
  one ``error:`` line naming the flag's value, before any output or compute, unless the
  file's directory can be created and written (tried, as in :func:`check_writable`) and the
  path is not a directory. The writer makes the missing directories (:func:`file_to_write`).
  ``name``: the file the fix suggests when ``path`` is a directory. None: nothing to check."""
  if not path:
    return
  # pylint: disable=g-import-not-at-top
  from moejax.train import writable
  from moejax.train.checkpoint import WorkdirError
  if os.path.isdir(path):
    fix = f"name a file in it, e.g. {flag}={os.path.join(path, name)}"
    fail(f"{WorkdirError.__name__}: {flag}={path} is a directory, not a file. Fix: {fix}")
  problem = writable.problem(os.path.dirname(os.path.abspath(path)))
  if problem is None and os.path.exists(path) and not os.access(path, os.W_OK):
    problem = f"{path} is not writable"
  if problem:
    example = _writable_file_example(path)
    fail(f"{WorkdirError.__name__}: {flag}={path} cannot be created or written: {problem}. "
         "Fix: pass a path in a writable directory"
         + (f", e.g. {flag}={example}" if example else ""))


def _writable_file_example(path: str) -> Optional[str]:
  """``path``'s file name in the home directory or the temporary one, whichever can be
  written (None when neither can)."""
  from moejax.train import writable  # pylint: disable=g-import-not-at-top
  for root in (os.path.expanduser("~"), tempfile.gettempdir()):
    candidate = os.path.join(root, os.path.basename(path))
    if (os.path.abspath(candidate) != os.path.abspath(path) and not os.path.isdir(candidate)
        and writable.problem(root) is None):
      return candidate
  return None


def file_to_write(path: str) -> str:
  """``path``, its missing directories made: the pre-flight (:func:`check_writable_file`)
  accepts a file whose directories can be created, so the write must create them."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return path


def preempted(e) -> NoReturn:
  """A run stopped by a signal after its checkpoint (moejax.train.preempt.Preempted)."""
  print(str(e), file=sys.stderr, flush=True)
  sys.exit(e.exit_status)


def parse_flags(argv: Sequence[str], experiment_at: Optional[str] = None,
                flag_values=None) -> list[str]:
  """absl's flag parsing, with config-file and override errors as one ``error:`` line.

  ``experiment_at``: where the experiment tree sits in the config tree
  (:mod:`experiments.flag_errors`). Then, unless ``--verbosity`` was given,
  the library chatter is turned off (:func:`quiet_logs`) before ``main`` runs.
  """
  fv = flags.FLAGS if flag_values is None else flag_values
  try:
    rest = fv(argv)
  except flags.IllegalFlagValueError as e:
    fail(flag_errors.describe_bad_value(e, fv)
         or _flag_error(e, argv, experiment_at, fv))
  except flags.Error as e:
    fail(_flag_error(e, argv, experiment_at, fv))
  except (KeyError, AttributeError, OSError, ValueError, TypeError, SyntaxError,
          ImportError) as e:
    fail(flag_errors.describe_config_error(e, argv, experiment_at, fv))
  if fv is flags.FLAGS:
    quiet_logs()
  return rest


def _flag_error(e: flags.Error, argv, experiment_at, fv) -> str:
  if "config" in str(e).lower() and any(a.startswith("--config") for a in argv):
    return flag_errors.describe_config_error(e, argv, experiment_at, fv)
  return f"{str(e).rstrip('.')}. Pass --helpshort or --helpfull to see help on flags"


def config_tree(holder) -> object:
  """The config flag's value; a file that failed to load is one ``error:`` line."""
  try:
    value = holder.value
    hasattr(value, "to_dict")  # a file that failed to load raises on first attribute access
    return value
  except (OSError, KeyError, AttributeError, ValueError, SyntaxError, ImportError) as e:
    fail(flag_errors.describe_config_error(e, sys.argv))


def quiet_logs(level=logging.WARNING) -> None:
  """Unless ``--verbosity`` (``-v``) was given: absl at ``level``, TFDS / orbax notes dropped.

  absl's ``app.run`` logs at INFO (``--verbosity=0``) by default, to stderr;
  orbax's restore notes and JAX's backend probing would come first in every
  binary's output. Called by :func:`parse_flags`, so before ``main``; calling
  it again is harmless.
  """
  if chatter.chatter_wanted():
    return
  logging.set_verbosity(level)
  for handler in py_logging.getLogger().handlers + [logging.get_absl_handler()]:
    if not any(isinstance(f, chatter.LibraryChatter) for f in handler.filters):
      handler.addFilter(library_filter())


def library_filter() -> chatter.LibraryChatter:
  """The binaries' log filter: library notes, and orbax's records of a write failure the
  trainer's ``error:`` line reports (moejax.train.write_failure), dropped."""
  from moejax.train import write_failure  # pylint: disable=g-import-not-at-top
  return chatter.LibraryChatter(reported=write_failure.reported_by_moejax)


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


def run(main, experiment_at: Optional[str] = None, distributed: bool = False) -> None:
  """``app.run(main)`` with :func:`parse_flags` (``experiment_at``: see there).

  ``distributed``: the binary trains, and may be one process of a
  multi-process run: it gets the launch flags of
  :mod:`experiments.distributed`, initialises ``jax.distributed`` before
  ``main`` when the flags or the cluster environment ask for it, and a peer
  process dying mid-run ends it with one ``error:`` line.
  """
  if distributed:
    distributed_lib.define_flags()
    main = functools.partial(_distributed_main, main)
  app.run(main, flags_parser=functools.partial(parse_flags, experiment_at=experiment_at))


def _distributed_main(main, argv):
  try:
    launch = distributed_lib.start()
  except distributed_lib.LaunchError as e:
    fail(str(e))
  if launch is None:
    return main(argv)  # one process: nothing more to watch for
  distributed_lib.guard_stderr(_flag_value("workdir"))
  try:
    return main(argv)
  except SystemExit as e:
    if e.code in (0, None):
      raise
    # An error this process found alone (another run's lock is checked by process
    # 0 only): its peers wait for it in a collective, and the exit handler's
    # shutdown barrier would wait for them (300 s); leaving now lets them see it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(e.code if isinstance(e.code, int) else 1)  # pylint: disable=protected-access
  except Exception as e:  # pylint: disable=broad-except
    message = distributed_lib.describe_failure(e, _flag_value("workdir"))
    if message is None:
      raise
    print(f"error: {message}", file=sys.stderr, flush=True)
    # Not sys.exit: its exit handlers (jax.distributed's shutdown barrier,
    # orbax's threads) would wait for the dead peer.
    os._exit(distributed_lib.PEER_LOST_EXIT)  # pylint: disable=protected-access


def _flag_value(name: str):
  return flags.FLAGS[name].value if name in flags.FLAGS else None
