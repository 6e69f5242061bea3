"""ReMoE trained at the ``s`` rung keeps its target: active experts within 10% of k (slow).

The small suite model (moejax.ablation.bases.small_experiment, the ``s``
rung: d=64, 2 MoE layers, 8 experts, 300 steps of 16 x 64 tokens) with
``routing.kind='remoe'`` and the paper's lambda_0 = 1e-8, alpha = 1.2. Over
the last quarter of training the realised active experts per token (the
logged ``active_experts_mean``, the mean over those steps) must be within
10% of the target k = 2, and lambda must have left its start.
"""

import io

import numpy as np
import pytest

from moejax.ablation.bases import small_experiment, small_moe
from moejax.train import loop
from moejax.train.config import experiment_from_dict
from tests.train import helpers

K = 2


@pytest.mark.slow
def test_remoe_keeps_k_active_experts_per_token_at_the_s_rung(tmp_path, data_dir):
  moe = small_moe(routing=dict(kind="remoe", top_k=K),
                  balance=dict(extra_losses=(("remoe_l1", 1.0),)))
  tree = small_experiment(moe)
  tree["data"]["data_dir"] = data_dir
  tree["train"].update(progress=False, eval_every=300, checkpoint_every=300)
  cfg = experiment_from_dict(tree)
  loop.train(cfg, str(tmp_path), out=io.StringIO())
  rows = helpers.rows_by_step(str(tmp_path), "train")
  steps = cfg.train.steps
  last = [r for s, r in rows.items() if s > steps * 3 // 4]
  assert last and min(s for s in rows if s > steps * 3 // 4) <= steps * 3 // 4 + 25
  active = float(np.mean([r["active_experts_mean"] for r in last]))
  assert abs(active - K) <= 0.1 * K, (active, [r["active_experts_mean"] for r in last])
  assert rows[steps]["state/remoe/coef"] > 1e-6
