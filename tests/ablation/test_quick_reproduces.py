"""The README's main job reproduces RESULTS.md's `quick` block (slow: ~7 min on 2 cores).

    python -m pytest -m slow tests/ablation/test_quick_reproduces.py

Re-runs ``configs/ablations/quick.py`` exactly as the README's first command
does and compares its summary with the committed ``results/quick.json``
within the tolerances below. On the machine and jax version of the block the
numbers are bit-identical; another CPU may round XLA's reductions
differently, which moves a 250-step run a little, so the tolerances leave room
for that and for nothing more (they are below the differences the block
reports). A different Python reads a different corpus (the standard library
is the data): then the numbers are not comparable and the test skips, saying
so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moejax.ablation import summary as summary_lib
from moejax.results import report
from tests import fast_compile
from tests.ablation import helpers

# metric -> absolute tolerance on each arm's value and on the arm's difference to the baseline.
TOLERANCE = {"val_loss": 0.005, "max_vio_global": 0.05, "max_vio_batch": 0.05}


def _readme_environment() -> dict:
  """The environment the README's command runs in: none of the test run's own settings.

  A 250-step run's MaxVio is chaotic in the last bits of its arithmetic (a top-k choice
  flips and the trajectories part), so the reproduction runs exactly as a user's shell
  does: without tests/fast_compile.py's XLA:CPU flags (other instruction
  selection) and without simulated devices (the batch reduced over 8 devices sums in
  another order than on one).
  """
  env = dict(os.environ, PYTHONPATH=helpers.ROOT)
  env["XLA_FLAGS"] = fast_compile.without(env.get("XLA_FLAGS", ""))
  env.pop("JAX_NUM_CPU_DEVICES", None)
  return env


def test_the_reproduction_runs_in_the_readme_environment(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"{fast_compile.XLA_FLAGS} --xla_dump_to=/tmp/x")
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
  env = _readme_environment()
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" and "JAX_NUM_CPU_DEVICES" not in env


@pytest.mark.slow
def test_quick_suite_reproduces_the_committed_block(tmp_path):
  with open(os.path.join(helpers.ROOT, "results", "quick.json"), encoding="utf-8") as f:
    want = json.load(f)
  parts = report.stale_parts(want)
  assert parts == [], (
      f"results/quick.json is stale or unverified (code changed since its run: {parts}); "
      "re-run the quick suite and regenerate RESULTS.md before checking reproduction "
      "(docs/ablations.md, Fresh results)")
  workdir = tmp_path / "quick"
  proc = subprocess.run([sys.executable, "-m", "experiments.ablate",
                         "--config=configs/ablations/quick.py", f"--workdir={workdir}"],
                        cwd=helpers.ROOT, capture_output=True, text=True, timeout=3600,
                        env=_readme_environment())
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = summary_lib.suite_summary(str(workdir))
  if got["corpus"]["ids"] != want["corpus"]["ids"]:
    pytest.skip(f"another corpus ({got['corpus']['ids']} vs the block's "
                f"{want['corpus']['ids']}): a different Python reads other files")
  assert set(got["arms"]) == set(want["arms"])
  for arm in want["arms"]:
    for metric, tol in TOLERANCE.items():
      g = got["arms"][arm]["metrics"][metric]["interval"]["mean"]
      w = want["arms"][arm]["metrics"][metric]["interval"]["mean"]
      assert abs(g - w) <= tol, f"{arm} {metric}: {g} here vs {w} in RESULTS.md (tol {tol})"
  for arm, comps in want["comparisons"].items():
    for metric, tol in TOLERANCE.items():
      g = got["comparisons"][arm][metric]["diff"]["mean"]
      w = comps[metric]["diff"]["mean"]
      assert abs(g - w) <= tol, f"{arm} diff {metric}: {g} vs {w} (tol {tol})"
      assert got["comparisons"][arm][metric]["verdict"] == comps[metric]["verdict"]
