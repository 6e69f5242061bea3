"""Fixtures of the training tests: one prepared tiny corpus, one finished tiny run.

Both are built once per test run and shared by every pytest-xdist worker
(tests/shared_dirs.py): the corpus directory is one for the whole run (the
datasets prepare under their own file lock, moejax.data.datasets), and the
finished run is trained by the first worker that needs it.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest

from moejax.train import loop
from tests import shared_dirs
from tests.train import helpers


@pytest.fixture(scope="session")
def data_dir(request):
  return str(shared_dirs.build_once(request, "tfds", lambda path: None))


@pytest.fixture(scope="session")
def tiny_run(request, data_dir):
  """A finished 40-step run of configs/tiny.py: (cfg, workdir, summary, stdout).

  Shared by every test module and every xdist worker (built once): tests
  read it only (and check that refused runs leave it untouched); tests that
  write work on ``tiny_copy``.
  """
  cfg = helpers.experiment("tiny", data_dir, train__progress=True)

  def build(path):
    out = io.StringIO()
    summary = loop.train(cfg, str(path / "run"), out=out)
    (path / "built.json").write_text(json.dumps({"summary": summary, "stdout": out.getvalue()}))

  path = shared_dirs.build_once(request, "tiny_run", build)
  built = json.loads((path / "built.json").read_text())
  return cfg, str(path / "run"), built["summary"], built["stdout"]


@pytest.fixture
def tiny_copy(tiny_run, tmp_path):
  """A private copy of the finished tiny run's workdir."""
  cfg, workdir, _, _ = tiny_run
  dst = str(tmp_path / "copy")
  shutil.copytree(workdir, dst)
  return cfg, dst
