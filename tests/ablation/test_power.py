"""Resolve or bound: effect sizes, bounded verdicts, seeds for 80% power, --plan."""

from __future__ import annotations

import pytest

from moejax.ablation import power, stats, suite as suite_lib, tables
from moejax.config import ConfigError
from tests.ablation import helpers


def test_power_of_the_paired_t_interval_matches_the_textbook_value():
  # One-sample t test, two-sided 5%, standardised effect 1: n = 10 gives 80.3% power
  # (Cohen 1988; G*Power gives 0.8031).
  assert power.power(10, sd=1.0, effect=1.0) == pytest.approx(0.8031, abs=5e-4)
  assert power.seeds_needed(1.0, 1.0) == 10
  assert power.seeds_needed(0.5, 1.0) == 5   # half the spread: fewer seeds
  assert power.seeds_needed(None, 1.0) is None
  assert power.power(1, 1.0, 1.0) == 0.0 and power.power(4, 0.0, 1.0) == 1.0
  assert power.power(3, 1e-4, 1.0) == 1.0   # far in the tail, where scipy's nct gives nan


def _iv(lo, hi, sd=0.01, n=3):
  return stats.Interval((lo + hi) / 2, lo, hi, n, sd)


def test_bound_needs_every_interval_inside_the_effect():
  assert power.bound(0.05, _iv(-0.01, 0.03))
  assert not power.bound(0.05, _iv(-0.01, 0.06))
  assert not power.bound(0.05, _iv(-0.01, 0.03), _iv(-0.07, 0.0))   # documents too wide
  assert not power.bound(0.05, stats.Interval(0.0, None, None, 1))    # no interval: no bound


def _summary(diff, docs=None, verdict="unresolved"):
  entry = {"diff": diff.as_dict(), "pairing": "paired", "verdict": verdict}
  if docs is not None:
    entry["documents"] = docs.as_dict()
  return {"baseline": "b", "comparisons": {"a": {"val_loss": entry}}}


def test_annotate_says_bounded_or_the_seeds_that_would_resolve():
  s = power.annotate(_summary(_iv(-0.01, 0.03), _iv(-0.005, 0.004)),
                     {"val_loss": {"size": 0.05, "source": "x"}})
  e = s["comparisons"]["a"]["val_loss"]
  assert e["bounded"] and e["effect"] == 0.05
  assert power.verdict_text(e) == "no effect larger than 0.05"
  wide = power.annotate(_summary(_iv(-0.04, 0.08, sd=0.024)),
                        {"val_loss": {"size": 0.05, "source": "x"}})["comparisons"]["a"]["val_loss"]
  assert not wide["bounded"]
  assert wide["seeds_needed"] == power.seeds_needed(0.024, 0.05)
  assert power.verdict_text(wide) == f"unresolved ({wide['seeds_needed']} seeds resolve 0.05)"
  resolved = power.annotate(_summary(_iv(0.01, 0.03), verdict="worse"),
                            {"val_loss": {"size": 0.05, "source": "x"}})
  assert power.verdict_text(resolved["comparisons"]["a"]["val_loss"]) == "worse"
  table = tables.comparison_table(s)
  assert "**no effect larger than 0.05**" in table


def test_suite_effects_are_validated_with_the_field_and_a_fix():
  tree = helpers.tiny_suite(effects={"val_loss": {"size": 0.01, "source": "smallest that "
                                                  "matters"}})
  assert suite_lib.suite_from_dict(tree).effects == {
      "val_loss": {"size": 0.01, "source": "smallest that matters"}}
  for effects, field in (({"nope": {"size": 1, "source": "x"}}, "suite.effects.nope"),
                         ({"val_loss": {"size": 0, "source": "x"}}, "suite.effects.val_loss.size"),
                         ({"val_loss": {"size": 0.1}}, "suite.effects.val_loss.source")):
    with pytest.raises(ConfigError) as e:
      suite_lib.suite_from_dict(helpers.tiny_suite(effects=effects))
    assert e.value.field == field and "Fix" in str(e.value) or e.value.fix


def test_plan_rows_from_a_pilot_summary():
  suite = suite_lib.suite_from_dict(helpers.tiny_suite(effects={
      "val_loss": {"size": 0.05, "source": "x"}}))
  pilot = _summary(_iv(-0.04, 0.08, sd=0.024))
  pilot["arms"] = {"aux": {"run_seconds": 60.0, "metrics": {}},
                   "bias": {"run_seconds": 80.0, "metrics": {}}}
  rows, (seconds, counts) = power.plan(suite, pilot)
  assert rows == [{"arm": "a", "metric": "val_loss", "effect": 0.05, "sd": 0.024,
                   "pilot_seeds": 3, "needed": power.seeds_needed(0.024, 0.05),
                   "power_now": power.power(2, 0.024, 0.05)}]
  assert seconds == 70.0 and "wall time" in counts
  text = power.plan_table(suite, rows, (seconds, counts))
  assert f"{rows[0]['needed']} seeds resolve every effect with 80% power" in text


def test_report_effects_annotates_committed_summaries_from_their_suite_files(tmp_path):
  import json, shutil, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  shutil.copy(f"{helpers.ROOT}/results/lossfree.json", tmp_path / "lossfree.json")
  out = tmp_path / "R.md"
  out.write_text("# R\n<!-- moejax:generated lossfree -->\n<!-- moejax:end lossfree -->\n")
  proc = subprocess.run([sys.executable, "-m", "experiments.report", f"--out={out}",
                         f"--summaries={tmp_path}", f"--results_dir={tmp_path}", "--effects"],
                        cwd=helpers.ROOT, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  summ = json.loads((tmp_path / "lossfree.json").read_text())
  assert summ["effects"]["val_loss"]["size"] == 0.0063
  entry = summ["comparisons"]["lossfree_u1e-2"]["max_vio_global"]
  # Bounded or not follows the committed interval (a re-run moves it), the rule does not.
  inside = -0.68 <= entry["diff"]["lo"] and entry["diff"]["hi"] <= 0.68
  assert entry["effect"] == 0.68 and entry["bounded"] is inside
  row = next(line for line in out.read_text().splitlines()
             if line.startswith("| lossfree_u1e-2 | MaxVio global |"))
  assert ("**no effect larger than 0.68**" in row) is inside
