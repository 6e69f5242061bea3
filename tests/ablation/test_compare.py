"""experiments.compare: side-by-side table, intervals, budget and corpus mismatches flagged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import pytest

from moejax.ablation import summary, tables
from tests.ablation import helpers

OPT = "adamw lr=0.003 steps=10"
CORPUS = {"dataset": "python_stdlib", "config": "py3.11.7", "version": "1.0.0",
          "python_version": "3.11.7", "tokenizer": "bytes", "content_sha256": "a" * 64,
          "id": "python_stdlib/py3.11.7:1.0.0 bytes sha256:aaaaaaaaaaaa"}


def _result(root, suite, arm, active, optimizer=OPT, val=2.0, seed=None, corpus=None):
  path = os.path.join(root, suite, arm, *([f"seed_{seed}"] if seed is not None else []))
  os.makedirs(path)
  res = {"suite": suite, "arm": arm, "seed": seed or 0, "run": arm, "val_loss": val,
         "budget": {"total": 1000, "active": active, "active_max": active,
                    "flops_per_token": 2 * active, "tokens": 640, "optimizer": optimizer}}
  if corpus:
    res["corpus"] = corpus
  with open(os.path.join(path, "result.json"), "w") as f:
    json.dump(res, f)
  return os.path.join(root, suite)


def _compare(*args):
  return subprocess.run([sys.executable, "-m", "experiments.compare", *args], cwd=helpers.ROOT,
                        capture_output=True, text=True, timeout=120)


def test_flags_active_mismatch_across_suites(tmp_path):
  a = _result(str(tmp_path), "s1", "x", active=100.0, val=2.5)
  b = _result(str(tmp_path), "s2", "y", active=150.0, val=2.1)
  proc = _compare(a, b)
  assert proc.returncode == 0, proc.stderr
  assert "\ns1/x: 1 seed; 1.00K params, 100 active, 200 FLOPs/token, 640 tokens\n" in proc.stdout
  assert "\ns2/y: 1 seed; 1.00K params, 150 active, 300 FLOPs/token, 640 tokens\n" in proc.stdout
  markdown = _compare(a, b, "--markdown").stdout  # the tables of summary.md
  assert "| s1/x |" in markdown and "| s2/y |" in markdown and "s1/x: 1 seed" not in markdown
  assert "active/token differs by 33.3% (s1/x 100 .. s2/y 150)" in markdown
  assert "BUDGET MISMATCH" in proc.stdout
  assert "active/token differs by 33.3% (s1/x 100 .. s2/y 150)" in proc.stdout


def test_equal_budgets_are_not_flagged_and_optimizer_is(tmp_path):
  a = _result(str(tmp_path), "s1", "x", active=100.0)
  _result(str(tmp_path), "s1", "y", active=101.0)  # 1% < 2% tolerance
  assert summary.budget_mismatches(summary.summarise_results(summary.find_results(a))) == []
  proc = _compare(a)
  assert "budgets match" in proc.stdout
  c = _result(str(tmp_path), "s3", "z", active=100.0, optimizer="adamw lr=0.01 steps=10")
  summ = summary.summarise_results(summary.find_results(a) + summary.find_results(c),
                                   label=lambda r: f"{r['suite']}/{r['arm']}")
  assert any("optimizer settings differ" in line for line in summary.budget_mismatches(summ))


@pytest.mark.parametrize("fixed,flagged", [({"tokens": 0.0}, False),
                                           ({"tokens": 0.0, "optimizer": 0.0}, True)])
def test_a_suite_that_studies_the_optimizer_is_not_flagged_for_it(tmp_path, fixed, flagged):
  root = _result(str(tmp_path), "s", "adamw", active=100.0)
  _result(str(tmp_path), "s", "muon", active=100.0, optimizer="muon() lr=0.003 steps=10")
  with open(os.path.join(root, "suite.json"), "w") as f:
    json.dump({"name": "s", "arm_order": ["adamw", "muon"], "fixed": fixed}, f)
  flags = summary.suite_summary(root)["budget_flags"]
  assert any("optimizer settings differ" in line for line in flags) == flagged


def test_no_results_is_an_error(tmp_path):
  proc = _compare(str(tmp_path))
  assert proc.returncode == 1 and "no result.json" in proc.stderr


@pytest.mark.slow  # two tiny suites (~9 s); the flags themselves: the tests above
def test_corpus_mismatch_is_flagged(tmp_path):
  other = dict(CORPUS, python_version="3.12.1", config="py3.12.1", content_sha256="b" * 64,
               id="python_stdlib/py3.12.1:1.0.0 bytes sha256:bbbbbbbbbbbb")
  a = _result(str(tmp_path), "s1", "x", active=100.0, corpus=CORPUS)
  b = _result(str(tmp_path), "s2", "x", active=100.0, corpus=other)
  proc = _compare(a, b)
  assert "CORPUS MISMATCH" in proc.stdout
  assert "corpora differ (config, python_version, content_sha256)" in proc.stdout
  same = _result(str(tmp_path), "s3", "x", active=100.0, corpus=CORPUS)
  assert "CORPUS MISMATCH" not in _compare(a, same).stdout


@pytest.mark.slow  # two tiny suites (~9 s)
def test_different_seed_counts_compare_and_say_so(tmp_path):
  a = _result(str(tmp_path), "one", "x", active=100.0, val=2.0)          # one seed
  for seed, val in ((0, 2.10), (1, 2.12), (2, 2.08)):
    b = _result(str(tmp_path), "three", "y", active=100.0, val=val, seed=seed)
  proc = _compare(a, b, "--baseline=three/y")
  assert proc.returncode == 0, proc.stderr
  assert "seed counts differ (three/y: 3, one/x: 1)" in proc.stdout
  # One seed against three: the difference is unpaired, and one seed gives no interval.
  assert ("\n  val loss  2             Δ -0.1  seeds n/a (1, unpaired)  docs n/a  unresolved\n"
          in proc.stdout)
  assert "\nthree/y (baseline): 3 seeds; " in proc.stdout
  assert _compare(a, "--baseline=nope/z").returncode == 1


def test_compare_reads_a_real_suite(tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  proc = _compare(workdir)
  assert proc.returncode == 0, proc.stderr
  assert "\ntiny/aux (baseline): 2 seeds; " in proc.stdout and "budgets match" in proc.stdout
  bias = proc.stdout[proc.stdout.index("\ntiny/bias: 2 seeds; "):]
  assert re.search(r"\n  val loss +\S+ ± \S+ +Δ ", bias)  # the suite's own baseline was found
  assert "CORPUS MISMATCH" not in proc.stdout


def test_compare_fits_100_columns_and_markdown_keeps_the_tables():
  """The committed quick suite (results/runs/quick): every printed line fits 100 columns;
  --markdown prints the markdown tables of moejax.ablation.tables unchanged."""
  quick = os.path.join(helpers.ROOT, "results", "runs", "quick")
  proc = _compare(quick)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert max(len(line) for line in lines) <= 100, max(lines, key=len)
  assert ("quick/aux_loss (baseline): 1 seed; 3.48M params, 697.47K active, 1.65M FLOPs/token, "
          "512.00K tokens") in lines
  assert "  val loss             1.856    Δ -0.002926  seeds n/a (1)  docs n/a  unresolved" in lines
  assert "      why unresolved: no interval over seeds (1 seed)" in lines
  assert lines[-1].startswith("budgets match within 2%")
  markdown = _compare(quick, "--markdown")
  summ = summary.summarise_results(summary.find_results(quick),
                                   label=lambda r: f"{r['suite']}/{r['arm']}",
                                   baseline="quick/aux_loss", order=["quick/aux_loss"])
  for table in (tables.budget_table(summ), tables.arms_table(summ),
                tables.comparison_table(summ)):
    assert table + "\n\n" in markdown.stdout
