"""SIGTERM / SIGINT during training: a checkpoint of the step, a record, a resume that repeats.

In the default run (in-process, the signal sent to this very process from
inside the step function, so it lands mid-run deterministically):

* the Preemption object: handlers installed and restored, a second signal
  answered and ignored, the processes' flags combined at the same step;
* a tiny run (configs/tiny.py) interrupted by SIGINT after step 13, with a
  second SIGTERM during its save: Preempted (exit status 130), history,
  lock released, checkpoints 10 and 13 complete; resumed, its metrics equal
  the uninterrupted run's (the session's ``tiny_run``) row for row.

Slow: an ablation suite preempted in its first arm resumes that arm; the
real ``experiments.train`` binary sent SIGTERM once its progress shows
steps, restarted, compared with an uninterrupted binary run.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from moejax.ablation import runner, suite as suite_lib
from moejax.train import checkpoint as ckpt_lib
from moejax.train import lock as lock_lib
from moejax.train import loop
from moejax.train import preempt
from moejax.train import step as step_lib
from tests.ablation import helpers as ablation_helpers
from tests.train import helpers

COMPARED = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "learning_rate", "epoch")


def _signal_at(monkeypatch, at: int, signum: int, when=lambda cfg: True):
  """The loop's train step sends ``signum`` to this process after its ``at``-th call."""
  real = step_lib.make_train_step

  def make(graphdef, cfg, tx):
    fn, calls = real(graphdef, cfg, tx), [0]

    def train_step(state, batch):
      out = fn(state, batch)
      calls[0] += 1
      if calls[0] == at and when(cfg):
        os.kill(os.getpid(), signum)
      return out
    return train_step
  monkeypatch.setattr(step_lib, "make_train_step", make)


def test_handlers_are_installed_and_restored_and_a_second_signal_is_ignored(capfd):
  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  said = []
  with preempt.Preemption(said.append, process_count=1) as stop:
    assert not stop.should_stop(1)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # while stopping: one line, no KeyboardInterrupt
    assert stop.received == signal.SIGTERM
    assert stop.should_stop(2) and stop.signum == signal.SIGTERM
    assert stop.should_stop(3)  # stays stopped
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
  assert said == ["SIGTERM received: stopping after step 2, writing its checkpoint"]
  err = capfd.readouterr().err
  assert err.count("\n") == 1 and err.startswith("SIGINT received again: still stopping")
  e = stop.preempted(2, "/w/checkpoints")
  assert e.exit_status == 143 and e.step == 2
  assert str(e) == ("preempted by SIGTERM at step 2: its checkpoint is in /w/checkpoints; run "
                    "the same command again to resume from step 2 (exit status 143)")
  assert preempt.EXIT_STATUS == {int(signal.SIGTERM): 143, int(signal.SIGINT): 130}


def test_processes_stop_together_at_the_next_sync_step():
  # Two processes of one run, process 1 signalled after step 12: both go on to the
  # next multiple of sync_every (20), where the combined flag stops both.
  procs = []
  gather = lambda value: max(p.received for p in procs)
  procs.extend(preempt.Preemption(lambda _: None, process_count=2, sync_every=10,
                                  allgather=gather) for _ in range(2))
  stops = {0: None, 1: None}
  for step in range(1, 40):
    if step == 13:
      procs[1].request(signal.SIGTERM)
    for i, p in enumerate(procs):
      if stops[i] is None and p.should_stop(step):
        stops[i] = step
  assert stops == {0: 20, 1: 20}
  assert [p.signum for p in procs] == [signal.SIGTERM, signal.SIGTERM]


def test_preempted_run_saves_its_step_and_resumes_like_the_uninterrupted_run(
    tiny_run, data_dir, tmp_path, monkeypatch, capfd):
  _, whole, _, _ = tiny_run  # configs/tiny.py, 40 steps, never interrupted
  workdir = str(tmp_path / "run")
  cfg = helpers.experiment("tiny", data_dir)
  _signal_at(monkeypatch, 13, signal.SIGINT)  # not a log / eval / checkpoint step
  real_save, saves = ckpt_lib.Checkpointer.save, []

  def save(self, step, state, data_state):
    if step == 13:  # a second signal while the preemption checkpoint is written
      os.kill(os.getpid(), signal.SIGTERM)
    saves.append(step)
    real_save(self, step, state, data_state)
  monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save)
  before = signal.getsignal(signal.SIGINT)
  out = io.StringIO()
  with pytest.raises(preempt.Preempted) as info:
    loop.train(cfg, workdir, out=out)
  assert info.value.step == 13 and info.value.exit_status == 130
  assert "SIGINT received: stopping after step 13, writing its checkpoint" in out.getvalue()
  assert "SIGTERM received again: still stopping" in capfd.readouterr().err
  assert signal.getsignal(signal.SIGINT) is before
  assert saves == [10, 13] and ckpt_lib.checkpoint_steps(workdir) == [10, 13]
  assert not os.path.exists(os.path.join(workdir, lock_lib.LOCK_FILE))
  last = ckpt_lib.read_history(workdir)[-1]
  assert last["event"] == "preempted" and last["step"] == 13
  monkeypatch.undo()

  out = io.StringIO()
  summary = loop.train(cfg, workdir, out=out)
  assert "resumed from checkpoint at step 13" in out.getvalue()
  assert summary["step"] == 40 and summary["train_seconds"] > 0
  want, got = helpers.rows_by_step(whole, "train"), helpers.rows_by_step(workdir, "train")
  assert sorted(got) == sorted(want) == list(range(5, 41, 5))
  for step in want:  # row 15 averages steps 11-15: 11-13 came back with the checkpoint
    assert {k: got[step][k] for k in COMPARED} == {k: want[step][k] for k in COMPARED}, step
  assert helpers.rows_by_step(workdir, "eval") == helpers.rows_by_step(whole, "eval")


