"""Fixtures of the training tests: one prepared tiny corpus, one finished tiny run."""

from __future__ import annotations

import io
import shutil

import jax
import pytest

from moejax.train import loop
from tests.train import helpers


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """JAX's persistent compilation cache, shared by these tests and their subprocesses.

  The runs here compile the same few programs again and again (resume, the
  subprocesses of the kill test); on 2 CPU cores compiling is most of their
  time. Returns the environment variables that point a subprocess at it.
  """
  path = str(tmp_path_factory.mktemp("jax_cache"))
  previous = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  for name, value in previous.items():
    jax.config.update(name, value)


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, data_dir):
  """A finished 40-step run of configs/tiny.py: (cfg, workdir, summary, stdout).

  Shared by every test module: tests read it only (and check that refused
  runs leave it untouched); tests that write work on ``tiny_copy``.
  """
  workdir = str(tmp_path_factory.mktemp("tiny_run") / "run")
  cfg = helpers.experiment("tiny", data_dir, train__progress=True)
  out = io.StringIO()
  summary = loop.train(cfg, workdir, out=out)
  return cfg, workdir, summary, out.getvalue()


@pytest.fixture
def tiny_copy(tiny_run, tmp_path):
  """A private copy of the finished tiny run's workdir."""
  cfg, workdir, _, _ = tiny_run
  dst = str(tmp_path / "copy")
  shutil.copytree(workdir, dst)
  return cfg, dst
