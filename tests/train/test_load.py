"""moejax.load(workdir): the trained model (params and router state) and its config."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import moejax
from moejax.model import RouterStateVar, Transformer
from moejax.train import checkpoint as ckpt_lib
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer


def test_load_returns_the_trained_model_and_its_config(tiny_run):
  cfg, workdir, _, _ = tiny_run
  model, loaded_cfg = moejax.load(workdir)
  assert loaded_cfg == cfg and isinstance(model, Transformer)
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train, cfg.model))
  tree, _ = ckpt_lib.Checkpointer(workdir, 2, read_only=True).restore(
      40, abstract.checkpoint_tree())
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  router = nnx.to_pure_dict(nnx.state(model, RouterStateVar))
  for want, got in ((tree["params"], params), (tree["router_state"], router)):
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  bias = router["blocks"][0]["ffn"]["router_state"]["bias"]
  assert np.any(np.asarray(bias) != 0)  # the trained bias, not a fresh model's zeros
  logits, _ = model(np.zeros((1, 8), np.int32), train=False)
  assert logits.shape == (1, 8, cfg.model.vocab_size)
  earlier, _ = moejax.load(workdir, step=30)
  assert not np.array_equal(np.asarray(nnx.state(earlier, nnx.Param)["embed"]["embedding"]),
                            np.asarray(params["embed"]["embedding"]))


def test_load_of_a_directory_without_a_run_says_what_to_pass(tmp_path, tiny_run):
  with pytest.raises(ckpt_lib.WorkdirError, match="not a moejax run directory"):
    moejax.load(str(tmp_path))
  with pytest.raises(ckpt_lib.WorkdirError, match=r"no checkpoint at step 7.*\[30, 40\]"):
    moejax.load(tiny_run[1], step=7)
