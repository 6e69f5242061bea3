"""The real ``python -m experiments.train`` binary as 2 processes x 4 CPU devices.

The binary initialises ``jax.distributed`` itself from
``--coordinator_address / --num_processes / --process_id`` (gloo on
127.0.0.1). The model has 8 experts and ``parallel.expert=8, data=1``: the
expert axis spans both processes (the all_to_all crosses them) and each
process feeds its half of every global batch.

* default run: one 2-process launch equals the 1-process launch on 8
  devices (a module fixture each) step for step: every train row of
  metrics.jsonl within rtol 1e-6 (measured: the rows differ by at most 2
  float32 ulps, another reduction order of the cross-process sums), the
  final validation loss too; metrics, history and config are written once,
  the lock released.
* slow (~1.5 min: the launch compiles before the kill): SIGKILL of process 1
  mid-run (``data=2, expert=4``: the data axis spans the processes) makes
  process 0 exit within ``--heartbeat_timeout_seconds`` (+ margin) with one
  ``error:`` line naming the lost peer and the resume point, no traceback.
  The default run covers the mapping with the unit tests of
  tests/test_distributed.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from moejax.train import checkpoint as ckpt_lib
from moejax.train import metrics_log
from tests.train import launch

# As cheap as the comparison allows (3 processes compile their own programs; the compile
# dominates): one layer, 2 steps, one checkpoint, one validation batch.
STEPS = 2
OVERRIDES = {"train.steps": STEPS, "train.warmup_steps": 1, "train.log_every": 1,
             "train.eval_every": 0, "train.checkpoint_every": 2, "train.eval_batches": 1,
             "model.n_layers": 1,
             "model.moe.topology.num_experts": 8, "model.moe.topology.expert_width": 16,
             "parallel.expert": 8, "parallel.data": 1}
KEYS = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "drop_rate")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_dir, compilation_cache):
  root = tmp_path_factory.mktemp("one_process")
  workdir = str(root / "run")
  out, = launch.run(data_dir, workdir, OVERRIDES, processes=1, devices=8,
                    env_extra=compilation_cache, log_dir=str(root))
  return workdir, out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, data_dir, compilation_cache, one_process):
  del one_process  # prepares the dataset first: the two processes only read it
  root = tmp_path_factory.mktemp("two_processes")
  workdir = str(root / "run")
  outs = launch.run(data_dir, workdir, OVERRIDES, processes=2, devices=4,
                    env_extra=compilation_cache, log_dir=str(root))
  return workdir, outs


def test_two_processes_of_the_binary_equal_one_process_step_by_step(one_process,
                                                                     two_processes):
  one, _ = one_process
  multi, outs = two_processes
  for i, out in enumerate(outs):
    assert f"process {i} of 2 (flags): 4 local of 8 devices (cpu)" in out, out
    assert f"done: step {STEPS}" in out, out
  got, want = (metrics_log.read_metrics(d, "train") for d in (multi, one))
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1)), \
      "a step missing or logged twice (two writers)"
  for g, w in zip(got, want):
    for key in KEYS:
      np.testing.assert_allclose(g[key], w[key], rtol=1e-6, err_msg=f"step {g['step']} {key}")
  val = [metrics_log.read_metrics(d, "eval") for d in (multi, one)]
  assert len(val[0]) == len(val[1]) == 1
  np.testing.assert_allclose(val[0][0]["loss"], val[1][0]["loss"], rtol=1e-6)
  assert [h["event"] for h in ckpt_lib.read_history(multi)] == ["start", "end"]
  with open(os.path.join(multi, ckpt_lib.CONFIG_FILE)) as f, \
       open(os.path.join(one, ckpt_lib.CONFIG_FILE)) as g:
    assert json.load(f) == json.load(g)
  assert ckpt_lib.checkpoint_steps(multi) == ckpt_lib.checkpoint_steps(one)
  assert not os.path.exists(os.path.join(multi, "run.lock"))


HEARTBEAT_S = 30  # 10 s declared a process dead while it compiled on a loaded 2-core machine


@pytest.mark.slow  # ~1.5 min on 2 shared cores; the default run: tests/test_distributed.py
def test_killing_one_process_stops_the_other_with_one_error_line(tmp_path, data_dir,
                                                                  compilation_cache,
                                                                  one_process):
  del one_process  # the dataset is prepared
  workdir = str(tmp_path / "run")
  overrides = dict(OVERRIDES, **{"train.steps": 2000, "parallel.expert": 4, "model.n_layers": 2,
                                 "parallel.data": 2, "train.checkpoint_every": 3})
  run = launch.start(data_dir, workdir, overrides, processes=2, devices=4,
                     env_extra=compilation_cache, log_dir=str(tmp_path),
                     extra_flags=[f"--heartbeat_timeout_seconds={HEARTBEAT_S}"])
  try:
    deadline = time.monotonic() + 500
    while "step 4/" not in run.text(0) and time.monotonic() < deadline:
      assert all(p.poll() is None for p in run.procs), run.text(0, "err")[-3000:]
      time.sleep(0.2)
    assert "step 4/" in run.text(0), run.text(0)
    run.procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # The bound on a hang, not a speed: the heartbeat timeout plus a margin for a loaded machine.
    run.procs[0].wait(timeout=HEARTBEAT_S + 90)
    waited = time.monotonic() - killed
  finally:
    run.kill()
  err = run.text(0, "err")
  lines = [line for line in err.splitlines() if line.strip()]
  assert run.procs[0].returncode != 0
  errors = [line for line in lines if line.startswith("error: ")]
  assert len(errors) == 1, err[-4000:]
  assert "process 0 of 2: a peer process of this run died" in errors[0]
  assert f"it resumes from the newest checkpoint in {workdir} (step " in errors[0]
  assert "Traceback" not in err and "Fatal Python error" not in err, err[-4000:]
  assert waited < HEARTBEAT_S + 90
