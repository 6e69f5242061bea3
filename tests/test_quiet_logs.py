"""Orbax / absl notes stay out of the output of moejax.load and the binaries unless asked for."""

from __future__ import annotations

import errno
import io
import logging
import os
import subprocess
import sys

import pytest

import moejax
from experiments import cli
from tests.train import helpers


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> str:
  """A run directory of configs/tiny.py with its initial state saved as checkpoint 1.

  Made by hand rather than trained: loading it is what is tested, and
  compiling a train step would cost most of the test's time.
  """
  return helpers.initial_run(str(tmp_path_factory.mktemp("quiet") / "run"),
                             str(tmp_path_factory.mktemp("tfds")))


class _Records(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.records = []

  def emit(self, record):
    self.records.append(record)


def _orbax_records(workdir: str, level: int) -> list[logging.LogRecord]:
  """What reaches a handler on the absl logger (at ``level``) while moejax.load runs."""
  logger, seen = logging.getLogger("absl"), _Records()
  before = logger.level
  logger.addHandler(seen)
  logger.setLevel(level)
  try:
    moejax.load(workdir)
  finally:
    logger.removeHandler(seen)
    logger.setLevel(before)
  return [r for r in seen.records if f"{os.sep}orbax{os.sep}" in r.pathname]


def test_load_keeps_orbax_quiet_unless_the_caller_logs_at_debug(tiny_run):
  assert _orbax_records(tiny_run, logging.INFO) == []
  shown = _orbax_records(tiny_run, logging.DEBUG)
  assert any(r.levelno == logging.INFO and "Restoring checkpoint" in r.getMessage()
             for r in shown)
  # The filter was scoped: nothing of it is left on the caller's logger.
  assert logging.getLogger("absl").filters == []


def _generate(workdir: str, cache: str, *flags: str) -> subprocess.CompletedProcess:
  # A shared compilation cache: the second run does not compile the decoder again.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run([sys.executable, "-m", "experiments.generate", f"--workdir={workdir}",
                         "--prompt=def", "--max_new_tokens=1", *flags], cwd=helpers.ROOT,
                        env=env, capture_output=True, text=True, timeout=300)


def test_generate_prints_no_log_lines_and_verbosity_brings_them_back(tiny_run, tmp_path):
  cache = str(tmp_path / "jax_cache")
  quiet = _generate(tiny_run, cache)
  assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr[-2000:]
  assert "--- prompt: 'def'" in quiet.stdout
  loud = _generate(tiny_run, cache, "--verbosity=1")
  assert loud.returncode == 0, loud.stderr[-2000:]
  assert "checkpoint_manager.py" in loud.stderr and "Restoring checkpoint from" in loud.stderr


# One of the five ERROR records orbax logs when a checkpoint write hits a full disk (the message
# shortened; the real one carries the whole TensorStore spec), as tests/train/test_write_failure.py
# has it.
_ENOSPC = ('RESOURCE_EXHAUSTED: Failed writing: "/w/checkpoints/340.orbax-checkpoint-tmp/state/d/'
           "a8\": Failed to write 2318 bytes to file 14: No space left on device "
           "[os_error_code='28']")
_ORBAX = os.path.join(os.sep, "venv", "site-packages", "orbax", "checkpoint", "_src", "futures",
                      "future.py")


def _record(pathname: str, level: int, message: str, error: BaseException | None):
  exc_info = None
  if error is not None:
    try:
      raise error
    except type(error):
      exc_info = sys.exc_info()
  return logging.LogRecord("absl", level, pathname, 387, message, (), exc_info)


def _shown(*records) -> str:
  """What a handler with the binaries' filter (experiments.cli.quiet_logs) prints."""
  out = io.StringIO()
  handler = logging.StreamHandler(out)
  handler.addFilter(cli.library_filter())
  for record in records:
    handler.handle(record)
  return out.getvalue()


def test_orbax_error_records_of_a_failed_write_are_left_to_moejax_error_line():
  thread = "[process=0][thread=array_type_handler] _SignalingThread.run() raised an exception: "
  failed = [
      _record(_ORBAX, logging.ERROR, thread + _ENOSPC, ValueError(_ENOSPC)),
      _record(_ORBAX, logging.ERROR, "Save Finalize thread (save_finalize) failed.",
              OSError(errno.EROFS, "Read-only file system", "/w/checkpoints/50.orbax-tmp")),
      _record(_ORBAX, logging.ERROR, thread + _ENOSPC, None),  # the errno in the message only
  ]
  assert _shown(*failed) == ""
  # Any other orbax error passes whole, traceback included; so do errors of other code.
  other = _record(_ORBAX, logging.ERROR, "restore failed", KeyError("params"))
  text = _shown(other)
  assert text.startswith("restore failed\nTraceback (most recent call last):") and \
      "KeyError: 'params'" in text
  mine = _record(os.path.join(os.sep, "src", "moejax", "x.py"), logging.ERROR, _ENOSPC, None)
  assert _shown(mine) == _ENOSPC + "\n"
  # Orbax's notes below ERROR stay dropped, as before.
  assert _shown(_record(_ORBAX, logging.WARNING, "a note", None)) == ""
