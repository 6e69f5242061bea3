"""experiments.generate, experiments.quantize and bench --suite=serving, run as a user would."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from moejax.train import loop
from tests.train import helpers

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(module, *args, timeout=600):
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny_workdir(tmp_path_factory):
  """configs/tiny.py trained 4 steps (a checkpoint at step 4)."""
  workdir = str(tmp_path_factory.mktemp("serve_run") / "run")
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  cfg = helpers.experiment("tiny", data_dir, train__steps=4, train__warmup_steps=1, train__checkpoint_every=4,
                           train__eval_every=4, train__eval_batches=1)
  loop.train(cfg, workdir)
  return workdir


def test_generate_cli_batch_and_quantized(tiny_workdir):
  r = _run("experiments.generate", f"--workdir={tiny_workdir}", "--prompt=def f(",
           "--prompt=import", "--max_new_tokens=6", "--temperature=0.8", "--top_p=0.9",
           "--quantize=int8", "--stop_at_end_of_document=false")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "--- prompt: 'def f('" in r.stdout and "--- prompt: 'import'" in r.stdout
  assert "step 4, 2 prompt(s), 12 new tokens" in r.stdout


def test_generate_cli_errors():
  bad = _run("experiments.generate", "--workdir=/nonexistent", "--prompt=x", "--top_p=0")
  assert bad.returncode == 1 and "sampling.top_p=0.0" in bad.stderr
  missing = _run("experiments.generate", "--workdir=/nonexistent", "--prompt=x")
  assert missing.returncode == 1 and "has no config.json" in missing.stderr


def test_quantize_cli(tiny_workdir, tmp_path):
  out = tmp_path / "q.json"
  r = _run("experiments.quantize", f"--workdir={tiny_workdir}", "--num_batches=1",
           "--schemes=int8,int4_g16", f"--json_out={out}")
  assert r.returncode == 0, r.stderr[-2000:]
  rows = json.loads(out.read_text())["moejax"]["rows"]
  assert list(rows) == ["float", "int8", "int4_g16"]
  assert rows["float"]["val_loss_delta"] == 0.0 and rows["float"]["routing_changed"] == 0.0
  assert rows["int4_g16"]["expert_bytes"] < rows["int8"]["expert_bytes"] \
      < rows["float"]["expert_bytes"]
  assert "| int8 |" in r.stdout


@pytest.mark.slow  # a benchmark smoke (~25 s on CI); decode correctness is tests/serve/test_decode.py
def test_serving_bench_smoke(tmp_path):
  out, png = tmp_path / "s.json", tmp_path / "s.png"
  r = _run("experiments.bench", "--suite=serving", "--serving_batches=1,2",
           "--serving_steps=2", "--serving_prompt=4", "--serving_prefill_repeats=1",
           "--serving_ffn_repeats=1", "--serving_d_model=32", "--serving_layers=1",
           "--serving_heads=2", "--serving_experts=4", "--serving_expert_width=16",
           f"--json_out={out}", f"--serving_plot={png}")
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.loads(out.read_text())
  assert set(res["results"]) == {"moe", "dense_active", "dense_total"}
  moe = res["results"]["moe"]
  # One token per step picks top-2 of 4 experts: exactly 2 distinct experts.
  assert moe["1"]["experts_touched_mean"] == 2.0 and len(moe["1"]["decode_all_s"]) == 2
  assert res["models"]["dense_active"]["ffn_width"] == 2 * 16
  assert res["models"]["dense_total"]["ffn_width"] == 4 * 16
  assert set(res["ffn_slot_s"]["2"]) == {"moe_blocked", "moe_ragged_dot", "moe_reference",
                                         "moe_gather", "dense_active", "dense_total"}
  assert png.stat().st_size > 10_000
