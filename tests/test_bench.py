"""experiments.bench: --suite=layer at a toy size (every variant, one run) and --suite=step."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow  # imports torch and times both frameworks (~15 s on CI)
def test_layer_suite_times_jax_and_torch_side_by_side(tmp_path):
  pytest.importorskip("transformers")
  out = tmp_path / "layer.json"
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--suite=layer", "--tokens=64",
       "--d_model=32", "--shapes=coarse", "--repeats=1", "--torch_threads=1",
       "--variants=dense,blocked,torch_dense,hf_mixtral,hf_mixtral_grouped_mm",
       f"--json_out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  shape = json.loads(out.read_text())["shapes"]["coarse"]
  assert shape["torch_threads"] == 1 and shape["torch_skipped"] is None
  rows = shape["variants"]
  assert set(rows) == {"dense", "blocked", "torch_dense", "hf_mixtral", "hf_mixtral_grouped_mm"}
  for name, row in rows.items():
    for mode in ("fwd", "fwdbwd"):
      assert row[mode]["median_s"] > 0 and row[mode]["cpu_s"] >= 0, (name, mode)
  # Each framework's rows are relative to its own dense FFN.
  assert rows["dense"]["fwdbwd"]["ratio_to_dense"] == 1.0
  assert rows["torch_dense"]["fwdbwd"]["ratio_to_torch_dense"] == 1.0
  assert "ratio_to_torch_dense" in rows["hf_mixtral"]["fwdbwd"]
  assert "ratio_to_torch_dense" not in rows["blocked"]["fwdbwd"]
  assert "torch_dense" in r.stdout and "hf_mixtral" in r.stdout


def test_step_bench_times_each_part_after_its_compiling_run():
  from experiments import bench_step  # pylint: disable=g-import-not-at-top
  calls = {"a": 0, "b": 0}

  def count(name):
    def fn():
      calls[name] += 1
      return name
    return fn

  times = bench_step.time_parts({"a": count("a"), "b": count("b")}, repeats=3)
  assert calls == {"a": 4, "b": 4}  # one untimed (compiling) run, then 3 timed
  assert set(times) == {"a", "b"} and set(times["a"]) == {"wall_s", "cpu_s"}
  assert all(t >= 0 for part in times.values() for t in part.values())


def test_step_bench_stops_on_a_failing_part():
  from experiments import bench_step  # pylint: disable=g-import-not-at-top

  def broken():
    raise ValueError("no such shape")

  with pytest.raises(RuntimeError, match="parts failed.*broken.*no such shape"):
    bench_step.time_parts({"ok": lambda: 1, "broken": broken}, repeats=1)


@pytest.mark.slow
def test_step_bench_smoke(tmp_path):
  out = tmp_path / "step.json"
  r = subprocess.run([sys.executable, "-m", "experiments.bench", "--suite=step", "--step_scale=s",
                      "--step_repeats=1", f"--json_out={out}"], cwd=ROOT, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.loads(out.read_text())
  assert res["scale"] == "s" and res["shape"]["d_model"] == 64
  assert res["times"]["attention"]["per_layer"] == res["shape"]["n_layers"] == 2
  assert set(res["times"]) >= {"train step", "rest of the step", "compile train step"}
  assert "| train step |" in r.stdout
