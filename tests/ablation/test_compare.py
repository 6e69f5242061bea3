"""experiments.compare: side-by-side table, budget mismatches flagged."""

from __future__ import annotations

import json
import os
import subprocess
import sys


from moejax.ablation import summary
from tests.ablation import helpers

OPT = "adamw lr=0.003 steps=10"


def _result(root, suite, arm, active, optimizer=OPT, val=2.0):
  path = os.path.join(root, suite, arm)
  os.makedirs(path)
  res = {"suite": suite, "arm": arm, "seed": 0, "run": arm, "val_loss": val,
         "budget": {"total": 1000, "active": active, "active_max": active,
                    "flops_per_token": 2 * active, "tokens": 640, "optimizer": optimizer}}
  with open(os.path.join(path, "result.json"), "w") as f:
    json.dump(res, f)
  return os.path.join(root, suite)


def _compare(*dirs):
  return subprocess.run([sys.executable, "-m", "experiments.compare", *dirs], cwd=helpers.ROOT,
                        capture_output=True, text=True, timeout=120)


def test_flags_active_mismatch_across_suites(tmp_path):
  a = _result(str(tmp_path), "s1", "x", active=100.0, val=2.5)
  b = _result(str(tmp_path), "s2", "y", active=150.0, val=2.1)
  proc = _compare(a, b)
  assert proc.returncode == 0, proc.stderr
  assert "| s1/x |" in proc.stdout and "| s2/y |" in proc.stdout
  assert "BUDGET MISMATCH" in proc.stdout
  assert "active/token differs by 33.3% (s1/x 100 .. s2/y 150)" in proc.stdout


def test_equal_budgets_are_not_flagged_and_optimizer_is(tmp_path):
  a = _result(str(tmp_path), "s1", "x", active=100.0)
  b = _result(str(tmp_path), "s1", "y", active=101.0)  # 1% < 2% tolerance
  rows = summary.aggregate(summary.find_results(a))
  assert summary.budget_mismatches(rows) == []
  proc = _compare(a)
  assert "budgets match" in proc.stdout
  c = _result(str(tmp_path), "s3", "z", active=100.0, optimizer="adamw lr=0.01 steps=10")
  rows = summary.aggregate(summary.find_results(a) + summary.find_results(c))
  assert any("optimizer settings differ" in line for line in summary.budget_mismatches(rows))


def test_no_results_is_an_error(tmp_path):
  proc = _compare(str(tmp_path))
  assert proc.returncode == 1 and "no result.json" in proc.stderr


def test_compare_reads_a_real_suite(tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  proc = _compare(workdir)
  assert proc.returncode == 0, proc.stderr
  assert "| tiny/aux |" in proc.stdout and "budgets match" in proc.stdout
