"""The machine-spread table (moejax.results.spread), on hand-made summaries."""

from __future__ import annotations

import pytest

from moejax.results import report, spread


def _metric(values):
  return {"values": {str(s): v for s, v in values.items()}}


def _summary(base_vals, arm_vals, diff_sd=None, diff_half=None, base_sd=None):
  """A suite with a baseline ``base`` and one arm ``a``: val loss per seed."""
  diff = {"mean": 0.0, "sd": diff_sd, "n": len(arm_vals)}
  if diff_half is not None:
    diff.update(lo=-diff_half, hi=diff_half)
  return {"baseline": "base", "seed_counts": {"base": len(base_vals), "a": len(arm_vals)},
          "arms": {"base": {"metrics": {"val_loss": {**_metric(base_vals), "interval": {
                       "mean": 2.0, "sd": base_sd, "lo": None, "hi": None}}}},
                   "a": {"metrics": {"val_loss": _metric(arm_vals)}}},
          "comparisons": {"a": {"val_loss": {"diff": diff, "verdict": "unresolved"}}}}


def test_rows_take_the_largest_change_of_a_seeds_paired_difference():
  # Seed 0: difference 0.5 here, 0.25 there (0.25 apart); seed 1: 0.5 here and there.
  # Seed 2 exists here only and does not count.
  here = _summary({0: 2.0, 1: 3.0, 2: 1.0}, {0: 2.5, 1: 3.5, 2: 9.0}, diff_sd=0.5,
                  diff_half=1.25, base_sd=0.1)
  there = _summary({0: 2.25, 1: 3.0}, {0: 2.5, 1: 3.5})
  got = {r["arm"]: r for r in spread.rows(here, there)}
  assert got["base"]["seeds"] == ["0", "1"] and got["base"]["machine"] == 0.25
  assert got["base"]["sd"] == 0.1 and got["base"]["half"] is None
  assert got["a"]["machine"] == 0.25 and got["a"]["sd"] == 0.5 and got["a"]["half"] == 1.25
  assert got["a"]["ratio"] == 0.5
  assert got["a"]["mean"] == 0.125 and got["base"]["mean"] == -0.125  # signed: here - there


def test_the_table_exact():
  here = _summary({0: 2.0, 1: 3.0}, {0: 2.5, 1: 3.5}, diff_sd=0.5, diff_half=1.25, base_sd=0.1)
  there = _summary({0: 2.0, 1: 3.0}, {0: 2.5, 1: 3.25})
  got = spread.spread_markdown("x@avx2", {"x": here, "x@avx2": there}, {"x": "CPU A"})
  assert got.splitlines() == [
      "Seeds 0, 1 ran on both machine kinds (`x` on CPU A). Per arm: the largest and the mean "
      "change of one seed's difference to `base` between the two kinds (`x` minus `x@avx2`), "
      "next to that difference's SD "
      "over 2 seeds of `x` and the half-width of its 95% interval (for `base`: its own value; "
      "moejax.results.spread).",
      "",
      "| arm | metric | machine: largest change | machine: mean change | seeds: SD "
      "| interval half-width | largest change / seed SD |",
      "|---|---|---:|---:|---:|---:|---:|",
      "| base | val loss | 0 | +0 | 0.1 | n/a | 0 |",
      "| a | val loss | 0.25 | +0.12 | 0.5 | 1.2 | 0.5 |",
      "",
      "Largest ratio of a difference: 0.5 (a, val loss)."]


def test_missing_summaries_and_no_shared_seed_say_so():
  here = _summary({0: 2.0}, {0: 2.5})
  there = _summary({5: 2.0}, {5: 2.5})
  assert "no summary x@avx2" in spread.spread_markdown("x@avx2", {"x": here})
  assert "share no seed" in spread.spread_markdown("x@avx2", {"x": here, "x@avx2": there})
  with pytest.raises(ValueError, match="name a variant"):
    spread.pair_ids("x")


def test_the_block_renders_in_a_report_and_is_not_an_overview_row():
  here = _summary({0: 2.0, 1: 3.0}, {0: 2.5, 1: 3.5}, diff_sd=0.5, diff_half=1.25)
  there = _summary({0: 2.0, 1: 3.0}, {0: 2.5, 1: 3.25})
  text = ("<!-- moejax:generated overview -->\n<!-- moejax:end overview -->\n"
          "<!-- moejax:generated spread.x@avx2 -->\nold\n<!-- moejax:end spread.x@avx2 -->\n")
  out = report.render(text, {"x": here, "x@avx2": there}, records={})
  assert "| a | val loss | 0.25 | +0.12 | 0.5 | 1.2 | 0.5 |" in out and "old" not in out
  assert "spread." not in out.split("<!-- moejax:end overview -->")[0]
