"""Speed-up to the reference's loss: crossings of hand-made curves, time per window, runs."""

from __future__ import annotations

import json
import os

import pytest

from moejax.ablation import speedup


def test_crossing_interpolates_between_the_bracketing_points():
  # 3.0 at 100, 2.0 at 200: the target 2.5 is crossed half way, at 150.
  assert speedup.crossing([100, 200, 300], [3.0, 2.0, 1.0], 2.5) == (150.0, "")
  # The first point at or below the target wins (a later rise does not matter).
  assert speedup.crossing([100, 200, 300], [3.0, 1.5, 2.8], 2.0) == (pytest.approx(166.6667,
                                                                                   rel=1e-6), "")
  assert speedup.crossing([100, 200], [3.0, 2.0], 2.0) == (200.0, "")


def test_crossing_not_reached_and_already_below():
  step, note = speedup.crossing([100, 200], [3.0, 2.6], 2.5)
  assert step is None and "never reached 2.5000 (best 2.6000)" in note
  step, note = speedup.crossing([100, 200], [2.0, 1.0], 2.5)
  assert step == 100.0 and "upper bound" in note


def test_time_at_cumulates_windows_at_their_own_throughput():
  rows = [{"step": 10, "tokens_per_s": 100.0}, {"step": 20, "tokens_per_s": 50.0}]
  # 10 tokens per step: the first window is 10 * 10 / 100 = 1 s, the second 2 s.
  assert speedup.time_at(rows, 10.0, 10) == 1.0
  assert speedup.time_at(rows, 10.0, 15) == pytest.approx(2.0)
  assert speedup.time_at(rows, 10.0, 20) == pytest.approx(3.0)
  assert speedup.time_at(rows, 10.0, 25) is None


def _run(tmp_path, name, evals, tps, tokens=1000):
  path = tmp_path / name
  os.makedirs(path)
  with open(path / "metrics.jsonl", "w") as f:
    # An earlier subset evaluation (fewer tokens) is another measurement: ignored.
    f.write(json.dumps({"step": 50, "split": "eval", "loss": 0.1, "tokens": 10}) + "\n")
    for step, loss in evals:
      f.write(json.dumps({"step": step, "split": "eval", "loss": loss, "tokens": tokens}) + "\n")
    for step in range(50, evals[-1][0] + 1, 50):
      f.write(json.dumps({"step": step, "split": "train", "tokens_per_s": tps}) + "\n")
  return str(path)


def test_run_speedup_against_a_reference_of_the_same_seed(tmp_path):
  ref = _run(tmp_path, "dense", [(100, 3.0), (200, 2.5), (300, 2.2)], tps=1000.0)
  moe = _run(tmp_path, "moe", [(100, 2.8), (200, 2.0), (300, 1.8)], tps=500.0)
  out = speedup.run_speedup(moe, ref, tokens_per_step=10.0)
  # 2.8 -> 2.0 crosses 2.2 at 100 + (0.6 / 0.8) * 100 = 175 steps: 300 / 175 faster in steps.
  assert out["steps_to_reference"] == pytest.approx(175.0)
  assert out["speedup_steps"] == pytest.approx(300 / 175)
  # Time: the reference takes 300 * 10 / 1000 = 3 s, the MoE 175 * 10 / 500 = 3.5 s.
  assert out["speedup_time"] == pytest.approx(3.0 / 3.5)
  assert out["reference_loss"] == 2.2
  same = speedup.run_speedup(ref, ref, tokens_per_step=10.0)
  assert same["speedup_steps"] == 1.0 and same["speedup_time"] == pytest.approx(1.0)


def test_add_speedups_pairs_by_seed_and_notes_misses(tmp_path):
  ref0 = _run(tmp_path, "d0", [(100, 3.0), (200, 2.0)], tps=100.0)
  slow = _run(tmp_path, "m0", [(100, 3.5), (200, 2.5)], tps=100.0)
  exp = {"data": {"batch_size": 2, "seq_len": 5}}
  results = [{"arm": "dense", "seed": 0, "_path": ref0, "experiment": exp},
             {"arm": "moe", "seed": 0, "_path": slow, "experiment": exp},
             {"arm": "moe", "seed": 1, "_path": slow, "experiment": exp}]
  speedup.add_speedups(results, "dense")
  assert results[0]["speedup_steps"] == 1.0
  assert "steps_to_reference" not in results[1] and "never reached" in results[1]["speedup_note"]
  assert "speedup_note" not in results[2]   # no reference run of seed 1


def test_suite_summary_reports_speedups_with_intervals_over_seeds(tmp_path):
  from moejax.ablation import summary as summary_lib  # pylint: disable=g-import-not-at-top
  from moejax.ablation import tables  # pylint: disable=g-import-not-at-top
  suite_dir = tmp_path / "suite"
  exp = {"data": {"batch_size": 2, "seq_len": 5}}
  # The MoE reaches the dense model's final loss 2.0 at 150 steps (half way from 3.0 to 1.0),
  # at its first evaluation (100, an upper bound) and at 100 + 0.5 / 1.5 * 100 (seeds 0-2).
  curves = {"dense": [[(100, 3.0), (200, 2.5), (300, 2.0)]] * 3,
            "moe": [[(100, 3.0), (200, 1.0), (300, 0.5)], [(100, 2.0), (200, 1.0), (300, 0.5)],
                    [(100, 2.5), (200, 1.0), (300, 0.5)]]}
  for arm, per_seed in curves.items():
    for seed, evals in enumerate(per_seed):
      path = _run(suite_dir / arm, f"seed_{seed}", evals, tps=100.0)
      with open(os.path.join(path, "result.json"), "w") as f:
        json.dump({"arm": arm, "seed": seed, "suite": "s", "val_loss": evals[-1][1],
                   "experiment": exp, "budget": {"total": 1}}, f)
  with open(suite_dir / "suite.json", "w") as f:
    json.dump({"name": "s", "arm_order": ["dense", "moe"], "baseline": "dense",
               "analysis": {"speedup_reference": "dense"}}, f)
  summary = summary_lib.suite_summary(str(suite_dir))
  steps = summary["arms"]["moe"]["metrics"]["steps_to_reference"]
  assert steps["values"] == pytest.approx({"0": 150.0, "1": 100.0, "2": 400 / 3})
  speed = summary["arms"]["moe"]["metrics"]["speedup_steps"]["interval"]
  assert speed["mean"] == pytest.approx((2.0 + 3.0 + 2.25) / 3) and speed["lo"] is not None
  assert summary["comparisons"]["moe"]["speedup_steps"]["verdict"] == "better"
  assert summary["arms"]["dense"]["metrics"]["speedup_steps"]["interval"]["mean"] == 1.0
  assert "| moe | 3 |" in tables.speedup_table(summary)
