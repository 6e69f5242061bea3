"""A run killed with SIGKILL and restarted from its workdir repeats the uninterrupted run.

Three ``python -m experiments.train`` processes on configs/tiny.py with a
metric line per step: one uninterrupted; one killed (kill -9) mid-training
once its first checkpoint is on disk; the same command again on the killed
run's workdir. The restarted run must log exactly the losses of the
uninterrupted one, step for step, and the same evaluations.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.train import helpers

COMPARED = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "learning_rate")


def _command(workdir, data_dir):
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}",
          "--config.train.log_every=1", "--config.train.checkpoint_every=4"]


def _env(cache_env):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **cache_env)
  return env


def test_sigkill_mid_training_then_restart_matches_uninterrupted_run(tmp_path, data_dir,
                                                                     compilation_cache):
  env = _env(compilation_cache)
  whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
  done = subprocess.run(_command(whole, data_dir), cwd=helpers.ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]

  # Killed early (soon after the first checkpoint, at step 4) so that even on
  # a starved machine the child cannot finish its 40 steps before the signal.
  first_ckpt = os.path.join(killed, "checkpoints", "4")
  proc = subprocess.Popen(_command(killed, data_dir), cwd=helpers.ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  def mid_training(line):  # past the first complete (renamed, so finalised) checkpoint
    step = int(line.split()[1].split("/")[0]) if line.startswith("step ") else 0
    return step >= 5 and os.path.isdir(first_ckpt)

  try:
    seen = helpers.signal_when(proc, mid_training, signal.SIGKILL)
  finally:
    proc.stdout.close()
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "".join(seen)[-2000:]
  assert max(helpers.rows_by_step(killed, "train")) < 40  # it really stopped mid-run

  again = subprocess.run(_command(killed, data_dir), cwd=helpers.ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resumed from checkpoint at step" in again.stdout

  want, got = helpers.rows_by_step(whole, "train"), helpers.rows_by_step(killed, "train")
  assert sorted(got) == sorted(want) == list(range(1, 41))
  for step in want:
    for key in COMPARED:
      assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
  want_eval, got_eval = helpers.rows_by_step(whole, "eval"), helpers.rows_by_step(killed, "eval")
  assert sorted(got_eval) == sorted(want_eval) == [20, 40]
  for step in want_eval:
    assert got_eval[step] == want_eval[step]
