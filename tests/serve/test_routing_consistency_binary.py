"""experiments/routing_consistency.py from the outside: a JSON and a plot; one line per bad flag.

The run is configs/tiny.py's initial state saved as a checkpoint (the
``tiny_run`` fixture of tests/serve/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.train import helpers


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  return subprocess.run([sys.executable, "-m", "experiments.routing_consistency", *args],
                        cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a minute of compiles; the library it runs: test_consistency_perturbations.py
def test_writes_the_json_and_the_plot(tiny_run, tmp_path):
  out = tmp_path / "c.json"
  proc = _run(f"--workdir={tiny_run}", f"--json_out={out}", "--perturbations=ep2,ep8,remat",
              "--rows=8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(out.read_text())
  assert (got["step"], got["rows"], got["tokens"]) == (1, 8, 8 * 32)
  # The binary starts JAX on 8 simulated CPU devices: ep2 runs; the tiny model's 4 experts
  # do not split over 8.
  assert 0.0 <= got["perturbations"]["ep2"]["flip_rate"] <= 1.0
  assert "does not divide moe.topology.num_experts=4" in got["perturbations"]["ep8"]["n/a"]
  assert got["perturbations"]["remat"]["flip_rate"] == 0.0
  hist = got["margins"]["all"]
  assert sum(hist["counts"]) <= 2 * 8 * 32 and len(hist["edges"]) == len(hist["counts"]) + 1
  assert (tmp_path / "c.png").stat().st_size > 0
  assert "ep8          n/a:" in proc.stdout


@pytest.mark.parametrize("args, line", [
    # One process start each; the unknown name is also refused by the library's test.
    pytest.param(["--perturbations=bf16,int3"],
                 "error: --perturbations: unknown int3. Fix: pick from", marks=pytest.mark.slow),
    (["--batches=0"], "error: --batches=0: needs at least one batch. Fix: --batches=1"),
])
def test_a_bad_flag_is_one_line_before_any_compute(tiny_run, tmp_path, args, line):
  proc = _run(f"--workdir={tiny_run}", f"--json_out={tmp_path / 'c.json'}", *args)
  assert proc.returncode == 1 and proc.stderr.startswith(line), proc.stderr[-3000:]
  assert len(proc.stderr.splitlines()) == 1 and not os.listdir(tmp_path)
