"""End to end on a tiny suite: outputs, resume without retraining, a half-finished suite."""

from __future__ import annotations

import io
import json
import os
import platform
import shutil

import numpy as np
import pytest

from moejax.ablation import analysis, final_eval, runner, suite as suite_lib
from moejax.ablation import summary
from moejax.evaluate import validation
from moejax.train import checkpoint as ckpt_lib
from moejax.train import lock as lock_lib
from moejax.train import loop, metrics_log
from tests.ablation import helpers
from tests.train import helpers as train_helpers

# Every test here uses the tiny suite run (conftest): ~40 s of compilation on an idle
# 2-core machine, 2 min on a loaded one.


def test_tiny_suite_writes_results_table_and_plots(tiny_suite_dir):
  workdir, printed, results = tiny_suite_dir
  runs = {f"{arm}/seed_{s}" for arm in ("aux", "bias") for s in (0, 1)}
  assert set(results) == runs
  assert "total*" in printed and "ok  active" in printed  # the budget table came first
  assert "corpus: python_stdlib/py" in printed
  for run in sorted(runs):
    with open(os.path.join(workdir, run, "result.json")) as f:
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
    # The final numbers are the runner's whole-split evaluation of the final state, which
    # is also the trainer's final evaluation row (the split is read once per run).
    assert res["val_loss"] == res["train_summary"]["val_loss"]
    assert res["scale"] == "s" and set(res["phase_seconds"]) == {"train", "final_eval",
                                                                  "analysis"}
    assert res["corpus"]["id"].startswith("python_stdlib/")
    assert res["corpus"]["python_version"] == platform.python_version()
    assert set(res["provenance"]) >= {"command", "commit", "date", "machine", "jax_version"}
    # Per-document losses add up to the split's loss.
    ce, count = final_eval.read_per_doc(os.path.join(workdir, run))
    assert count.sum() == res["val_tokens"] and res["per_doc"]["documents"] == count.size
    assert ce.sum() / count.sum() == pytest.approx(res["val_loss"], rel=1e-5)
    with open(os.path.join(workdir, run, "routing.json")) as f:
      routing = json.load(f)
    assert routing["steps"] == [3, 6]  # every kept checkpoint
    assert routing["sample"].startswith("1 of the ") and "evenly spaced" in routing["sample"]
    for name, layer in routing["layers"].items():
      assert len(layer["load_over_training"]) == 2 and len(layer["coact"]) == 4
      # The joint counts are the whole split's: one count per routed slot of every scored
      # target (top-2 over every one of the split's tokens).
      assert np.sum(layer["joint"]) == 2 * res["val_tokens"]
      assert res["layers"][f"{name}/max_vio_global"] == pytest.approx(
          validation.routing_metrics({name: layer["joint"]},
                                     {name: layer["final_load"]})[f"{name}/max_vio_global"])
  md = open(os.path.join(workdir, "summary.md")).read()
  assert md.index("| aux (baseline) |") < md.index("| bias |")  # suite order
  assert "| bias | val loss |" in md and "(2) |" in md  # compared with the baseline, 2 seeds
  # Its plots linked, its columns defined (moejax.ablation.legend).
  assert "Plots:\n\n- [metrics](plots/metrics.png)\n- [differences](plots/differences.png)" in md
  assert "\n- **spec. MI/H**: I(expert; domain) / H(domain)" in md and "\n- **MDD**: " in md
  rows = summary.read_csv(os.path.join(workdir, "summary.csv"))
  assert [r["arm"] for r in rows] == ["aux", "bias"]
  assert rows[0]["val_loss_n"] == 2 and rows[0]["val_loss_lo"] < rows[0]["val_loss"]
  with open(os.path.join(workdir, "summary.json")) as f:
    summ = json.load(f)
  assert summ["baseline"] == "aux" and summ["suite"] == "tiny" and summ["scale"] == "s"
  with open(os.path.join(workdir, "suite.json")) as f:
    assert json.load(f)["scale_factors"] == dict(width=1, depth=1, seq=1, batch=1, steps=1)
  assert "- scale: s (identity; moejax.ablation.scale)" in open(
      os.path.join(workdir, "summary.md")).read()
  comp = summ["comparisons"]["bias"]["val_loss"]
  assert comp["pairing"] == "paired" and comp["seeds"] == [0, 1]
  assert comp["documents"]["n"] >= 2 and comp["verdict"] in ("better", "worse", "unresolved")
  for png in ("metrics.png", "differences.png", "curves.png"):
    assert os.path.getsize(os.path.join(workdir, "plots", png)) > 1000
  # While it runs: a suite ETA once a run is done; at the end the table and every path.
  assert "[1/4] aux/seed_0: training (aux, seed 0); 3 more run(s) after it\n" in printed
  assert "[4/4] bias/seed_1: training (bias, seed 1); 0 more run(s) after it, suite ETA " \
      in printed
  # A result rounded (result.json keeps every digit).
  with open(os.path.join(workdir, "bias", "seed_1", runner.RESULT_FILE)) as f:
    val_loss = json.load(f)["val_loss"]
  assert "[4/4] bias/seed_1: done in " in printed
  assert f"s, val loss {val_loss:.3f}; " in printed and repr(val_loss) not in printed
  tail = printed[printed.index("outputs in"):]
  # The summary as text of at most 100 columns (moejax.ablation.terminal), not summary.md's
  # tables, which it names.
  end = printed[printed.rindex("\nsuite tiny\n"):printed.index("outputs in")]
  assert "\nbias: 2 seeds; " in end and "\n  val loss " in end and "| arm |" not in end
  assert max(len(line) for line in end.splitlines()) <= 100
  assert end.endswith(f"the tables as markdown: {os.path.join(workdir, 'summary.md')}\n")
  for name in ("summary.md", "summary.json", "summary.csv", "metrics.png", "curves.png",
               "suite.json", "budget.json"):
    assert name in tail[tail.index(f"outputs in {workdir}:"):], name


