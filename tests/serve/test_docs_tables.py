"""The serving tables of the record (docs/benchmarks.md) and of RESULTS.md are
what the committed result JSONs render to.

The serving bench and the quantisation table are written to
results/serving/*.json by their commands; the record quotes the Markdown those
JSONs render to, so a table can only change by re-running the command.
(docs/serving.md, the guide, keeps the rounded findings only.)
"""

import json
import pathlib

from experiments import serving_tables
from experiments.benchmarks import serving as bench_serving

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
RESULTS = (ROOT / "RESULTS.md").read_text(encoding="utf-8")


def _load(name):
  return json.loads((ROOT / "results" / "serving" / name).read_text(encoding="utf-8"))


def test_serving_bench_tables_are_the_committed_json():
  assert bench_serving.markdown_tables(_load("serving_bench.json")) in DOC


def test_quantisation_tables_are_the_committed_json():
  res = _load("quantization.json")
  assert set(res) == {"moejax", "hf"}
  for part in res.values():
    assert serving_tables.quantization_table(part) in DOC
    assert serving_tables.quantization_table(part) in RESULTS


def test_the_memory_table_is_what_experiments_params_prints():
  """The record's memory table of the presets is computed, not measured: it must be what the
  command above it prints at this code."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  out = subprocess.run([sys.executable, "-m", "experiments.params", "--preset=all"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  table = out.stdout.rstrip("\n").split("\n\n")[-1]
  assert table.startswith("model ") and "GB = 1e9 bytes" in table
  assert table in DOC, ("docs/benchmarks.md: paste the table of `python -m experiments.params "
                        "--preset=all`")