# ~50 s on 2 shared cores (two arms trained, evaluated, one resumed). In the default run: the
# loop test above (a preempted run resumes exactly) and ablation/test_runner.py's
# test_killed_suite_resumes_only_the_unfinished_arm (the runner resumes an unfinished arm).
@pytest.mark.slow
def test_ablation_preempted_in_an_arm_resumes_that_arm(data_dir, tmp_path, monkeypatch):
  # Two arms that compile to the same programs (they differ in how often they log only), so
  # the second arm's compilations come from JAX's cache.
  tree = ablation_helpers.tiny_suite(steps=6, seeds=(0,), arms={
      "aux": {}, "bias": {"train": {"log_every": 2}}})
  tree["base"]["data"]["data_dir"] = data_dir
  suite = suite_lib.suite_from_dict(tree)
  workdir = str(tmp_path / "suite")
  # In the first arm ("aux"), after its 4th step: the second arm is not started.
  _signal_at(monkeypatch, 4, signal.SIGTERM)
  with pytest.raises(preempt.Preempted) as info:
    runner.run_suite(suite, workdir, out=io.StringIO(), analyse_runs=False)
  assert info.value.step == 4
  aux = os.path.join(workdir, "aux")
  assert not os.path.exists(os.path.join(aux, runner.RESULT_FILE))
  assert not os.path.exists(os.path.join(workdir, "bias"))
  assert ckpt_lib.checkpoint_steps(aux) == [3, 4]
  assert not os.path.exists(os.path.join(workdir, lock_lib.LOCK_FILE))
  monkeypatch.undo()
  assert dict(runner.plan_suite(suite, workdir)) == {"aux": "resumes from step 4", "bias": "new"}

  out = io.StringIO()
  results = runner.run_suite(suite, workdir, out=out, analyse_runs=False)
  text = out.getvalue()
  assert f"{aux}: resumed from checkpoint at step 4" in text
  assert results["aux"]["train_summary"]["step"] == 6
  assert results["bias"]["train_summary"]["step"] == 6
  events = [h["event"] for h in ckpt_lib.read_history(aux)]
  assert events == ["start", "preempted", "resume", "end"]


def _train_command(workdir, data_dir):
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}",
          "--config.train.steps=400", "--config.train.checkpoint_every=100000",
          "--config.train.eval_every=100", "--config.train.log_every=5"]


@pytest.mark.slow  # ~40 s (three binary runs); in-process: the test above
def test_sigterm_to_the_train_binary_then_restart_matches_uninterrupted_run(
    tmp_path, data_dir, compilation_cache):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **compilation_cache)
  whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")
  done = subprocess.run(_train_command(whole, data_dir), cwd=helpers.ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]

  proc = subprocess.Popen(_train_command(stopped, data_dir), cwd=helpers.ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    # Training: no checkpoint on disk before the signal.
    seen = helpers.signal_when(proc, lambda line: line.startswith("step "), signal.SIGTERM)
    rest, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 143, "".join(seen) + err[-3000:]
  step = json.loads(open(os.path.join(stopped, ckpt_lib.HISTORY_FILE)).readlines()[-1])["step"]
  assert 5 <= step < 400 and ckpt_lib.checkpoint_steps(stopped) == [step]
  assert err.strip().splitlines()[-1] == (
      f"preempted by SIGTERM at step {step}: its checkpoint is in "
      f"{os.path.join(stopped, 'checkpoints')}; run the same command again to resume from "
      f"step {step} (exit status 143)")
  assert f"SIGTERM received: stopping after step {step}" in rest

  again = subprocess.run(_train_command(stopped, data_dir), cwd=helpers.ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from checkpoint at step {step}" in again.stdout
  want, got = helpers.rows_by_step(whole, "train"), helpers.rows_by_step(stopped, "train")
  assert sorted(got) == sorted(want)
  for s in want:
    assert {k: got[s][k] for k in COMPARED} == {k: want[s][k] for k in COMPARED}, s
  assert helpers.rows_by_step(stopped, "eval") == helpers.rows_by_step(whole, "eval")
