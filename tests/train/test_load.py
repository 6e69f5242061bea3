"""moejax.load(workdir): the trained model (params and router state) and its config."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

import moejax
from moejax.model import RouterStateVar, Transformer
from moejax.train import checkpoint as ckpt_lib
from moejax.train import integrity
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers


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


# Orbax may leave the read coroutines of a restore unawaited; harmless here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_load_verifies_the_checkpoint_against_its_checksums(tiny_copy, capsys):
  cfg, workdir = tiny_copy
  moejax.load(workdir)  # verified: nothing said
  assert capsys.readouterr().err == ""
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train, cfg.model))
  helpers.flip_one_byte(workdir, 40, abstract.checkpoint_tree())
  step_dir = os.path.join(workdir, "checkpoints", "40")
  with pytest.raises(ckpt_lib.WorkdirError) as e:
    moejax.load(workdir)
  text = str(e.value)
  assert text.startswith(f"checkpoint 40 in {os.path.join(workdir, 'checkpoints')} is damaged: "
                         "1 value differs from the checksums recorded when it was saved (")
  leaf = text.split("(", 1)[1].split(":", 1)[0]
  assert leaf.startswith(("params/", "opt_state/", "router_state/", "other/")), leaf
  assert "Fix: load an earlier checkpoint (step=30; kept: [30, 40])" in text
  assert f"mv {step_dir} {os.path.join(workdir, 'damaged_checkpoints', '40')}" in text
  moejax.load(workdir, step=30)  # the earlier one is intact and verified
  # Without its checksums.json the same damage cannot be seen: accepted, said once.
  os.remove(os.path.join(step_dir, integrity.FILE))
  capsys.readouterr()
  moejax.load(workdir)
  moejax.load(workdir)
  err = capsys.readouterr().err
  assert err == f"note: {step_dir} loaded unverified: no checksums.json (written before " \
                "checkpoints carried checksums, or the run stopped before they were written)\n"
