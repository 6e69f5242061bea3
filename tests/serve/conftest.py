"""Fixtures of the serving tests."""

from __future__ import annotations

import pytest

from tests.train import helpers


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> str:
  """A run directory of configs/tiny.py with its initial state as checkpoint 1."""
  return helpers.initial_run(str(tmp_path_factory.mktemp("consistency") / "run"),
                             str(tmp_path_factory.mktemp("tfds")))
