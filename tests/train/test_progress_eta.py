"""The progress line's ETA counts what is left: steps, evaluations, and a suite's other time."""

from __future__ import annotations

import io

import pytest

from moejax.train import metrics_log


def _progress(**kw):
  p = metrics_log.Progress(100, out=io.StringIO(), **kw)
  p.add_time(10.0, 50)         # 0.2 s per step over the first 50 steps
  p.plan_evals(evals_left=4, eval_batches=5, final_batches=40)
  for _ in range(2):           # two periodic evaluations done: 0.1 s per batch
    p.add_eval(0.5, 5)
  return p


def test_run_eta_counts_steps_periodic_and_final_evaluation():
  p = _progress()
  # 50 steps x 0.2 + 2 evals x 5 batches x 0.1 + final 40 batches x 0.1
  assert p.eta(50) == pytest.approx(10.0 + 1.0 + 4.0)
  p.add_eval(0.5, 5), p.add_eval(0.5, 5), p.add_eval(9.0, 40, final=True)
  assert p.eta(100) == pytest.approx(0.0)


def test_suite_eta_before_any_run_finished_estimates_the_later_runs_from_this_one():
  p = _progress(in_suite=True, then_steps=100, then_runs=1, after_passes=2)
  p.setup_seconds = 3.0
  this_run = 10.0 + 1.0 + 4.0 + 2 * 40 * 0.1            # + its routing analysis
  later = 100 * 0.2 + 3.0 + 0.1 * (4 * 5 + 40 + 2 * 40)  # steps, set-up, evals, analysis
  assert p.suite_eta(50) == pytest.approx(this_run + later)
  assert "suite ETA" in p.line(50, 1e3, 1.0)
  # Once a run has finished, its measured time outside training replaces the estimate:
  # what this run has not spent of it yet (3 s set-up + 1 s evaluations spent), and all of
  # it for the later run; this run's own evaluations are not counted twice.
  m = _progress(then_steps=100, then_seconds=2 * 30.0, then_runs=1)  # 30 s per run
  m.setup_seconds = 3.0
  assert m.suite_eta(50) == pytest.approx(50 * 0.2 + 100 * 0.2 + (30.0 - 4.0) + 30.0)
  assert "suite ETA" not in _progress().line(50, 1e3, 1.0)  # a lone run has none
