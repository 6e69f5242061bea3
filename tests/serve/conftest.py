"""Fixtures of the serving tests."""

from __future__ import annotations

import os

import pytest

from moejax.train import checkpoint as ckpt_lib
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> str:
  """A run directory of configs/tiny.py: its config and its initial state as checkpoint 1
  (loading and measuring a run is what the tests ask; training it would cost their time)."""
  workdir = str(tmp_path_factory.mktemp("consistency") / "run")
  cfg = helpers.experiment("tiny", str(tmp_path_factory.mktemp("tfds")))
  os.makedirs(workdir)
  ckpt_lib.write_config(workdir, cfg)
  _, state = step_lib.init_state(cfg, make_optimizer(cfg.train, cfg.model, cfg.finetune))
  ckpt = ckpt_lib.Checkpointer(workdir, 1)
  ckpt.save(1, state.checkpoint_tree(), {})
  ckpt.wait()
  ckpt.close()
  return workdir