def test_final_evaluation_routing_is_the_routing_pass_of_the_whole_split(tiny_suite_dir):
  """The final evaluation's routing (one forward) equals a separate routing pass over the
  whole split, so the analysis of the final checkpoint reuses it instead of a second pass."""
  workdir, _, _ = tiny_suite_dir
  path = os.path.join(workdir, "bias", "seed_0")
  exp = suite_lib.suite_from_dict(helpers.tiny_suite()).arm("bias").experiment
  ev = final_eval.final_evaluation(exp, path)
  batches, domains, what = final_eval.routing_sample(exp, None)
  assert what.startswith("the whole validation split")
  model, _ = analysis.load_model(exp, path)
  rp = analysis.routing_pass(model, exp, batches, len(domains))
  assert set(ev.routing) == set(rp) and rp
  for name, acc in rp.items():
    for key in ("load", "joint", "coact"):
      np.testing.assert_array_equal(ev.routing[name][key], acc[key])
    np.testing.assert_array_equal(ev.routing[name]["joint"], ev.joints[name])
    for (ids_a, sent_a), (ids_b, sent_b) in zip(ev.routing[name]["ids"], acc["ids"]):
      np.testing.assert_array_equal(ids_a, ids_b)
      np.testing.assert_array_equal(sent_a, sent_b)
  # analyse() takes it for the final checkpoint when the sample is the whole split.
  res, routing = runner.analyse(exp, path, {"latency": False}, lambda _: None, final_routing=ev)
  res2, routing2 = runner.analyse(exp, path, {"latency": False}, lambda _: None)
  assert res == res2 and routing == routing2


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
  assert out.getvalue().count("finished earlier, not retrained") == 4
  assert "corpora differ" not in out.getvalue()


