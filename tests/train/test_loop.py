"""The training loop on configs/tiny.py: loss, metrics, resume, NaN guard, refusals.

One 40-step tiny run (module fixture, checkpoints at 30 and 40 kept) is
shared by most tests; each test that writes works on a copy of its workdir.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import jax
import numpy as np
import pytest

from moejax.data import DatasetUnavailableError
from moejax.train import checkpoint as ckpt_lib
from moejax.train import guard, loop, metrics_log
from moejax.train.optim import make_optimizer
from moejax.train import step as step_lib
from tests.train import helpers

COMPARED = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "active_experts_mean")


def _rows(workdir, split):
  return {r["step"]: r for r in metrics_log.read_metrics(workdir, split)}


def test_tiny_run_learns_and_logs_every_metric(tiny_run):
  cfg, workdir, summary, stdout = tiny_run
  train = _rows(workdir, "train")
  assert sorted(train) == list(range(5, 41, 5))
  assert train[40]["loss"] < train[5]["loss"] - 1.0, (train[5]["loss"], train[40]["loss"])
  assert summary["val_loss"] < summary["unigram_baseline"], summary
  for key in COMPARED + ("drop_rate", "active_experts_var", "tokens_per_s", "learning_rate"):
    assert np.isfinite(train[40][key]), key
  # Fixed top-2 routing: every token has exactly 2 experts.
  assert train[40]["active_experts_mean"] == 2.0 and train[40]["active_experts_var"] == 0.0
  # loss = CE + the balance losses the model returns.
  np.testing.assert_allclose(train[40]["loss"], train[40]["ce"] + train[40]["aux_loss"], rtol=1e-5)
  evals = _rows(workdir, "eval")
  assert sorted(evals) == [20, 40]
  final = evals[40]
  assert final["loss"] == pytest.approx(summary["val_loss"])
  for layer in ("layer_0", "layer_1"):
    assert 0.0 <= final[f"{layer}/max_vio_global"] <= 3.0  # E - 1 = 3 at most
    assert 0.0 <= final[f"{layer}/specialisation_mi_norm"] <= 1.0
  assert final["max_vio_global"] == pytest.approx(
      np.mean([final["layer_0/max_vio_global"], final["layer_1/max_vio_global"]]))
  # The final evaluation reads the whole split; the periodic one 4 batches of 8x32.
  assert evals[20]["tokens"] == 4 * 8 * 32 and final["tokens"] > evals[20]["tokens"]
  # Progress lines with ETA, TensorBoard events, the saved config.
  assert "step 40/40 (100%)" in stdout and "ETA" in stdout and "tok/s" in stdout
  assert os.listdir(os.path.join(workdir, metrics_log.TENSORBOARD_DIR))
  with open(os.path.join(workdir, ckpt_lib.CONFIG_FILE)) as f:
    assert json.load(f)["model"]["d_model"] == cfg.model.d_model
  assert ckpt_lib.checkpoint_steps(workdir) == [30, 40]  # keep_checkpoints=2


def _restore(cfg, workdir, step):
  tx = make_optimizer(cfg.train)
  _, abstract = step_lib.abstract_state(cfg, tx)
  tree, data_state = ckpt_lib.Checkpointer(workdir, 2, read_only=True).restore(
      step, abstract.checkpoint_tree())
  return tree, data_state


def test_checkpoint_holds_router_state_moved_by_the_controller_not_the_optimizer(tiny_run):
  cfg, workdir, _, _ = tiny_run
  tree, data_state = _restore(cfg, workdir, 40)
  assert int(tree["step"]) == 40 and data_state["step"] + data_state["epoch"] > 0
  for i in range(cfg.model.n_layers):
    rs = tree["router_state"]["blocks"][i]["ffn"]["router_state"]
    assert int(rs["step"]) == 40  # one controller update per train step
    # Sign updates of rate 1e-3: every bias is a nonzero multiple of 1e-3.
    units = np.asarray(rs["bias"]) / cfg.model.moe.balance.bias_rate
    np.testing.assert_allclose(units, np.round(units), atol=1e-3)
    assert np.any(units != 0)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      tree["opt_state"])[0]]
  assert paths and not any("router_state" in p for p in paths)


def test_resume_from_a_checkpoint_repeats_the_same_steps(tiny_copy):
  cfg, workdir = tiny_copy
  before_train, before_eval = _rows(workdir, "train"), _rows(workdir, "eval")
  shutil.rmtree(os.path.join(workdir, "checkpoints", "40"))
  out = io.StringIO()
  loop.train(cfg, workdir, out=out)
  assert "resumed from checkpoint at step 30" in out.getvalue()
  after_train, after_eval = _rows(workdir, "train"), _rows(workdir, "eval")
  assert sorted(after_train) == sorted(before_train)  # rows after 30 replaced, not duplicated
  for s in (35, 40):
    for key in COMPARED:
      assert after_train[s][key] == before_train[s][key], (s, key)
  assert after_eval[40]["loss"] == before_eval[40]["loss"]


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, data_dir):
  cfg = helpers.experiment("tiny", data_dir, train__nan_at_step=13, train__checkpoint_every=5,
                           train__eval_every=0)
  workdir = str(tmp_path / "run")
  with pytest.raises(guard.NonFiniteError,
                     match=r"loss is nan at step 13 .*last good checkpoint .*is step 10"):
    loop.train(cfg, workdir, out=io.StringIO())
  assert ckpt_lib.checkpoint_steps(workdir) == [5, 10]
  assert max(_rows(workdir, "train")) == 10
  # The kept checkpoint is finite and resumable (without the hook it runs on).
  tree, _ = _restore(cfg, workdir, 10)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree["params"]))


def test_workdir_of_another_model_is_refused_untouched(tiny_run, data_dir):
  cfg, workdir, _, _ = tiny_run
  before = helpers.snapshot(workdir)
  other = helpers.experiment("tiny", data_dir, model__d_model=64)
  with pytest.raises(ckpt_lib.WorkdirError, match=r"model\.d_model: stored 32, requested 64"):
    loop.train(other, workdir, out=io.StringIO())
  other_data = helpers.experiment("tiny", data_dir, data__seq_len=16)
  with pytest.raises(ckpt_lib.WorkdirError, match=r"data\.seq_len"):
    loop.train(other_data, workdir, out=io.StringIO())
  assert helpers.snapshot(workdir) == before


def test_checkpoint_shapes_are_checked_against_the_model(tiny_copy, data_dir):
  # A config.json that agrees with the new model but checkpoints that do not:
  # the second line of defence reads the checkpoint's array metadata.
  cfg, workdir = tiny_copy
  other = helpers.experiment("tiny", data_dir, model__moe__topology__expert_width=16)
  ckpt_lib.write_config(workdir, other)
  before = helpers.snapshot(workdir)
  with pytest.raises(ckpt_lib.WorkdirError, match=r"(?s)does not fit this model.*params/.*w_down"):
    loop.train(other, workdir, out=io.StringIO())
  assert helpers.snapshot(workdir) == before


def test_missing_dataset_fails_before_the_workdir_exists(tmp_path):
  cfg = helpers.experiment("tiny", str(tmp_path / "empty_tfds"), data__name="tiny_shakespeare")
  workdir = str(tmp_path / "run")
  with pytest.raises(DatasetUnavailableError, match="tiny_shakespeare"):
    loop.train(cfg, workdir, out=io.StringIO())
  assert not os.path.exists(workdir)


def test_changed_logging_config_resumes_and_is_reported(tiny_copy, data_dir):
  # Only bookkeeping changes (the compiled step stays the same program).
  cfg, workdir = tiny_copy
  shutil.rmtree(os.path.join(workdir, "checkpoints", "40"))
  changed = helpers.experiment("tiny", data_dir, train__log_every=10)
  out = io.StringIO()
  summary = loop.train(changed, workdir, out=out)
  assert "train.log_every: 5 -> 10" in out.getvalue() and summary["step"] == 40
  assert sorted(_rows(workdir, "train")) == [5, 10, 15, 20, 25, 30, 40]
  with open(os.path.join(workdir, ckpt_lib.CONFIG_FILE)) as f:
    assert json.load(f)["train"]["log_every"] == 10  # an unfinished run trains on under it
  history = ckpt_lib.read_history(workdir)
  assert history[-2]["event"] == "resume"
  assert "train.log_every: 5 -> 10" in history[-2]["changes"]
