"""experiments.bench --suite=train (experiments/benchmarks/train.py): cost and reached losses
of training runs, and the record block docs/benchmarks.md renders from them."""

import json
import math
import os
import pathlib
import subprocess
import sys

from experiments import record_blocks
from experiments.benchmarks import train as train_bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ("--config.train.steps=2,--config.train.warmup_steps=1,--config.train.log_every=1,"
        "--config.train.eval_every=0,--config.train.eval_batches=1,"
        "--config.train.checkpoint_every=2,--config.data.stdlib_max_files=12,"
        "--config.data.stdlib_val_fraction=0.3,--config.data.batch_size=2,"
        "--config.data.seq_len=16,--config.model.d_model=32,--config.model.n_layers=1")


def test_a_run_records_its_cost_and_its_losses_and_a_failed_one_is_a_row(tmp_path):
  out = tmp_path / "train.json"
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--suite=train",
       "--train_configs=default,configs/no_such_config.py", f"--train_args={TINY}",
       "--repeats=1", f"--json_out={out}"], cwd=ROOT, capture_output=True, text=True,
      timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
  assert r.stderr.startswith("error: 1 benchmark run(s) failed: runs/configs/no_such_config.py: "
                             "exit status "), r.stderr
  rec = json.loads(out.read_text())
  run = rec["runs"]["default"]
  assert run["exit"] == 0 and run["steps"] == 2 and run["vocab"] == 256
  assert run["wall_s"] > 0 and run["user_s"] > 0 and run["peak_rss_mb"] > 100
  assert run["workdir_mb"] > 0 and math.isfinite(run["val_loss"])
  assert run["val_loss_per_byte"] == run["val_loss"] and run["bytes_per_token"] == 1.0
  # The accounting's parameter count is the one the trainer printed on its first line.
  assert run["excerpt"][0].startswith(
      f"DIR: new run, {run['params'] / 1e6:.2f}M params, 2 steps of 2x16 tokens"), run["excerpt"]
  assert run["excerpt"][-1].startswith("done: step 2 | train loss ")
  assert rec["checksums"]["config"] == "default" and rec["checksums"]["arrays"] > 0
  assert "error" in rec["runs"]["configs/no_such_config.py"]
  assert "| `configs/no_such_config.py` | failed: exit status" in r.stdout
  assert f"| `default` | 256 | {run['params'] / 1e6:.2f}M | 2 | " in r.stdout


def test_the_record_block_renders_the_table_the_excerpt_and_the_checksums():
  rec = {"args": [], "conditions": {"load_avg_1_5_15": [1.0, 1.0, 1.0]},
         "conditions_after": {"load_avg_1_5_15": [1.5, 1.0, 1.0]},
         "runs": {"default": {"vocab": 256, "params": 3.48e6, "steps": 600, "wall_s": 229.4,
                              "user_s": 190.6, "sys_s": 9.0, "peak_rss_mb": 1412.0,
                              "workdir_mb": 74.6, "train_loss": 1.30725, "val_loss": 1.51384,
                              "val_loss_per_byte": 1.51384, "bytes_per_token": 1.0,
                              "max_vio_global": 0.2457, "specialisation_mi": 0.0412,
                              "unigram_baseline": 3.2089, "excerpt": ["DIR: new run", "...",
                                                                      "done: step 600"]}},
         "checksums": {"config": "default", "arrays": 141, "mib": 39.9, "median_s": 0.026,
                       "repeats": 5}}
  text = record_blocks.KINDS["train_runs"](rec)
  assert text == train_bench.markdown(rec)
  assert ("| `default` | 256 | 3.48M | 600 | 3m49s | 200 s | 1.41 GB | 75 MB | 1.3073 | 1.5138 "
          "| 1.5138 | 1.00 | 0.246 | 0.041 | 3.209 |") in text
  assert "load average 1.0 -> 1.5." in text
  assert "```\nDIR: new run\n...\ndone: step 600\n```" in text
  assert ("Checkpoint checksums of `default`'s training state (141 arrays, 39.9 MiB): 26 ms "
          "(median of 5)") in text


def test_the_tests_suite_runs_pytest_with_an_empty_home_and_records_its_counts(tmp_path):
  probe = tmp_path / "test_probe.py"
  probe.write_text("import os\n\ndef test_home_is_fresh():\n  assert os.path.basename("
                   "os.environ['HOME']).startswith('moejax_tests_home_')\n"
                   "\ndef test_skipped():\n  import pytest; pytest.skip('no')\n")
  out = tmp_path / "tests.json"
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--suite=tests",
       f"--tests_args=-q -n 0 -p no:cacheprovider {probe}", f"--json_out={out}"], cwd=ROOT,
      capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
  rec = json.loads(out.read_text())
  assert rec["counts"] == {"passed": 1, "skipped": 1} and rec["exit"] == 0
  assert rec["summary"].startswith("1 passed, 1 skipped in ")
  assert rec["peak_rss_mb"] > 10 and rec["wall_s"] > 0
  assert rec["command"].startswith("python -m experiments.bench --suite=tests"), rec["command"]
  assert record_blocks.KINDS["tests_run"](rec).startswith(
      f"`python -m pytest -q -n 0 -p no:cacheprovider {probe}` with an empty HOME: 1 passed, "
      "1 skipped in ")


def test_a_failing_test_run_is_an_error_with_pytests_summary():
  from experiments.benchmarks import tests as tests_run  # pylint: disable=g-import-not-at-top
  line = tests_run.summary_line(["x", "FAILED tests/a.py::t",
                                 "1 failed, 3 passed, 1 error in 2.5s"])
  assert line == "1 failed, 3 passed, 1 error in 2.5s"
  assert tests_run.counts(line) == {"failed": 1, "passed": 3, "error": 1}
  assert tests_run.summary_line(["no tests ran"]) == ""


def test_wall_times_round_to_whole_seconds_without_a_60th_second():
  assert train_bench.min_s(119.6) == "2m00s"
  assert train_bench.min_s(137.2) == "2m17s" and train_bench.min_s(4.4) == "0m04s"
