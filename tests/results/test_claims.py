"""The claims block: every tested claim, our difference beside its size, at each rung."""

from __future__ import annotations

from moejax.results import claims, images, report


def _summary(diff, lo, hi, verdict="unresolved", **extra):
  entry = {"diff": {"mean": diff, "lo": lo, "hi": hi, "n": 3, "sd": 0.01},
           "pairing": "paired", "verdict": verdict, **extra}
  return {"suite": "x", "baseline": "b", "arms": {}, "comparisons": {"a": {"val_loss": entry}},
          "effects": {"val_loss": {"size": 0.05, "source": "Paper, Table 1"}}}


def test_rows_and_table_per_rung_with_verdicts_and_sources():
  s = _summary(0.01, -0.02, 0.04, effect=0.05, bounded=True, seeds_needed=3)
  m = _summary(0.09, 0.06, 0.12, verdict="worse", effect=0.05, bounded=False, seeds_needed=2)
  no_effects = {"suite": "y", "baseline": "b", "arms": {}, "comparisons": {"a": {}}}
  summaries = {"x": s, "x@m": m, "y": no_effects}
  got = claims.rows(summaries)
  assert [(r["id"], r["rung"], r["verdict"]) for r in got] == [
      ("x", "s", "no effect larger than 0.05"), ("x@m", "m", "worse")]
  text = claims.markdown(summaries, {"x": "current", "x@m": "stale"})
  assert "| x: a vs b | val loss | 0.05 | +0.01 [-0.02, +0.04] no effect > 0.05 | " \
         "+0.09 [+0.06, +0.12] **worse** |" in text
  assert "**Not current**" in text and "x@m (stale)" in text
  assert "- x, val loss: Paper, Table 1" in text
  assert "No claims yet" in claims.markdown({"y": no_effects})


def test_an_unresolved_claim_says_what_its_seeds_would_cost():
  s = _summary(0.01, -0.05, 0.07, effect=0.05, bounded=False, seeds_needed=5)
  s["arms"] = {"a": {"run_seconds": 50.0}, "b": {"run_seconds": 70.0}, "c": {}}
  # 5 seeds x 3 arms x 60 s = 15 min, at the mean measured run time.
  text = claims.markdown({"x": s})
  assert "+0.01 [-0.05, +0.07] unresolved, 5 seeds would do (~15 min) |" in text
  s["comparisons"]["a"]["val_loss"]["seeds_needed"] = 300
  assert "300 seeds would do (~15 h)" in claims.markdown({"x": s})
  s["arms"] = {"a": {}}  # no measured run time: no cost
  assert "unresolved, 300 seeds would do |" in claims.markdown({"x": s})
  s["comparisons"]["a"]["val_loss"]["seeds_needed"] = 3  # as many as it has (n = 3)
  assert ("+0.01 [-0.05, +0.07] unresolved at 3 seeds, which had 80% power for the tested "
          "size |") in claims.markdown({"x": s})


def test_report_renders_the_block_and_its_stamped_figure(tmp_path):
  s = _summary(0.01, -0.02, 0.04, effect=0.05, bounded=True, seeds_needed=3)
  text = "# R\n<!-- moejax:generated claims -->\n<!-- moejax:end claims -->\n"
  out = report.render(text, {"x": s}, plots_base="plots", code=None, records={})
  assert "no effect > 0.05" in out and "![claims at a glance](plots/claims/claims.png)" in out
  pseudo = claims.pseudo_summary({"x": s})
  assert images.problems(claims.CLAIMS, pseudo, str(tmp_path)) == [
      f"{tmp_path}/claims/claims.png: missing"]
  assert images.write(claims.CLAIMS, pseudo, str(tmp_path)) == [
      f"{tmp_path}/claims/claims.png"]
  assert images.problems(claims.CLAIMS, pseudo, str(tmp_path)) == []
  assert images.problems("x", s, str(tmp_path)) == [f"{tmp_path}/x/differences.png: missing"]
