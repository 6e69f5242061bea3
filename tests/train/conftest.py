"""Fixtures of the training tests: one prepared tiny corpus, one finished tiny run."""

from __future__ import annotations

import io
import shutil

import pytest

from moejax.train import loop
from tests.train import helpers


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


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
