"""Hand-computed all-to-all accounting of the ablation analysis."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.ablation import analysis


def test_a2a_bytes_by_hand():
  # 4 tokens, 2 devices, 4 experts: tokens 0-1 live on device 0, 2-3 on device 1;
  # experts 0-1 on device 0, 2-3 on device 1.
  ids = np.array([[0, 2], [2, 3], [0, 1], [3, 3]])
  sent = np.array([[True, True], [True, True], [True, True], [True, False]])
  out = analysis.a2a_bytes([(ids, sent)], num_experts=4, devices=2, row_bytes=8)
  # remote copies: t0 -> e2 (1), t1 -> e2, e3 (2), t2 -> e0, e1 (2), t3 local: 5 copies;
  # distinct remote devices: 1 + 1 + 1 + 0 = 3. Both directions: x 2 x 8 bytes / 4 tokens.
  assert out["copies"] == pytest.approx(5 * 2 * 8 / 4)
  assert out["min_device"] == pytest.approx(3 * 2 * 8 / 4)


def test_a2a_uneven_placement_and_one_device():
  ids = np.array([[0], [4]])
  sent = np.ones((2, 1), bool)
  # 5 experts over 2 devices: floor(e * 2 / 5) puts experts 0-2 on device 0, 3-4 on device 1.
  out = analysis.a2a_bytes([(ids, sent)], num_experts=5, devices=2, row_bytes=1)
  assert out["copies"] == 0.0  # token 0 -> expert 0 (local), token 1 -> expert 4 (local)
  out = analysis.a2a_bytes([(np.array([[4], [0]]), sent)], num_experts=5, devices=2, row_bytes=1)
  assert out["copies"] == pytest.approx(2 * 2 * 1 / 2)
  assert analysis.a2a_bytes([(ids, sent)], 5, 1, 4)["copies"] == 0.0
  assert analysis.ep_devices(31, 8) == 8 and analysis.ep_devices(4, 8) == 4


def test_layer_kind_metrics_reach_the_result_and_the_table(tmp_path):
  """Soft MoE / PEER / MoD metrics logged in training are averaged into result.json
  and get a column in the suite tables."""
  from moejax.ablation import columns, runner
  from moejax.train import metrics_log
  writer = metrics_log.MetricsWriter(str(tmp_path))
  for step, ent in ((1, 0.9), (2, 0.5), (3, 0.3), (4, 0.1)):
    writer.write(step, "train", {"loss": 2.0, "soft_dispatch_entropy": ent,
                                 "mod_capacity_use": 0.25})
  writer.close()
  out = runner.train_metrics(str(tmp_path))
  assert out["soft_dispatch_entropy"] == pytest.approx((0.3 + 0.1) / 2)  # second half
  assert out["mod_capacity_use"] == 0.25
  assert {"soft_dispatch_entropy", "mod_capacity_use"} <= set(columns.ARM_COLUMNS)
