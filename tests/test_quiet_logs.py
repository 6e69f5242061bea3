"""Orbax / absl notes stay out of the output of moejax.load and the binaries unless asked for."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import moejax
from moejax.train import checkpoint as ckpt_lib
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> str:
  """A run directory of configs/tiny.py with its initial state saved as checkpoint 1.

  Made by hand rather than trained: loading it is what is tested, and
  compiling a train step would cost most of the test's time.
  """
  workdir = str(tmp_path_factory.mktemp("quiet") / "run")
  cfg = helpers.experiment("tiny", str(tmp_path_factory.mktemp("tfds")))
  os.makedirs(workdir)
  ckpt_lib.write_config(workdir, cfg)
  _, state = step_lib.init_state(cfg, make_optimizer(cfg.train, cfg.model, cfg.finetune))
  ckpt = ckpt_lib.Checkpointer(workdir, 1)
  ckpt.save(1, state.checkpoint_tree(), {})
  ckpt.wait()
  ckpt.close()
  return workdir


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