def test_killed_suite_resumes_only_the_unfinished_arm(tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  copy = workdir + "_killed"
  shutil.copytree(workdir, copy)
  # As if killed after 'bias' trained but before its result was written: its
  # checkpoints are there, its result.json is not.
  run = os.path.join(copy, "bias", "seed_1")
  os.remove(os.path.join(run, "result.json"))
  calls, out = [], io.StringIO()
  runner.run_suite(suite_lib.suite_from_dict(helpers.tiny_suite()), copy, out=out,
                   train_fn=_count_calls(calls))
  assert calls == [run]
  assert "nothing to do" in out.getvalue()  # the trainer resumed from its final checkpoint
  with open(os.path.join(run, "result.json")) as f:
    res = json.load(f)
  # The real final numbers (from metrics.jsonl), not None.
  final = metrics_log.read_metrics(run, "train")[-1]
  assert res["train_summary"]["train_loss"] == final["loss"]
  assert isinstance(res["train_summary"]["val_loss"], float)
  assert "train loss None" not in out.getvalue()


def test_changed_arm_is_retrained_not_reused(tiny_suite_dir, tmp_path):
  workdir, _, _ = tiny_suite_dir
  tree = helpers.tiny_suite()
  exp = suite_lib.suite_from_dict(tree).arm("aux").experiment
  run = os.path.join(workdir, "aux", "seed_0")
  assert runner.is_finished(run, runner._seeded(exp, 0))  # pylint: disable=protected-access
  tree["arms"]["aux"]["model"]["moe"]["balance"]["aux_loss_coef"] = 2e-2
  changed = suite_lib.suite_from_dict(tree).arm("aux").experiment
  assert not runner.is_finished(run, runner._seeded(changed, 0))  # pylint: disable=protected-access


def _copy(workdir, name):
  copy = workdir + "_" + name
  shutil.copytree(workdir, copy)
  return copy


@pytest.mark.parametrize("changes, field", [
    ({"train": {"steps": 9}}, "train.steps=6 (checkpoint at step 6); train.steps=9 would relabel"),
    ({"train": {"learning_rate": 2e-2}}, "train.learning_rate: stored 0.01, requested 0.02"),
])
def test_rerun_that_would_relabel_finished_results_is_refused_untouched(tiny_suite_dir, changes,
                                                                        field):
  copy = _copy(tiny_suite_dir[0], "relabel_" + next(iter(changes["train"])))
  before = train_helpers.snapshot(copy)
  tree = helpers.tiny_suite()
  tree["base"]["train"].update(changes["train"])
  with pytest.raises(ckpt_lib.WorkdirError, match="run aux/seed_0 of suite tiny: ") as err:
    runner.run_suite(suite_lib.suite_from_dict(tree), copy, out=io.StringIO())
  assert field in str(err.value)
  assert train_helpers.snapshot(copy) == before  # summary.md, suite.json, budget.json too


def test_logging_changes_keep_a_finished_suite_finished(tiny_suite_dir):
  copy = _copy(tiny_suite_dir[0], "logging")
  tree = helpers.tiny_suite()
  tree["base"]["train"].update(log_every=2, checkpoint_every=2)
  calls, out = [], io.StringIO()
  runner.run_suite(suite_lib.suite_from_dict(tree), copy, out=out, train_fn=_count_calls(calls))
  assert calls == [] and out.getvalue().count("finished earlier, not retrained") == 4


@pytest.mark.slow  # ~30 s on CI; tests/train/test_resume.py covers --extend of one run in the default run
def test_extend_trains_the_extra_steps_of_every_run(tiny_suite_dir):
  copy = _copy(tiny_suite_dir[0], "extend")
  tree = helpers.tiny_suite()
  tree["base"]["train"]["steps"] = 9
  suite = suite_lib.suite_from_dict(tree)
  runs = [f"{arm}/seed_{s}" for arm in ("aux", "bias") for s in (0, 1)]
  assert runner.plan_suite(suite, copy, extend=True) == [
      (run, "resumes from step 6 (extended from 6 steps)") for run in runs]
  results = runner.run_suite(suite, copy, out=io.StringIO(), analyse_runs=False, extend=True)
  for run in runs:
    assert results[run]["train_summary"]["step"] == 9
    assert results[run]["budget"]["tokens"] == 9 * 8 * 32
    history = ckpt_lib.read_history(os.path.join(copy, run))
    assert [h["steps"] for h in history if h["event"] == "extend"] == [[6, 9]]
  with open(os.path.join(copy, "budget.json")) as f:
    assert json.load(f)["aux"]["tokens"] == 9 * 8 * 32


def test_suite_directory_in_use_is_refused(tiny_suite_dir):
  copy = _copy(tiny_suite_dir[0], "locked")
  before = train_helpers.snapshot(copy)
  with lock_lib.WorkdirLock(copy):  # as another experiments.ablate would hold it
    after_lock = train_helpers.snapshot(copy)
    with pytest.raises(lock_lib.WorkdirLockedError, match=f"{copy} is in use by another run"):
      runner.run_suite(suite_lib.suite_from_dict(helpers.tiny_suite()), copy, out=io.StringIO())
    assert train_helpers.snapshot(copy) == after_lock
  assert train_helpers.snapshot(copy) == before


def test_a_finished_run_on_another_corpus_is_flagged(tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  copy = workdir + "_corpus"
  shutil.copytree(workdir, copy)
  path = os.path.join(copy, "aux", "seed_0", "result.json")
  with open(path) as f:
    res = json.load(f)
  res["corpus"] = dict(res["corpus"], python_version="3.99.0", content_sha256="0" * 64,
                       id="python_stdlib/py3.99.0:1.0.0 bytes sha256:000000000000")
  with open(path, "w") as f:
    json.dump(res, f)
  out = io.StringIO()
  runner.run_suite(suite_lib.suite_from_dict(helpers.tiny_suite()), copy, out=out,
                   train_fn=_count_calls([]))
  assert "! aux/seed_0: corpora differ (python_version, content_sha256)" in out.getvalue()
  md = open(os.path.join(copy, "summary.md")).read()
  assert "- ! corpora differ" in md  # the summary says so too
