"""MFU: the peak table, the peak's order (config, table, measured), the arithmetic, the train row."""

from __future__ import annotations

import types

import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.topology import accounting
from moejax.train import mfu
from tests.train import helpers


@pytest.mark.parametrize("kind, want", [
    ("NVIDIA H200", ("H200", 989e12)), ("NVIDIA H100 80GB HBM3", ("H100", 989e12)),
    ("NVIDIA H100 PCIe", ("H100 PCIe", 756e12)), ("NVIDIA A100-SXM4-80GB", ("A100", 312e12)),
    ("TPU v4", ("TPU v4", 275e12)), ("TPU v5 lite", ("TPU v5e", 197e12)),
    ("TPU v5", ("TPU v5p", 459e12)), ("TPU v5p", ("TPU v5p", 459e12)),
    ("TPU v6 lite", ("TPU v6e", 918e12)),
    # Not in the table: the v4i ("TPU v4 lite") is no v4, a CPU has no datasheet peak.
    ("TPU v4 lite", None), ("cpu", None), ("NVIDIA L4", None)])
def test_peak_table_matches_jax_device_kinds(kind, want):
  assert mfu.table_peak(kind) == want


def _device(kind, platform):
  return types.SimpleNamespace(device_kind=kind, platform=platform)


def test_peak_order_config_then_table_then_measured():
  calls = []

  def measure(dtype):
    calls.append(dtype)
    return 5e10

  h200 = _device("NVIDIA H200", "gpu")
  assert mfu.resolve_peak(400.0, h200, devices=8, processes=2, measure=measure) == mfu.Peak(
      400e12, 8, "config")
  assert mfu.resolve_peak(None, h200, devices=8, processes=2, measure=measure) == mfu.Peak(
      989e12, 8, "table:H200")
  assert calls == []  # nothing measured when the peak is known
  # A CPU roof counts once per process: simulated devices share its cores.
  assert mfu.resolve_peak(None, _device("cpu", "cpu"), devices=8, processes=2,
                          measure=measure) == mfu.Peak(5e10, 2, "measured:cpu")
  assert mfu.resolve_peak(None, _device("NVIDIA L4", "gpu"), devices=4, processes=1,
                          measure=measure) == mfu.Peak(5e10, 4, "measured:gpu")
  assert calls == ["float32", "bfloat16"]


def test_mfu_of_a_known_flop_count_time_and_peak():
  # 4 steps of 3e11 FLOPs in 2 s = 6e11 FLOP/s; peak 1e12 per device x 2 devices.
  meter = mfu.Meter(flops_per_step=3e11, peak=mfu.Peak(1e12, 2, "config"))
  row = meter.row(steps=4, seconds=2.0)
  assert row == {"model_tflops_per_s": pytest.approx(0.6), "mfu": pytest.approx(0.3),
                 "peak_tflops": 1.0, "peak_source": "config"}
  # A window of only the compiling first step: no rate, like tokens/s.
  assert meter.row(steps=0, seconds=2.0)["mfu"] == 0.0
  assert mfu.mfu(1.5e12, 3.0, 1e12) == pytest.approx(0.5)
  assert mfu.progress_text(row) == " | 0.6 TFLOP/s | MFU 30.0%"
  assert mfu.progress_text({"loss": 1.0}) == ""


def test_step_flops_are_three_forwards_of_every_position_by_the_accounting():
  cfg = helpers.experiment("tiny")
  fwd = accounting.budget(cfg.model, seq_len=32).flops_per_token
  assert mfu.step_flops(cfg) == 3.0 * fwd * 8 * 32  # tiny: batch 8 x seq_len 32
  double = helpers.experiment("tiny", data__batch_size=16)
  assert mfu.step_flops(double) == 2 * mfu.step_flops(cfg)


def test_the_cpu_matmul_roof_is_a_positive_rate():
  roof = mfu.measure_matmul_roof("float32", seconds=0.05, n=64)
  assert np.isfinite(roof) and roof > 0


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_peak_tflops_must_be_a_positive_number(value):
  with pytest.raises(ConfigError, match=r"train\.peak_tflops="):
    helpers.experiment("tiny", train__peak_tflops=value)


def test_every_train_row_says_its_flop_rate_mfu_and_peak(tiny_run):
  cfg, workdir, _, stdout = tiny_run
  from moejax.train import metrics_log  # pylint: disable=g-import-not-at-top
  rows = metrics_log.read_metrics(workdir, "train")
  for row in rows:
    assert row["peak_source"] == "measured:cpu" and row["peak_tflops"] > 0
    assert row["mfu"] == pytest.approx(row["model_tflops_per_s"] / row["peak_tflops"])
    # Same window and clock as tokens/s; every position of the tiny batches is a target.
    assert row["model_tflops_per_s"] * 1e12 == pytest.approx(
        row["tokens_per_s"] / (8 * 32) * mfu.step_flops(cfg), rel=1e-9)
  assert rows[-1]["mfu"] > 0
  assert "TFLOP/s | MFU " in stdout and "(measured:cpu)" in stdout
