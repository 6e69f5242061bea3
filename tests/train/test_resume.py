"""What a workdir's results say stays true: relabelling refused, extension, damage, resume rows.

Every test works on a private copy of the finished 40-step tiny run
(checkpoints at 30 and 40) or on a small run of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import json
import os
import re
import shutil
import sys

import pytest

from moejax.train import checkpoint as ckpt_lib
from moejax.train import event_loops, loop, metrics_log
from tests.train import helpers

COMPARED = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "active_experts_mean")


def _rows(workdir, split):
  return {r["step"]: r for r in metrics_log.read_metrics(workdir, split)}


def _config(workdir):
  with open(os.path.join(workdir, ckpt_lib.CONFIG_FILE)) as f:
    return json.load(f)


@pytest.mark.parametrize("overrides, lines", [
    ({"train__learning_rate": 2e-2}, ["train.learning_rate: stored 0.01, requested 0.02"]),
    ({"train__seed": 1, "train__weight_decay": 0.0},
     ["train.seed: stored 0, requested 1", "train.weight_decay: stored 0.1, requested 0.0"]),
])
def test_a_changed_optimizer_or_seed_is_refused_untouched(tiny_run, data_dir, overrides, lines):
  _, workdir, _, _ = tiny_run
  before = helpers.snapshot(workdir)
  with pytest.raises(ckpt_lib.WorkdirError, match="would misdescribe") as err:
    loop.train(helpers.experiment("tiny", data_dir, **overrides), workdir, out=io.StringIO())
  for line in lines:
    assert line in str(err.value)
  assert "Fix: use a new --workdir" in str(err.value)
  assert helpers.snapshot(workdir) == before


def test_more_steps_need_extend_and_then_train_the_extra_steps(tiny_copy, data_dir):
  cfg, workdir = tiny_copy
  longer = helpers.experiment("tiny", data_dir, train__steps=50)
  before = helpers.snapshot(workdir)
  with pytest.raises(ckpt_lib.WorkdirError,
                     match=r"train\.steps=40 .* train\.steps=50 would relabel.*pass --extend"):
    loop.train(longer, workdir, out=io.StringIO())
  with pytest.raises(ckpt_lib.WorkdirError, match="use a new --workdir for a shorter run"):
    loop.train(helpers.experiment("tiny", data_dir, train__steps=30), workdir, out=io.StringIO(),
               extend=True)
  assert helpers.snapshot(workdir) == before
  out = io.StringIO()
  summary = loop.train(longer, workdir, out=out, extend=True)
  assert "extending the run from train.steps=40 to 50 (from step 40" in out.getvalue()
  assert summary["step"] == 50 and sorted(_rows(workdir, "train"))[-3:] == [40, 45, 50]
  assert _config(workdir)["train"]["steps"] == 50
  events = [(h["event"], h.get("steps")) for h in ckpt_lib.read_history(workdir)]
  assert events[-3:] == [("extend", [40, 50]), ("resume", None), ("end", None)]


def test_finished_run_resumed_with_only_logging_changes_writes_nothing(tiny_copy, data_dir):
  cfg, workdir = tiny_copy
  before = helpers.snapshot(workdir)
  out = io.StringIO()
  summary = loop.train(helpers.experiment("tiny", data_dir, train__log_every=10,
                                          train__eval_batches=2), workdir, out=out)
  assert helpers.snapshot(workdir) == before  # config.json of a finished run is never rewritten
  text = out.getvalue()
  assert "nothing to do" in text and "None" not in text
  train, evals = _rows(workdir, "train"), _rows(workdir, "eval")
  assert summary["train_loss"] == train[40]["loss"] and summary["val_loss"] == evals[40]["loss"]
  assert f"train loss {train[40]['loss']:.4f} | val loss {evals[40]['loss']:.4f}" in text
  for path in ("config.json", "metrics.jsonl", "tensorboard", "checkpoints"):
    assert os.path.join(workdir, path) in text


def test_execution_backend_is_not_part_of_the_run(tiny_copy, data_dir):
  # Started with the reference backend, resumed with the blocked kernel: the
  # parameters are the same arrays, so the run may continue.
  cfg, workdir = tiny_copy
  shutil.rmtree(os.path.join(workdir, "checkpoints", "40"))
  out = io.StringIO()
  summary = loop.train(helpers.experiment("tiny", data_dir, model__moe__execution__backend="blocked"),
                       workdir, out=out)
  assert summary["step"] == 40
  assert "model.moe.execution.backend: 'reference' -> 'blocked'" in out.getvalue()
  assert _config(workdir)["model"]["moe"]["execution"]["backend"] == "blocked"  # what ran last


@pytest.mark.parametrize("stored", ["reference", "blocked"])
def test_a_run_stored_before_auto_resumes_with_auto(tiny_copy, data_dir, stored):
  # config.json as moejax wrote it before backend='auto' (and derived_from) existed.
  _, workdir = tiny_copy
  saved = _config(workdir)
  ex = saved["model"]["moe"]["execution"]
  del ex["derived_from"]
  ex["backend"] = stored
  with open(os.path.join(workdir, ckpt_lib.CONFIG_FILE), "w") as f:
    json.dump(saved, f)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "40"))
  cfg = helpers.experiment("tiny", data_dir, model__moe__execution__backend="auto")
  plan = ckpt_lib.check_workdir(workdir, cfg.for_platform("cpu"))  # as the trainer resolves it
  assert plan.step == 30 and not plan.finished
  moved = [f"model.moe.execution.backend: {stored!r} -> 'blocked'"] if stored != "blocked" else []
  execution = [c for c in plan.changes if c.startswith("model.moe.execution")]
  assert execution == moved + ["model.moe.execution.derived_from: '' -> 'auto on cpu'"]


def test_a_changed_shape_rule_is_not_part_of_the_run(tiny_copy, data_dir):
  # auto's shape rule (moejax.execution.shape_choice) picks a backend per shape: the
  # parameters are the same arrays, so a run resumes under another rule.
  _, workdir = tiny_copy
  shutil.rmtree(os.path.join(workdir, "checkpoints", "40"))
  cfg = helpers.experiment("tiny", data_dir, model__moe__execution__large_group_backend=(
      "whole_group"), model__moe__execution__large_group_rows=64)
  plan = ckpt_lib.check_workdir(workdir, cfg)
  assert plan.step == 30 and not plan.finished
  assert [c for c in plan.changes if c.startswith("model.moe.execution")] == [
      "model.moe.execution.large_group_backend: '' -> 'whole_group'",
      "model.moe.execution.large_group_rows: 0 -> 64"]


def _damage(workdir, step, which):
  root = os.path.join(workdir, "checkpoints", str(step), "state")
  if which == "metadata":
    path = os.path.join(root, "_METADATA")
  else:  # the largest array data file
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    path = max((f for f in files if os.sep + "d" + os.sep in f), key=os.path.getsize)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 3)


@contextlib.contextmanager
def _unraisable_reports():
  """The names of the objects Python reports as "Exception ignored in" inside the block,
  garbage collected at its end."""
  names, previous = [], sys.unraisablehook
  sys.unraisablehook = lambda u: names.append(getattr(u.object, "__name__", repr(u.object)))
  try:
    yield names
    gc.collect()
  finally:
    sys.unraisablehook = previous


def _restore_like_orbax():
  """orbax's pattern: the reads as tasks of a fresh loop, the first failure ends the gather
  and the loop is closed with the other read still pending."""
  async def read(fail):
    try:
      if fail:
        raise OSError("truncated")
      await asyncio.sleep(3600)
    except BaseException as e:  # orbax's except clause
      raise Exception("Encountered error while reading array index") from e

  async def restore():
    await asyncio.gather(read(True), read(False))
  loop = asyncio.new_event_loop()
  try:
    loop.run_until_complete(restore())
  except Exception:  # pylint: disable=broad-except
    pass
  finally:
    loop.close()


def test_a_restores_event_loop_finishes_the_reads_a_failure_abandoned():
  with _unraisable_reports() as abandoned:  # plain loops: the pending read is reported
    _restore_like_orbax()
  assert abandoned == ["read"]
  policy = asyncio.get_event_loop_policy()
  with _unraisable_reports() as ignored, event_loops.draining_event_loops():
    _restore_like_orbax()
  assert ignored == []
  assert asyncio.get_event_loop_policy() is policy  # put back


@pytest.mark.parametrize("which", ["array", "metadata"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tiny_copy, data_dir, which):
  cfg, workdir = tiny_copy
  before_train, before_eval = _rows(workdir, "train"), _rows(workdir, "eval")
  _damage(workdir, 40, which)
  out = io.StringIO()
  with _unraisable_reports() as ignored:  # orbax's abandoned reads end inside the restore
    summary = loop.train(cfg, workdir, out=out)
  assert ignored == []
  text = out.getvalue()
  assert "checkpoint 40 is damaged" in text and "falling back to checkpoint 30" in text
  assert os.path.isdir(os.path.join(workdir, ckpt_lib.DAMAGED_DIR, "40"))
  assert ckpt_lib.checkpoint_steps(workdir) == [30, 40]  # 40 trained and saved again
  after = _rows(workdir, "train")
  for key in COMPARED:
    assert after[40][key] == before_train[40][key], key
  assert summary["val_loss"] == before_eval[40]["loss"]


def test_no_usable_checkpoint_is_a_short_error_before_any_write(tiny_copy, data_dir):
  cfg, workdir = tiny_copy
  _damage(workdir, 40, "array")
  _damage(workdir, 30, "metadata")
  before = helpers.snapshot(workdir)
  with _unraisable_reports() as ignored, pytest.raises(ckpt_lib.WorkdirError) as err:
    loop.train(cfg, workdir, out=io.StringIO())
  assert ignored == []
  msg = str(err.value)
  # The array named by its key (moejax.train.damage), not orbax's pybind / TensorStore repr.
  assert re.search(r"step 40: damaged, its array [\w.]+ cannot be read \([A-Z_]+: ", msg), msg
  assert "TensorStore" not in msg and "pybind" not in msg
  assert "step 30: damaged, its metadata cannot be read" in msg
  assert len(msg.splitlines()) == 4 and "Fix: use a new --workdir" in msg
  assert helpers.snapshot(workdir) == before  # config.json included


def test_resumed_metrics_equal_the_uninterrupted_ones_when_checkpoints_fall_between_rows(
    tmp_path, data_dir):
  # checkpoint_every=6 is not a multiple of log_every=4: the row at step 8
  # averages steps 5-8, two of them before the checkpoint at 6.
  cfg = helpers.experiment("tiny", data_dir, train__steps=12, train__log_every=4,
                           train__checkpoint_every=6, train__keep_checkpoints=3,
                           train__eval_every=0)
  whole = str(tmp_path / "whole")
  loop.train(cfg, whole, out=io.StringIO())
  resumed = str(tmp_path / "resumed")
  shutil.copytree(whole, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "12"))
  out = io.StringIO()
  loop.train(cfg, resumed, out=out)
  assert "resumed from checkpoint at step 6" in out.getvalue()
  want, got = _rows(whole, "train"), _rows(resumed, "train")
  assert sorted(got) == sorted(want) == [4, 8, 12]
  for step in want:
    for key in COMPARED:
      assert got[step][key] == want[step][key], (step, key)


def test_a_config_json_written_before_new_fields_existed_still_resumes(tiny_copy, data_dir):
  # Fields added to moejax later (model.norm_eps, data.loss_domains, the finetune section)
  # stand for their defaults in an older config.json: not a change that refuses the run.
  cfg, workdir = tiny_copy
  stored = _config(workdir)
  del stored["finetune"], stored["model"]["norm_eps"], stored["data"]["loss_domains"]
  with open(os.path.join(workdir, ckpt_lib.CONFIG_FILE), "w") as f:
    json.dump(stored, f)
  plan = ckpt_lib.check_workdir(workdir, cfg)
  assert plan.finished and not plan.changes
  with pytest.raises(ckpt_lib.WorkdirError, match="model.norm_eps: stored 1e-06, requested 1e-05"):
    ckpt_lib.check_workdir(workdir, helpers.experiment("tiny", data_dir, model__norm_eps=1e-5))
