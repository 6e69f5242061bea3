"""The trainer across 2 processes x 4 CPU devices equals the single-process run.

Each multi-process run launches the ``experiments.train`` binary twice
(process 0 and 1 with ``--coordinator_address/--num_processes/--process_id``;
the binary initialises ``jax.distributed``, gloo on 127.0.0.1:
tests/train/launch.py); both train one workdir, process 0 holding its lock
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

import numpy as np
import pytest

from moejax.train import checkpoint as ckpt_lib
from moejax.train import loop, metrics_log
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers, launch

STEPS = 4
KEYS = ("loss", "ce", "aux_loss", "grad_norm", "max_vio_batch", "drop_rate")


def config(data_dir: str, **overrides):
  return helpers.experiment(
      "tiny", data_dir, train__steps=STEPS, train__warmup_steps=1, train__log_every=1,
      train__eval_every=0, train__checkpoint_every=2, train__keep_checkpoints=3,
      model__moe__topology__num_experts=8, model__moe__topology__expert_width=16, **overrides)


def run_processes(data_dir: str, workdir: str, data: int, expert: int, env_extra: dict,
                  log_dir: str) -> list[str]:
  """Trains on 2 processes x 4 devices (the experiments.train binary); returns their stdouts."""
  overrides = {"train.steps": STEPS, "train.warmup_steps": 1, "train.log_every": 1,
               "train.eval_every": 0, "train.checkpoint_every": 2, "train.keep_checkpoints": 3,
               "train.progress": False, "model.moe.topology.num_experts": 8,
               "model.moe.topology.expert_width": 16, "parallel.data": data,
               "parallel.expert": expert}
  return launch.run(data_dir, workdir, overrides, processes=2, devices=4, env_extra=env_extra,
                    log_dir=log_dir)


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
  outs = run_processes(data_dir, resumed, 1, 8, compilation_cache, str(tmp_path / "logs"))
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
  run_processes(data_dir, multi, 2, 4, compilation_cache, str(tmp_path / "logs"))
  _check_same_run(cfg, multi, one, steps=range(1, STEPS + 1))
  back = str(tmp_path / "back")
  _resume_copy(multi, back, 2)
  out = io.StringIO()
  loop.train(cfg, back, out=out)
  assert "resumed from checkpoint at step 2" in out.getvalue()
  _check_same_run(cfg, back, one, steps=range(1, STEPS + 1))
