"""experiments.bench --suite=interop: every parity case's errors in one record, rendered as
docs/benchmarks.md's interop block."""

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from experiments import record_blocks  # noqa: E402
from moejax.interop import parity  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_interop_suite_records_every_case_within_float32_tolerance(tmp_path):
  out = tmp_path / "interop.json"
  r = subprocess.run([sys.executable, "-m", "experiments.bench", "--suite=interop",
                      "--interop_seeds=0", "--interop_tokens=1,9", f"--json_out={out}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
  rec = json.loads(out.read_text())
  assert list(rec["cases"]) == [c[0] for c in parity.CASES]
  for name, case in rec["cases"].items():
    assert case["blocks"] == 2 and case["same_experts"], name
    assert 0 <= case["max_rel"] <= 1e-5 and case["gate_error"] <= 1e-6, (name, case)
  text = record_blocks.KINDS["interop_bench"](rec)
  assert text.startswith("Seeds 0 x 1, 9 tokens per case, float32 on CPU, transformers ")
  assert f"| mixtral | mixtral | yes | {rec['cases']['mixtral']['gate_error']:.1e} | " in text


def test_a_case_whose_experts_differ_is_marked_and_a_failed_one_is_a_row():
  from experiments.benchmarks import interop  # pylint: disable=g-import-not-at-top
  rec = {"seeds": [0], "tokens": [9], "conditions": {"torch": "t", "transformers": "x"},
         "cases": {"a": {"family": "mixtral", "same_experts": False, "gate_error": None,
                         "max_abs": 0.5, "max_rel": 0.25},
                   "b": {"family": "qwen3_moe", "error": "ValueError: boom"}}}
  text = interop.markdown(rec)
  assert "| a | mixtral | **no** | - | 5.0e-01 | 2.5e-01 |" in text
  assert "| b | qwen3_moe | failed: ValueError: boom | | | |" in text
