"""experiments.bench --suite=layer at a toy size: every variant, both frameworks, one run."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
