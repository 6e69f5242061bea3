"""One finished tiny suite shared by the runner, compare and notebook tests."""

from __future__ import annotations

import io
import json

import pytest

from moejax.ablation import runner, suite as suite_lib
from tests import shared_dirs
from tests.ablation import helpers


@pytest.fixture(scope="session")
def tiny_suite_dir(request):
  """(suite dir, printed output, results) of configs/tiny.py aux-loss vs bias, 6 steps,
  2 seeds; built once per test run (every xdist worker reads the same one)."""
  def build(path):
    out = io.StringIO()
    results = runner.run_suite(suite_lib.suite_from_dict(helpers.tiny_suite()),
                               str(path / "tiny_suite"), out=out)
    (path / "built.json").write_text(json.dumps({"printed": out.getvalue(),
                                                 "results": results}))

  path = shared_dirs.build_once(request, "tiny_suite", build)
  built = json.loads((path / "built.json").read_text())
  return str(path / "tiny_suite"), built["printed"], built["results"]
