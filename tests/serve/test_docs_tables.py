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
