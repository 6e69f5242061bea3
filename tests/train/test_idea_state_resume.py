"""A stateful plugin rule, killed (SIGKILL) mid-run and restarted, repeats the uninterrupted run.

tests/plugins/stateful_config.py balances configs/tiny.py with ``ema_sign``
(tests/plugins/stateful_rule.py): a bias rule whose per-layer state (an EMA
of each expert's share, a counter) is declared through the public API. Its
state lives in the checkpointed router state, so a run killed after its
first checkpoint and started again must log exactly the uninterrupted run's
losses and state, step for step, and end with bit-identical state (the
final checkpoints' checksums of every router-state array). Three processes
of the binary: slow (tests/train/test_idea_state.py resumes the same state
from a checkpoint in-process, in the default run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.train import helpers

CONFIG = os.path.join(helpers.ROOT, "tests", "plugins", "stateful_config.py")
COMPARED = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "state/ema_sign/updates")
STEPS = 24


def _command(workdir, data_dir):
  return [sys.executable, "-m", "experiments.train", f"--config={CONFIG}",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}"]


def _router_state_sums(workdir):
  path = os.path.join(workdir, "checkpoints", str(STEPS), "checksums.json")
  with open(path, encoding="utf-8") as f:
    arrays = json.load(f)["arrays"]
  return {k: v for k, v in arrays.items() if k.startswith("router_state/")}


@pytest.mark.slow
def test_stateful_plugin_rule_resumes_bit_identically_after_a_kill(tmp_path, data_dir,
                                                                   compilation_cache):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **compilation_cache)
  whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
  done = subprocess.run(_command(whole, data_dir), cwd=helpers.ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]

  first_ckpt = os.path.join(killed, "checkpoints", "4")
  proc = subprocess.Popen(_command(killed, data_dir), cwd=helpers.ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  def mid_training(line):  # past the first finalised checkpoint, before the end
    step = int(line.split()[1].split("/")[0]) if line.startswith("step ") else 0
    return step >= 5 and os.path.isdir(first_ckpt)

  try:
    seen = helpers.signal_when(proc, mid_training, signal.SIGKILL)
  finally:
    proc.stdout.close()
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "".join(seen)[-2000:]
  assert max(helpers.rows_by_step(killed, "train")) < STEPS

  again = subprocess.run(_command(killed, data_dir), cwd=helpers.ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resumed from checkpoint at step" in again.stdout

  want, got = helpers.rows_by_step(whole, "train"), helpers.rows_by_step(killed, "train")
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  for step in want:
    for key in COMPARED:
      assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
  # The counter is the state the step's forward read: 0 before the first update.
  assert [want[s]["state/ema_sign/updates"] for s in (1, 2, STEPS)] == [0, 1, STEPS - 1]
  sums = _router_state_sums(whole)
  assert any("/ideas/ema_sign/ema" in k for k in sums), sorted(sums)
  assert _router_state_sums(killed) == sums
