"""Layer latency rows: shapes of the report, sane percentiles, dynamic-compute routers."""

from __future__ import annotations

import pytest

from moejax.config import MoEConfig, RoutingConfig
from moejax.evaluate.latency import format_rows, layer_latency
from tests.configs import moe_config


@pytest.mark.parametrize("cfg", [
    moe_config(num_experts=4, expert_width=16, routing=RoutingConfig(kind="topk", top_k=2)),
    moe_config(num_experts=4, expert_width=16,
              routing=RoutingConfig.build(kind="top_p", top_k=3, top_p=0.5)),
    moe_config(num_experts=4, expert_width=16, zero_experts=1, copy_experts=1,
              routing=RoutingConfig(kind="topk", top_k=2)),
], ids=["topk", "top_p", "zero_compute"])
def test_latency_rows_are_sane(cfg):
  rows = layer_latency(cfg, 16, batch_sizes=(1, 2), seq_len=8, iters=6, warmup=1)
  assert [r["batch_size"] for r in rows] == [1, 2]
  assert [r["tokens"] for r in rows] == [8, 16]
  for r in rows:
    assert 0.0 < r["p50_ms"] <= r["p99_ms"] and r["iters"] == 6
  text = format_rows("topk", rows)
  assert "p99 ms" in text and len(text.splitlines()) == 4


def test_latency_rejects_bad_arguments():
  with pytest.raises(ValueError, match="iters"):
    layer_latency(moe_config(num_experts=4, expert_width=8), 8, iters=0)
