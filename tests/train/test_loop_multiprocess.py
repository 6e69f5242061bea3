"""The trainer across 2 processes x 4 CPU devices equals the single-process run.

Each multi-process run launches multiprocess_train_child.py twice (process
0 and 1, ``jax.distributed`` with gloo on 127.0.0.1); both call
:func:`moejax.train.loop.train` on one workdir, process 0 holding its lock
and writing its files. The reference is the same tiny config trained in
this process on one device. The model has 8 experts so that the expert axis
can span all 8 devices of both processes.

Both are ``slow`` (compile time in 3 processes dominates; the first ~1.5
min, the second ~2 min on 2 shared cores):

* a single-process run's checkpoint at step 2 resumes on 2
  processes with the expert axis over both (data=1, expert=8: the
  all_to_all crosses processes, every process feeds its half of each global
  batch) and trains steps 3-4: losses, gradient norms, routing metrics and
  the router bias equal the uninterrupted single-process run; metrics are
  written once.
* 2 processes from scratch (data axis over the processes: data=2,
  expert=4) equal the single-process run step for step, and their step-2
  checkpoint resumes in one process to the same end.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from moejax.train import checkpoint as ckpt_lib
from moejax.train import loop, metrics_log
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers

CHILD = "tests.train.multiprocess_train_child"
STEPS = 4
KEYS = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "drop_rate")


def config(data_dir: str, **overrides):
  return helpers.experiment(
      "tiny", data_dir, train__steps=STEPS, train__warmup_steps=1, train__log_every=1,
      train__eval_every=0, train__checkpoint_every=2, train__keep_checkpoints=3,
      model__moe__topology__num_experts=8, model__moe__topology__expert_width=16, **overrides)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(data_dir: str, workdir: str, data: int, expert: int, env_extra: dict,
                  timeout: int = 500) -> list[str]:
  """Trains on 2 processes x 4 devices; returns their stdouts. Both are killed whatever happens."""
  port = _free_port()
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu",
             # Compile time dominates these tiny steps; LLVM's -O0 halves it.
             XLA_FLAGS="--xla_backend_optimization_level=0", **env_extra)
  procs = [subprocess.Popen([sys.executable, "-m", CHILD, str(i), "2", str(port), data_dir,
                             workdir, str(data), str(expert)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=helpers.ROOT) for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}:\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    assert f"OK {i}" in out, out
  return [out for out, _ in outs]


def _router_bias(cfg, workdir: str, step: int) -> list[np.ndarray]:
  """Every layer's router bias in the run's checkpoint at ``step``."""
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train))
  ckpt = ckpt_lib.Checkpointer(workdir, cfg.train.keep_checkpoints, read_only=True)
  try:
    tree, _ = ckpt.restore(step, abstract.checkpoint_tree())
  finally:
    ckpt.close()
  return [np.asarray(tree["router_state"]["blocks"][i]["ffn"]["router_state"]["bias"])
          for i in range(cfg.model.n_layers)]


def _resume_copy(src: str, dst: str, step: int) -> None:
  """``dst``: ``src`` as if killed after its checkpoint at ``step`` (later ones removed)."""
  shutil.copytree(src, dst)
  for s in ckpt_lib.checkpoint_steps(dst):
    if s > step:
      shutil.rmtree(os.path.join(dst, ckpt_lib.CHECKPOINT_DIR, str(s)))


def _check_same_run(cfg, got_dir: str, want_dir: str, steps) -> None:
  rows = [metrics_log.read_metrics(d, "train") for d in (got_dir, want_dir)]
  got, want = ({r["step"]: r for r in rs} for rs in rows)
  assert len(rows[0]) == len(got), "a step was logged twice (two writers)"
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  for step in steps:
    for key in KEYS:
      # Same global batch and routing, another reduction order: equal up to rounding.
      np.testing.assert_allclose(got[step][key], want[step][key], rtol=1e-4, atol=1e-6,
                                 err_msg=f"step {step} {key}")
  val = [metrics_log.read_metrics(d, "eval")[-1]["loss"] for d in (got_dir, want_dir)]
  np.testing.assert_allclose(val[0], val[1], rtol=1e-4)
  unit = cfg.model.moe.balance.bias_rate
  for i, (b_got, b_want) in enumerate(zip(_router_bias(cfg, got_dir, STEPS),
                                          _router_bias(cfg, want_dir, STEPS))):
    assert np.any(np.abs(b_want) >= unit / 2), f"layer {i}: the controller never moved"
    np.testing.assert_allclose(b_got, b_want, rtol=0, atol=unit * 1e-3,
                               err_msg=f"router bias, layer {i}")


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, data_dir):
  workdir = str(tmp_path_factory.mktemp("multiprocess") / "one")
  cfg = config(data_dir)
  loop.train(cfg, workdir, out=io.StringIO())
  return cfg, workdir


@pytest.mark.slow  # ~1.5 min on 2 cores: the one-process run, then 2 processes resuming it
def test_single_process_checkpoint_resumes_on_two_processes(one_process_run, tmp_path,
                                                            data_dir, compilation_cache):
  cfg, one = one_process_run
  resumed = str(tmp_path / "resumed")
  _resume_copy(one, resumed, 2)
  outs = run_processes(data_dir, resumed, 1, 8, compilation_cache)
  for out in outs:
    assert "resumed from checkpoint at step 2" in out, out
    assert "parallel.expert: 1 -> 8" in out, out
  _check_same_run(cfg, resumed, one, steps=(3, 4))
  history = [h["event"] for h in ckpt_lib.read_history(resumed)]
  assert history == ["start", "end", "resume", "end"], history  # one line per event
  assert not os.path.exists(os.path.join(resumed, "run.lock"))


@pytest.mark.slow  # ~2-3 min on 2 cores: 2 processes from scratch, then a resume in this one
def test_two_processes_equal_one_step_by_step_and_resume_in_one(one_process_run, tmp_path,
                                                                 data_dir, compilation_cache):
  cfg, one = one_process_run
  multi = str(tmp_path / "multi")
  run_processes(data_dir, multi, 2, 4, compilation_cache)
  _check_same_run(cfg, multi, one, steps=range(1, STEPS + 1))
  back = str(tmp_path / "back")
  _resume_copy(multi, back, 2)
  out = io.StringIO()
  loop.train(cfg, back, out=out)
  assert "resumed from checkpoint at step 2" in out.getvalue()
  _check_same_run(cfg, back, one, steps=range(1, STEPS + 1))
