"""End to end on a tiny suite: outputs, resume without retraining, a half-finished suite."""

from __future__ import annotations

import io
import json
import os
import shutil


from moejax.ablation import runner, suite as suite_lib
from moejax.ablation import summary
from moejax.train import loop
from tests.ablation import helpers

# Every test here uses the tiny suite run (conftest): ~40 s of compilation on an idle
# 2-core machine, 2 min on a loaded one.


def test_tiny_suite_writes_results_table_and_plots(tiny_suite_dir):
  workdir, printed, results = tiny_suite_dir
  assert set(results) == {"aux", "bias"}
  assert "total*" in printed and "ok  active" in printed  # the budget table came first
  for arm in ("aux", "bias"):
    with open(os.path.join(workdir, arm, "result.json")) as f:
      res = json.load(f)
    assert res["budget"]["tokens"] == 6 * 8 * 32
    assert res["train_summary"]["step"] == 6
    for key in ("val_loss", "max_vio_batch", "max_vio_global", "drop_rate",
                "specialisation_mi_norm", "active_experts_var", "a2a_bytes_per_token",
                "moe_latency_p99_ms", "probe_leak_gap"):
      assert isinstance(res[key], float), key
    assert res["exposed_comm"] is None and res["exposed_comm_note"].startswith("n/a")
    # top-k routing is causal: the prefix-only loss equals the teacher-forced one.
    assert abs(res["probe_leak_gap"]) < 1e-3
    with open(os.path.join(workdir, arm, "routing.json")) as f:
      routing = json.load(f)
    assert routing["steps"] == [3, 6]  # every kept checkpoint
    layer = routing["layers"]["layer_0"]
    assert len(layer["load_over_training"]) == 2 and len(layer["coact"]) == 4
  md = open(os.path.join(workdir, "summary.md")).read()
  assert md.index("| aux |") < md.index("| bias |")  # suite order
  rows = summary.read_csv(os.path.join(workdir, "summary.csv"))
  assert [r["arm"] for r in rows] == ["aux", "bias"]
  for png in ("metrics.png", "curves.png"):
    assert os.path.getsize(os.path.join(workdir, "plots", png)) > 1000


def _count_calls(calls):
  def train_fn(exp, path, out):
    calls.append(path)
    return loop.train(exp, path, out=out)
  return train_fn


def test_rerun_skips_finished_arms(tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  copy = workdir + "_rerun"
  shutil.copytree(workdir, copy)
  calls, out = [], io.StringIO()
  runner.run_suite(suite_lib.suite_from_dict(helpers.tiny_suite()), copy, out=out,
                   train_fn=_count_calls(calls))
  assert calls == []
  assert out.getvalue().count("finished earlier, not retrained") == 2


def test_killed_suite_resumes_only_the_unfinished_arm(tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  copy = workdir + "_killed"
  shutil.copytree(workdir, copy)
  # As if killed after 'bias' trained but before its result was written: its
  # checkpoints are there, its result.json is not.
  os.remove(os.path.join(copy, "bias", "result.json"))
  calls, out = [], io.StringIO()
  runner.run_suite(suite_lib.suite_from_dict(helpers.tiny_suite()), copy, out=out,
                   train_fn=_count_calls(calls))
  assert calls == [os.path.join(copy, "bias")]
  assert "nothing to do" in out.getvalue()  # the trainer resumed from its final checkpoint
  assert os.path.exists(os.path.join(copy, "bias", "result.json"))


def test_changed_arm_is_retrained_not_reused(tiny_suite_dir, tmp_path):
  workdir, _, _ = tiny_suite_dir
  tree = helpers.tiny_suite()
  exp = suite_lib.suite_from_dict(tree).arm("aux").experiment
  assert runner.is_finished(os.path.join(workdir, "aux"), exp)
  tree["arms"]["aux"]["model"]["moe"]["balance"]["aux_loss_coef"] = 2e-2
  changed = suite_lib.suite_from_dict(tree).arm("aux").experiment
  assert not runner.is_finished(os.path.join(workdir, "aux"), changed)
