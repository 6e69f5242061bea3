"""experiments.device_check: the CPU dry run end to end, and its step runner."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import pytest

from experiments import device_check

ROOT = pathlib.Path(__file__).resolve().parent.parent
HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None


def _run(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "experiments.device_check", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def test_dry_run_runs_every_step_and_every_check_passes(tmp_path):
  out = tmp_path / "dry.json"
  r = _run("--dry_run", f"--json_out={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["dry_run"] and list(report["steps"]) == list(device_check.STEPS)
  assert report["summary"] == {name: "ok" for name in device_check.STEPS}, report["summary"]
  steps = report["steps"]
  # Both platforms' kernels lower (cuda, tpu) and pass against ragged_dot.
  assert steps["lowering"]["all_lowered"] and len(steps["lowering"]["kernels"]) == 14
  corr = steps["gmm_correctness"]
  assert corr["all_kernels_passed"]
  # tokamax is the optional ``kernels`` extra (CI does not install it): where it
  # is missing the check records the ImportError instead of a result.
  peers = ("megablox", "tokamax") if HAVE_TOKAMAX else ("megablox",)
  for case in ("ragged_empty_tail", "one_group", "all_empty"):
    for name in ("pallas_gpu", "pallas_tpu", "pallas_gpu_tgmm", "pallas_tpu_tgmm") + peers:
      assert corr["cases"][case]["variants"][name]["passed"], (case, name)
    if not HAVE_TOKAMAX:
      assert "tokamax" in corr["cases"][case]["variants"]["tokamax"]["error"]
  timing = steps["gmm_timing"]["variants"]
  for name in ("dense", "ragged_dot", "pallas_gpu", "pallas_tpu") + peers:
    assert timing[name]["fwd"]["tflops"] > 0, name
  assert steps["gather"]["all_exact"]
  layer = steps["layer"]["tiny"]["variants"]
  assert layer["pallas_tpu+gather"]["fwdbwd"]["ratio_to_dense"] > 0
  train = steps["train"]
  assert train["default"]["trained"] and train["default"]["tokens_per_s"] > 0
  assert train["default"]["compute_dtype"] == "bfloat16"
  assert train["large"]["flops_per_token_vs_default"] > 1


def test_failing_step_is_recorded_and_the_run_goes_on():
  def boom():
    raise RuntimeError("kernel exploded")

  written = []
  res = device_check.run_steps({"a": lambda: {"x": 1}, "b": boom,
                                "c": lambda: {"all_exact": False}, "d": lambda: {}},
                               budget_s=1e9, write=lambda r: written.append(dict(r)))
  assert res["a"]["status"] == "ok" and res["a"]["x"] == 1
  assert res["b"]["status"] == "failed"
  assert res["b"]["error"] == "RuntimeError: kernel exploded"
  assert any("boom" in line for line in res["b"]["traceback"])
  assert res["c"]["status"] == "check_failed" and res["c"]["failed_checks"] == ["all_exact"]
  assert res["d"]["status"] == "ok"
  assert len(written) == 4  # the JSON is rewritten after every step


def test_steps_past_the_budget_are_skipped_not_run():
  ran = []
  res = device_check.run_steps({"a": lambda: ran.append("a") or {},
                                "b": lambda: ran.append("b") or {}}, budget_s=-1.0)
  assert ran == [] and {r["status"] for r in res.values()} == {"skipped"}


def test_guarded_variant_failure_is_a_record():
  res = device_check.guarded(lambda: 1 / 0)
  assert res["status"] == "failed" and res["error"].startswith("ZeroDivisionError")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a machine without accelerator")
def test_no_accelerator_without_dry_run_is_a_clear_error():
  r = _run("--steps=environment", timeout=120)
  assert r.returncode != 0
  assert "no accelerator" in r.stderr and "--dry_run" in r.stderr
