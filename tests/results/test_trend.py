"""The s -> m trend table (moejax.results.trend), on hand-made summaries."""

from __future__ import annotations

import pytest

from moejax.results import report, trend


def _comp(mean, lo, hi, verdict, n=3):
  return {"diff": {"mean": mean, "lo": lo, "hi": hi, "n": n}, "verdict": verdict}


def _summary(scale, comps, base_loss):
  return {"scale": scale, "baseline": "base",
          "arms": {"base": {"metrics": {"val_loss": {"interval": {"mean": base_loss}}}}},
          "comparisons": comps, "mdd": {"val_loss": {"value": 0.01, "seeds": 3}}}


def test_movement_words():
  better, worse = _comp(-0.1, -0.2, -0.05, "better"), _comp(0.1, 0.05, 0.2, "worse")
  null_neg, null_pos = _comp(-0.01, -0.1, 0.1, "unresolved"), _comp(0.01, -0.1, 0.1, "unresolved")
  assert trend.movement(better, better) == "holds"
  assert trend.movement(better, worse) == "reverses"
  assert trend.movement(null_neg, better) == "emerges"
  assert trend.movement(worse, null_pos) == "fades"
  assert trend.movement(null_neg, null_neg) == "unresolved, same sign"
  assert trend.movement(null_neg, null_pos) == "unresolved, sign flips"


def test_trend_table_exact():
  s = _summary("s", {"a": {"val_loss": _comp(-0.02, -0.03, -0.01, "better")}}, 2.5)
  m = _summary("m", {"a": {"val_loss": _comp(0.004, -0.01, 0.018, "unresolved")},
                     "new": {"val_loss": _comp(0.1, 0.05, 0.2, "worse")}}, 2.0)
  got = trend.trend_markdown("x", {"x": s, "x@m": m, "other": m})
  assert got.splitlines()[2:] == [
      "| arm | metric | s: Δ vs base | m: Δ vs base | trend |",
      "|---|---|---|---|---|",
      "| base (level) | val loss | 2.5 | 2 | |",
      "| a | val loss | -0.02 [-0.03, -0.01] (3) **better** | "
      "+0.004 [-0.01, +0.018] (3) unresolved | fades |",
      "",
      "Minimal detectable val-loss difference: s 0.01 (3 seeds), m 0.01 (3 seeds).",
      "Arms not at every rung (left out): new."]


def test_trend_block_renders_and_says_when_a_rung_is_missing():
  s = _summary("s", {"a": {"val_loss": _comp(-0.02, -0.03, -0.01, "better")}}, 2.5)
  m = _summary("m", {"a": {"val_loss": _comp(-0.03, -0.05, -0.01, "better")}}, 2.0)
  text = ("<!-- moejax:generated overview -->\n<!-- moejax:end overview -->\n"
          "<!-- moejax:generated trend.x -->\nold\n<!-- moejax:end trend.x -->\n")
  out = report.render(text, {"x": s, "x@m": m})
  assert "| a | val loss | -0.02 [-0.03, -0.01] (3) **better** |" in out and "| holds |" in out
  assert "trend.x" not in out.split("<!-- moejax:end overview -->")[0]  # not a suite row
  pending = report.render(text, {"x": s})
  assert "No trend yet: x has no summary at scale m" in pending and "x@m=DIR" in pending


def test_a_summary_at_the_wrong_rung_is_an_error():
  s = _summary("s", {}, 2.5)
  with pytest.raises(report.ReportError, match="'x@m' holds a run at scale 's'"):
    report.render("<!-- moejax:generated trend.x -->\n<!-- moejax:end trend.x -->\n",
                  {"x": s, "x@m": s})


def _speedup_summary(scale, reached, comp):
  """``reached``: {arm: speed-up values of the seeds that reached the reference loss}."""
  arms = {"base": {"metrics": {"val_loss": {"interval": {"mean": 2.0}},
                               "speedup_steps": {"interval": {"mean": 1.0, "lo": 1.0, "hi": 1.0,
                                                              "n": 3}}}}}
  for arm, vals in reached.items():
    if vals:
      lo, hi = (None, None) if len(vals) == 1 else (min(vals) - 0.1, max(vals) + 0.1)
      arms[arm] = {"metrics": {"speedup_steps": {"interval": {
          "mean": sum(vals) / len(vals), "lo": lo, "hi": hi, "n": len(vals)}}}}
    else:
      arms[arm] = {"metrics": {}, "notes": {"speedup_note": "never reached 2.0 (best 2.1)"}}
  comps = {a: {"val_loss": _comp(0.01, -0.1, 0.1, "unresolved")} for a in reached}
  for arm, c in comp.items():
    comps[arm]["speedup_steps"] = c
  return {"scale": scale, "baseline": "base", "arms": arms, "comparisons": comps,
          "seed_counts": {a: 3 for a in arms}, "mdd": {}}


def test_speedup_rows_say_how_many_seeds_reached_the_reference():
  s = _speedup_summary("s", {"a": [], "b": [1.2]}, {"b": _comp(0.2, None, None, "unresolved", 1)})
  m = _speedup_summary("m", {"a": [1.5, 2.0, 2.5], "b": [1.3, 1.4]},
                       {"a": _comp(1.0, 0.4, 1.6, "better"),
                        "b": _comp(0.35, -0.3, 1.0, "unresolved", 2)})
  rows = trend.trend_markdown("x", {"x": s, "x@m": m}).splitlines()
  assert ("| a | speed-up, steps | never reached (0/3 seeds) | 2x [1.4, 2.6] (3/3 seeds reached) "
          "**better** | reached by 0/3 -> 3/3 seeds |") in rows
  assert ("| b | speed-up, steps | 1.2x (1/3 seeds reached) unresolved | 1.35x [1.2, 1.5] "
          "(2/3 seeds reached) unresolved | unresolved, same sign |") in rows
  # Without a speed-up analysis there is no such row.
  plain = _summary("s", {"a": {"val_loss": _comp(-0.02, -0.03, -0.01, "better")}}, 2.5)
  plain_m = _summary("m", {"a": {"val_loss": _comp(-0.02, -0.03, -0.01, "better")}}, 2.0)
  assert "speed-up" not in trend.trend_markdown("x", {"x": plain, "x@m": plain_m})
