"""moejax.ablation.terminal: a suite summary as text of at most 100 columns, its numbers the
markdown tables' strings."""

from __future__ import annotations

import glob
import json
import os

import pytest

from moejax.ablation import tables, terminal
from tests.ablation import helpers


def _iv(mean, lo=None, hi=None, n=3, sd=None):
  return {"mean": mean, "lo": lo, "hi": hi, "n": n, "sd": sd}


def _arm(val, vio, seeds=(0, 1, 2), **budget):
  b = dict(total=1.0e6, active=1.0e5, flops_per_token=2.2e5, tokens=3.0e5,
           optimizer="adamw lr=0.003 steps=300", **budget)
  return {"seeds": list(seeds), "budget": b,
          "metrics": {"val_loss": {"interval": val}, "max_vio_global": {"interval": vio}},
          "notes": {}}


def _summary():
  """Two arms, three seeds: an unresolved validation loss (seed and document intervals, the
  reason) and a resolved MaxVio."""
  reason = ("the seed interval includes 0; the document interval includes 0; and a reason "
            "long enough to need a second line of its own under the first one")
  return {
      "suite": "hand", "description": "A hand-made summary.", "baseline": "aux",
      "arms": {"aux": _arm(_iv(2.1, 2.075, 2.125), _iv(0.41, 0.03, 0.79)),
               "bias_with_a_long_name": _arm(_iv(2.08, 2.055, 2.105), _iv(0.15, 0.067, 0.233))},
      "comparisons": {"bias_with_a_long_name": {
          "val_loss": {"diff": _iv(-0.02, -0.045, 0.005), "documents": _iv(-0.02, -0.03, -0.01),
                       "pairing": "paired", "verdict": "unresolved", "reason": reason},
          "max_vio_global": {"diff": _iv(-0.26, -0.41, -0.11), "pairing": "paired",
                             "verdict": "better", "reason": ""}}},
      "mdd": {"val_loss": {"value": 0.025, "seeds": 3},
              "max_vio_global": {"value": 0.15, "seeds": 3}},
      "seed_counts": {"aux": 3, "bias_with_a_long_name": 3},
      "corpus": {"ids": ["python_stdlib/py3.11.7:1.0.0 bytes sha256:aaaaaaaaaaaa"], "flags": []},
      "provenance": {"commands": ["python -m experiments.ablate --config=configs/ablations/"
                                  "lossfree.py --workdir=/tmp/a/very/long/work/directory"],
                     "commits": ["0123456789ab"], "dates": ["2026-01-01 00:00 UTC"]},
  }


def test_a_summary_renders_in_100_columns_with_its_key_lines():
  lines = terminal.render(_summary()).splitlines()
  assert max(len(line) for line in lines) <= terminal.WIDTH == 100
  assert lines[:2] == ["suite hand", "A hand-made summary."]
  i = lines.index("aux (baseline): 3 seeds; 1.00M params, 100.00K active, 220.00K FLOPs/token, "
                  "300.00K tokens")
  assert lines[i + 1:i + 3] == ["  val loss       2.100 ± 0.025", "  MaxVio global  0.41 ± 0.38"]
  assert lines[i + 3:i + 13] == [
      "bias_with_a_long_name: 3 seeds; 1.00M params, 100.00K active, 220.00K FLOPs/token, "
      "300.00K tokens",
      "  val loss       2.080 ± 0.025  Δ -0.020  seeds [-0.045, +0.005] (3)  "
      "docs [-0.030, -0.010]",
      "                                unresolved",
      "      why unresolved: the seed interval includes 0; the document interval includes 0; "
      "and a reason",
      "        long enough to need a second line of its own under the first one",
      "  MaxVio global  0.150 ± 0.083  Δ -0.26  seeds [-0.41, -0.11] (3)  better",
      "",
      "Minimal detectable difference at 3 seed(s) (half-width of the pooled paired 95% "
      "interval; smaller",
      "    true differences stay unresolved): val loss 0.025, MaxVio global 0.15.",
      ""]
  assert lines[i + 13:] == ["notes:", "- optimizer: adamw lr=0.003 steps=300"]
  # The long command wraps under its provenance line.
  assert "- command: `python -m experiments.ablate --config=configs/ablations/lossfree.py" in lines


def test_the_numbers_are_the_markdown_tables_strings():
  summ = _summary()
  md, text = tables.suite_markdown(summ), terminal.render(summ)
  row = next(r for r in md.splitlines() if r.startswith("| bias_with_a_long_name | val loss |"))
  for cell in row.split(" | ")[2:5]:  # the difference and its two intervals
    assert cell.split(" (")[0] in text, cell
  assert "| 2.080 ± 0.025 |" in md and "  2.080 ± 0.025  " in text


def test_a_verdict_that_does_not_fit_continues_under_the_difference():
  lines = terminal.pack("  name  1 ± 0", ["Δ " + "1" * 40, "seeds " + "2" * 40, "x" * 120],
                        indent=14, width=60)
  assert lines[0] == "  name  1 ± 0  Δ " + "1" * 40
  assert lines[1] == " " * 14 + "seeds " + "2" * 40
  assert all(len(line) <= 60 and line.startswith(" " * 14) for line in lines[1:])
  assert "".join(line.strip() for line in lines[2:]) == "x" * 120


def test_an_arm_compared_with_another_arm_says_which():
  summ = _summary()
  for entry in summ["comparisons"]["bias_with_a_long_name"].values():
    entry["baseline"] = "other"
  header = terminal.arm_header(summ, "bias_with_a_long_name")
  assert header[0].startswith("bias_with_a_long_name (Δ vs other): 3 seeds; 1.00M params")
  assert all(len(h) <= 100 for h in header)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(helpers.ROOT, "results",
                                                               "*.json"))),
                         ids=os.path.basename)
def test_every_committed_summary_fits_100_columns(path):
  with open(path, encoding="utf-8") as f:
    summ = json.load(f)
  if "arms" not in summ:
    pytest.skip("not a suite summary")
  lines = terminal.render(summ).splitlines()
  assert max(len(line) for line in lines) <= 100
  for name in summ["arms"]:
    assert any(line.startswith(f"{name}") and " seed" in line for line in lines), name
  text = terminal.render(summ)
  interval = tables._interval  # pylint: disable=protected-access
  for name, comp in (summ.get("comparisons") or {}).items():
    for key, entry in comp.items():
      assert interval(entry["diff"]) in text, (name, key)
