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
  # steps, set-up, the evaluation's compilation (the first of this run's, 0.5 s), evals,
  # analysis
  later = 100 * 0.2 + 3.0 + 0.5 + 0.1 * (4 * 5 + 40 + 2 * 40)
  assert p.suite_eta(50) == pytest.approx(this_run + later)
  assert "suite ETA" in p.line(50, 1e3, 1.0)
  # Once a run has finished, its measured time outside training replaces the estimate:
  # what this run has not spent of it yet (3 s set-up + 1 s evaluations spent), and all of
  # it for the later run; this run's own evaluations are not counted twice.
  m = _progress(then_steps=100, then_seconds=2 * 30.0, then_runs=1)  # 30 s per run
  m.setup_seconds = 3.0
  assert m.suite_eta(50) == pytest.approx(50 * 0.2 + 100 * 0.2 + (30.0 - 4.0) + 30.0)
  assert "suite ETA" not in _progress().line(50, 1e3, 1.0)  # a lone run has none


class _Clock:
  """A fake clock: the simulated run advances it, the ETA reads it."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _simulate(step_s=0.2, batch_s=0.1, compile_s=30.0, eval_compile_s=5.0, total=100,
              log_every=10, eval_every=25, eval_batches=5, final_batches=40):
  """A run on a fake clock: ``[(step, ETA shown, the true time left)]`` at every log line.

  The first step compiles (``compile_s``), the first evaluation compiles its step
  (``eval_compile_s``); the final evaluation runs after the last line.
  """
  clock = _Clock()
  p = metrics_log.Progress(total, out=io.StringIO(), clock=clock)
  p.plan_evals(evals_left=len(range(eval_every, total, eval_every)),
               eval_batches=eval_batches, final_batches=final_batches)
  events, seen, window = [], 0, 0.0
  clock.now += compile_s + step_s
  p.first_step_done()
  for step in range(2, total + 1):
    clock.now += step_s
    window += step_s
    if step % log_every == 0:
      p.add_time(window, step - 1 - seen)
      seen, window = step - 1, 0.0
      events.append((step, p.eta(step), clock.now))
    if step % eval_every == 0 and step < total:
      seconds = batch_s * eval_batches + (eval_compile_s if not p.evals_seen else 0.0)
      clock.now += seconds
      p.add_eval(seconds, eval_batches)
  clock.now += batch_s * final_batches  # the final, whole-split evaluation
  return [(step, eta, clock.now - at) for step, eta, at in events]


def test_the_eta_is_the_measured_step_time_after_compilation_and_converges():
  lines = _simulate()
  # Neither the compiling first step (30 s) nor the compiling first evaluation (5 s) is a
  # rate: once a warm evaluation has been timed (step 50's, after its line), every ETA is
  # the time left.
  for step, eta, left in lines:
    if step > 50:
      assert eta == pytest.approx(left, abs=1e-9), step
    else:  # before: evaluation batches at a third of a step (0.067 s, truly 0.1 s) and the
      # evaluation's compilation not yet seen (5 s): under, never over, by at most those
      assert left - 5.0 - 55 * (0.1 - 0.2 / 3) - 1e-9 <= eta <= left, (step, eta, left)
  assert lines[-1][1] == pytest.approx(4.0)  # step 100: the final 40 batches


def test_suite_eta_is_never_below_the_runs_eta():
  for then_seconds in (None, 0.0, 1.0, 60.0):
    p = metrics_log.Progress(100, out=io.StringIO(), in_suite=True, then_steps=50,
                             then_seconds=then_seconds, then_runs=1)
    p.add_time(2.0, 10)
    p.plan_evals(evals_left=3, eval_batches=5, final_batches=40)
    p.add_eval(7.0, 5)  # the compiling one
    p.add_eval(0.5, 5)
    for step in (11, 50, 99, 100):
      assert p.suite_eta(step) >= p.eta(step) + 50 * 0.2, (then_seconds, step)


def test_no_eta_before_a_timed_step_nor_at_100_percent():
  p = metrics_log.Progress(40, out=io.StringIO(), in_suite=True)
  assert p.line(1, 0.0, 5.0).endswith("| loss 5.0000 | ETA -- | suite ETA --")
  p.add_time(1.0, 9)
  assert p.line(10, 1e3, 4.0).endswith("| ETA 0m03s | suite ETA 0m03s")
  assert p.line(39, 1e3, 3.0).startswith("step 39/40 (97%)")
  assert p.line(40, 1e3, 3.0) == "step 40/40 (100%) | 1.0k tok/s | loss 3.0000"
  later = metrics_log.Progress(40, out=io.StringIO(), in_suite=True, then_steps=40, then_runs=1)
  later.add_time(1.0, 10)
  assert later.line(40, 1e3, 3.0) == ("step 40/40 (100%) | 1.0k tok/s | loss 3.0000 | "
                                      "suite ETA 0m04s")


def test_the_warm_up_window_after_compilation_leaves_the_rate_once_a_later_one_is_timed():
  p = metrics_log.Progress(100, out=io.StringIO())
  p.add_time(9.0, 9)           # steps 2-10: 1 s each while caches warm up
  assert p.eta(10) == pytest.approx(90.0)  # the only rate there is
  p.add_time(2.0, 10)          # steps 11-20: 0.2 s each
  assert p.eta(20) == pytest.approx(80 * 0.2)
  p.add_time(2.0, 10)
  assert p.eta(30) == pytest.approx(70 * 0.2)
  assert p.train_seconds == pytest.approx(13.0)  # what the history records stays all of it


def test_the_checkpoint_steps_finite_check_is_not_step_time(data_dir, tmp_path, monkeypatch):
  """A checkpoint step reads the whole state back to check it is finite: its time stays out
  of the window's tokens/s (and so of the MFU and the ETA), as the save's does."""
  import time  # pylint: disable=g-import-not-at-top
  from moejax.train import guard, loop  # pylint: disable=g-import-not-at-top
  real = guard.nonfinite_leaves

  def slow_check(tree):
    time.sleep(2.0)
    return real(tree)
  monkeypatch.setattr(guard, "nonfinite_leaves", slow_check)
  from tests.train import helpers  # pylint: disable=g-import-not-at-top
  cfg = helpers.experiment("tiny", data_dir, train__steps=5, train__log_every=5,
                           train__checkpoint_every=5, train__eval_every=0)
  workdir = str(tmp_path / "run")
  loop.train(cfg, workdir, out=io.StringIO())
  (row,) = metrics_log.read_metrics(workdir, "train")
  # Steps 2-5 (4 x 8 x 32 targets) took far less than the 2 s of the check.
  assert row["tokens_per_s"] > 4 * 8 * 32 / 2.0
