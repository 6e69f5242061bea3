"""One finished tiny suite shared by the runner, compare and notebook tests."""

from __future__ import annotations

import io

import pytest

from moejax.ablation import runner, suite as suite_lib
from tests.ablation import helpers


@pytest.fixture(scope="session")
def tiny_suite_dir(tmp_path_factory):
  """(suite dir, printed output, results) of configs/tiny.py aux-loss vs bias, 6 steps,
  2 seeds."""
  workdir = str(tmp_path_factory.mktemp("ablation") / "tiny_suite")
  out = io.StringIO()
  results = runner.run_suite(suite_lib.suite_from_dict(helpers.tiny_suite()), workdir, out=out)
  return workdir, out.getvalue(), results
