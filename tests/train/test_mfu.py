"""MFU: the peak table by dtype, the peak's order (config, table, calibration, none), the
arithmetic, the train row."""

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


def test_the_table_peak_is_the_compute_dtypes():
  assert mfu.table_peak("NVIDIA H200", "float32") == ("H200", 494e12)  # TF32, dense
  assert mfu.table_peak("NVIDIA A100-SXM4-80GB", "float32") == ("A100", 156e12)
  assert mfu.table_peak("TPU v5 lite", "float32") == ("TPU v5e", 197e12)  # bf16 passes
  assert mfu.PEAK_BF16[1] == ("H200", "H200", False, 989e12)  # device_check's column


def _device(kind, platform):
  return types.SimpleNamespace(device_kind=kind, platform=platform)


def _never_measured(*args, **kwargs):
  raise AssertionError("a run must read its peak, not measure it")


def test_peak_order_config_then_table_then_calibration_then_none(monkeypatch):
  monkeypatch.setattr(mfu, "measure_matmul_roof", _never_measured)
  cpu, l4 = _device("cpu", "cpu"), _device("NVIDIA L4", "gpu")
  h200 = _device("NVIDIA H200", "gpu")
  cal = {mfu.calibration_key(cpu, "float32"): {"tflops": 0.05},
         mfu.calibration_key(l4, "bfloat16"): {"tflops": 100.0}}
  peak = lambda tflops, device, dtype="float32": mfu.resolve_peak(
      tflops, device, dtype=dtype, devices=8, processes=2, calibrations=cal)
  assert peak(400.0, h200) == mfu.Peak(400e12, 8, "config")
  assert peak(None, h200, "bfloat16") == mfu.Peak(989e12, 8, "table:H200")
  assert peak(None, h200) == mfu.Peak(494e12, 8, "table:H200")
  # A CPU roof counts once per process: simulated devices share its cores.
  assert peak(None, cpu) == mfu.Peak(5e10, 2, "calibrated:cpu")
  assert peak(None, l4, "bfloat16") == mfu.Peak(100e12, 8, "calibrated:gpu")
  assert peak(None, cpu, "bfloat16") is None  # that dtype was not calibrated
  assert peak(None, l4) is None


def test_two_runs_read_the_same_calibrated_peak(tmp_path, monkeypatch):
  """Calibrated once (the bench command), read by every run: the same peak each time."""
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path / "cache"))
  cfg = helpers.experiment("tiny")
  before = mfu.Meter.for_run(cfg)
  assert before.peak is None and before.row(10, 2.0) == {
      "model_tflops_per_s": pytest.approx(mfu.step_flops(cfg) * 5 / 1e12),
      "peak_source": "none"}
  assert before.describe().startswith(
      "MFU n/a: no known float32 peak for this device; calibrate this machine once with "
      f"`python -m experiments.bench --suite=peak` (cached in {tmp_path}/cache/peak.json) or "
      "set --config.train.peak_tflops; ")
  assert mfu.progress_text(before.row(10, 2.0)).endswith(" TFLOP/s | MFU n/a")
  roofs = iter([2.5e10, 1.0e10])  # what two measurements would see under changing load
  written = mfu.calibrate(measure=lambda dtype, seconds: next(roofs))
  assert [r["tflops"] for r in written.values()] == [0.025, 0.01]
  monkeypatch.setattr(mfu, "measure_matmul_roof", _never_measured)
  first, second = mfu.Meter.for_run(cfg), mfu.Meter.for_run(cfg)
  assert first.describe() == second.describe()
  assert first.describe().startswith("MFU against 0.025 TFLOP/s x 1 (calibrated:cpu); ")
  assert mfu.progress_text(first.row(10, 2.0)) == mfu.progress_text(second.row(10, 2.0))
  assert mfu.progress_text(first.row(10, 2.0)).endswith("% of 0.025 TFLOP/s")
  # The bf16 run reads its own calibration; the config overrides both.
  bf16 = helpers.experiment("tiny", model__compute_dtype="bfloat16")
  assert mfu.Meter.for_run(bf16).peak.per_device == 1e10
  assert mfu.Meter.for_run(helpers.experiment("tiny", train__peak_tflops=2.0)).peak == \
      mfu.Peak(2e12, 1, "config")


def test_the_cache_is_the_users(monkeypatch):
  monkeypatch.delenv("MOEJAX_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
  assert mfu.calibration_path() == "/x/cache/moejax/peak.json"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", "/home/u")
  assert mfu.calibration_path() == "/home/u/.cache/moejax/peak.json"


def test_mfu_of_a_known_flop_count_time_and_peak():
  # 4 steps of 3e11 FLOPs in 2 s = 6e11 FLOP/s; peak 1e12 per device x 2 devices.
  meter = mfu.Meter(flops_per_step=3e11, peak=mfu.Peak(1e12, 2, "config"))
  row = meter.row(steps=4, seconds=2.0)
  assert row == {"model_tflops_per_s": pytest.approx(0.6), "mfu": pytest.approx(0.3),
                 "peak_tflops": 1.0, "peak_devices": 2, "peak_source": "config"}
  # A window of only the compiling first step: no rate, like tokens/s.
  assert meter.row(steps=0, seconds=2.0)["mfu"] == 0.0
  assert mfu.mfu(1.5e12, 3.0, 1e12) == pytest.approx(0.5)
  assert mfu.progress_text(row) == " | 0.6 TFLOP/s | MFU 30.0% of 1 TFLOP/s x 2"
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


def test_every_train_row_says_its_flop_rate_and_without_a_peak_mfu_na(tiny_run):
  """The tests' cache holds no calibration (tests/conftest.py): the run says MFU n/a and how
  to calibrate, and measures nothing at its start."""
  cfg, workdir, _, stdout = tiny_run
  from moejax.train import metrics_log  # pylint: disable=g-import-not-at-top
  rows = metrics_log.read_metrics(workdir, "train")
  for row in rows:
    assert row["peak_source"] == "none" and "mfu" not in row and "peak_tflops" not in row
    # Same window and clock as tokens/s; every position of the tiny batches is a target.
    assert row["model_tflops_per_s"] * 1e12 == pytest.approx(
        row["tokens_per_s"] / (8 * 32) * mfu.step_flops(cfg), rel=1e-9)
  assert rows[-1]["model_tflops_per_s"] > 0
  assert "TFLOP/s | MFU n/a" in stdout
  assert "MFU n/a: no known float32 peak for this device; calibrate this machine once with " \
      "`python -m experiments.bench --suite=peak`" in stdout
