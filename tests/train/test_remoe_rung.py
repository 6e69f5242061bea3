"""ReMoE keeps its target at every rung and device count: active experts within 10% of k (slow).

The small suite model (moejax.ablation.bases.small_experiment: the ``s``
rung is d=64, 2 MoE layers, 8 experts, 300 steps of 16 x 64 tokens; ``m``
doubles width, depth and sequence length) with ``routing.kind='remoe'`` and
the paper's lambda_0 = 1e-8, alpha = 1.2, trained on one device at ``s``
and ``m`` and with the experts spread over 8 simulated devices at ``s``
(expert parallelism, a child process: the device count is fixed when JAX
starts). Over the last quarter of training the realised active experts per
token (the logged ``active_experts_mean``, the mean over those steps) must
be within 10% of the target k = 2 whatever the rung or device count, and
lambda must have left its start.

Run as a script (``python -m tests.train.test_remoe_rung RUNG EXPERT DATA_DIR
WORKDIR``) it trains one case and prints the realised count.
"""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.train import helpers

K = 2
CASES = [("s", 1), ("m", 1), ("s", 8)]


def config(rung: str, expert: int, data_dir: str):
  from moejax.ablation.bases import small_experiment, small_moe
  from moejax.ablation.scale import scale_experiment
  from moejax.train.config import experiment_from_dict
  moe = small_moe(routing=dict(kind="remoe", top_k=K),
                  balance=dict(extra_losses=(("remoe_l1", 1.0),)))
  tree = scale_experiment(small_experiment(moe), rung)
  tree["data"]["data_dir"] = data_dir
  steps = tree["train"]["steps"]
  tree["train"].update(progress=False, eval_every=steps, checkpoint_every=steps)
  if expert > 1:
    tree["parallel"] = dict(expert=expert)
  return experiment_from_dict(tree)


def train(rung: str, expert: int, data_dir: str, workdir: str):
  from moejax.train import loop
  cfg = config(rung, expert, data_dir)
  loop.train(cfg, workdir, out=io.StringIO())
  return cfg


def last_quarter(workdir: str, steps: int):
  rows = helpers.rows_by_step(workdir, "train")
  last = [r for s, r in rows.items() if s > steps * 3 // 4]
  assert last and min(s for s in rows if s > steps * 3 // 4) <= steps * 3 // 4 + 25
  active = float(np.mean([r["active_experts_mean"] for r in last]))
  return active, rows[steps]["state/remoe/coef"], [r["active_experts_mean"] for r in last]


@pytest.mark.slow
@pytest.mark.parametrize("rung, expert", CASES)
def test_remoe_keeps_k_active_experts_per_token(rung, expert, tmp_path, data_dir):
  workdir = str(tmp_path / "run")
  if expert == 1:
    cfg = train(rung, expert, data_dir, workdir)
  else:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(expert))
    env.pop("XLA_FLAGS", None)  # a forced host device count would override ours
    done = subprocess.run([sys.executable, "-m", "tests.train.test_remoe_rung", rung,
                           str(expert), data_dir, workdir], cwd=helpers.ROOT, env=env,
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    cfg = config(rung, expert, data_dir)
  active, coef, trace = last_quarter(workdir, cfg.train.steps)
  assert abs(active - K) <= 0.1 * K, (rung, expert, active, trace)
  assert coef > 1e-6


if __name__ == "__main__":
  rung_, expert_, data_, work_ = sys.argv[1:5]
  import jax
  assert jax.device_count() == int(expert_), jax.device_count()
  cfg_ = train(rung_, int(expert_), data_, work_)
  print("active experts per token, last quarter: %.3f (lambda %.3g)"
        % last_quarter(work_, cfg_.train.steps)[:2])
