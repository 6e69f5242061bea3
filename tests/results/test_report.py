"""RESULTS.md is generated: the committed file and its images are what results/*.json generate,
and the report command writes only what it is told to."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from moejax.ablation import summary
from moejax.results import images, report
from tests.ablation import helpers


def test_committed_results_md_is_what_results_json_generate():
  with open(os.path.join(helpers.ROOT, "RESULTS.md"), encoding="utf-8") as f:
    text = f.read()
  summaries = report.load_summaries(os.path.join(helpers.ROOT, "results"))
  fix = "Fix: python -m experiments.report --out RESULTS.md --results_dir results"
  assert report.render(text, summaries) == text, (
      "RESULTS.md differs from what results/*.json generate: a number was edited by hand, or a "
      f"summary changed without regenerating. {fix}")
  ids = report.block_ids(text)
  plots_dir = os.path.join(helpers.ROOT, "results", images.PLOTS_DIR)
  bad = [p for sid in ids if sid in summaries for p in images.problems(sid, summaries[sid],
                                                                       plots_dir)]
  assert not bad, f"RESULTS.md embeds images that are missing or stale: {bad}. {fix}"
  for sid in summaries:  # every image link of a block is to an image that exists
    for plot, _, _ in images.expected(sid, summaries[sid]):
      assert f"(results/plots/{sid}/{plot.name}.png)" in text
  assert "overview" in ids and len(ids) == len(set(ids))
  for sid in summaries:  # every committed summary is shown somewhere
    assert sid in ids, f"results/{sid}.json has no block in RESULTS.md"
  for sid in report.summary_ids(ids):
    if sid not in summaries:
      assert report.PENDING.format(id=sid) in text  # says "pending re-run", shows no number


def _report(*args, cwd):
  return subprocess.run([sys.executable, "-m", "experiments.report", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=helpers.ROOT))


TEMPLATE = """# Results

Hand-written prose stays. The bias arm's validation loss is
<!-- moejax:value tiny bias val_loss -->9.99<!-- /moejax:value --> nats
(<!-- moejax:value tiny bias val_loss diff -->+1<!-- /moejax:value --> vs aux,
<!-- moejax:value tiny bias val_loss verdict -->better<!-- /moejax:value -->; MDD
<!-- moejax:value tiny - val_loss mdd -->0<!-- /moejax:value -->).

<!-- moejax:generated overview -->
<!-- moejax:end overview -->

## tiny

<!-- moejax:generated tiny -->
stale numbers 1.234
<!-- moejax:end tiny -->

## later

<!-- moejax:generated later -->
<!-- moejax:end later -->
"""


def test_report_command_regenerates_tables_and_values(tiny_suite_dir, tmp_path):
  workdir, _, _ = tiny_suite_dir
  out, results = tmp_path / "RESULTS.md", tmp_path / "results"
  out.write_text(TEMPLATE)
  results.mkdir()
  dirs = (f"--summaries={results}",)
  proc = _report(f"tiny={workdir}", f"--out={out}", *dirs, f"--results_dir={results}",
                 cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  text = out.read_text()
  summ = json.loads((results / "tiny.json").read_text())
  assert summ == json.loads(json.dumps(summary.suite_summary(workdir)))
  assert "Hand-written prose stays." in text and "stale numbers" not in text
  assert "| aux (baseline) | 2 |" in text and "| bias | val loss |" in text
  assert "- command: " in text and "- corpus: `python_stdlib/py" in text and "jax " in text
  mean = summ["arms"]["bias"]["metrics"]["val_loss"]["interval"]["mean"]
  comp = summ["comparisons"]["bias"]["val_loss"]
  assert f"-->{mean:.4g}<!--" in text and f"-->{comp['diff']['mean']:+.4g}<!--" in text
  assert f"-->{comp['verdict']}<!--" in text
  assert report.PENDING.format(id="later") in text  # no summary yet: pending, no numbers
  assert "| tiny | 2 | aux |" in text and "| later | | | pending re-run |" in text
  # The block embeds the summary's three images, drawn into results/plots/tiny/.
  for name in ("differences", "curves", "load"):
    assert f"(results/plots/tiny/{name}.png)" in text
  assert sorted(os.listdir(results / "plots" / "tiny")) == ["curves.png", "differences.png",
                                                            "load.png"]
  assert "predates curve data" not in text
  # Regenerating changes nothing, and --check agrees; a hand edit is caught and undone.
  assert _report(f"--out={out}", *dirs, "--check", cwd=tmp_path).returncode == 0
  out.write_text(text.replace("| aux (baseline) | 2 |", "| aux (baseline) | 3 |"))
  proc = _report(f"--out={out}", *dirs, "--check", cwd=tmp_path)
  assert proc.returncode == 1 and "blocks: tiny" in proc.stderr
  assert _report(f"--out={out}", *dirs, f"--results_dir={results}", cwd=tmp_path).returncode == 0
  assert out.read_text() == text
  # An image of other data (here: the curves in place of the load map) is caught, and the
  # next regeneration redraws it (a missing one: tests/ablation/test_plots.py).
  load = results / "plots" / "tiny" / "load.png"
  shutil.copy(results / "plots" / "tiny" / "curves.png", load)
  proc = _report(f"--out={out}", *dirs, "--check", cwd=tmp_path)
  assert proc.returncode == 1 and f"{load}: stale" in proc.stderr
  proc = _report(f"--out={out}", *dirs, f"--results_dir={results}", cwd=tmp_path)
  assert f"tiny: drew {load}" in proc.stdout
  assert images.problems("tiny", summ, str(results / "plots")) == []


def _tree(root) -> dict[str, str]:
  """{relative path: sha256} of every file under ``root``."""
  out = {}
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return out


def test_a_report_without_results_dir_writes_only_its_out(tiny_suite_dir, tmp_path):
  """``quick=DIR --out elsewhere`` once rewrote the committed results/quick.json."""
  workdir, _, _ = tiny_suite_dir
  committed = os.path.join(helpers.ROOT, "results")
  before = _tree(committed)
  proc = _report(f"quick={workdir}", f"--out={tmp_path / 'preview.md'}", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert _tree(committed) == before
  assert os.listdir(tmp_path) == ["preview.md"]
  text = (tmp_path / "preview.md").read_text()
  assert "| aux (baseline) | 2 |" in text  # the new summary, rendered from memory
  assert "*Plots: not drawn by this report run (it had no `--results_dir`).*" in text


def test_a_new_summary_gets_a_section(tiny_suite_dir, tmp_path):
  workdir, _, _ = tiny_suite_dir
  out = tmp_path / "R.md"
  out.write_text("# Results\n")
  (tmp_path / "none").mkdir()
  proc = _report(f"tiny@s={workdir}", f"--out={out}", f"--summaries={tmp_path / 'none'}",
                 f"--results_dir={tmp_path / 'r'}", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  # Said once it is true: after the write (an --out that failed once printed it anyway).
  assert proc.stdout.index(f"wrote {out}") < proc.stdout.index(
      f"tiny@s: new section appended to {out}")
  text = out.read_text()
  assert "## tiny@s: test suite" in text and "<!-- moejax:generated tiny@s -->" in text
  assert "| bias | val loss |" in text


def test_bad_value_markers_are_errors_naming_them():
  summ = {"arms": {"a": {"metrics": {}}}, "comparisons": {}, "mdd": {}}
  with pytest.raises(report.ReportError, match="no arm 'b'"):
    report.render("<!-- moejax:value s b val_loss -->x<!-- /moejax:value -->", {"s": summ})
  with pytest.raises(report.ReportError, match="has no metric 'val_loss'"):
    report.render("<!-- moejax:value s a val_loss -->x<!-- /moejax:value -->", {"s": summ})
  with pytest.raises(report.ReportError, match="field 'median'"):
    report.render("<!-- moejax:value s a val_loss median -->x<!-- /moejax:value -->",
                  {"s": summ})
  with pytest.raises(report.ReportError, match="ID ARM METRIC"):
    report.render("<!-- moejax:value s -->x<!-- /moejax:value -->", {"s": summ})
  # A value stays on one line: an unclosed marker cannot swallow the prose after it.
  text = "<!-- moejax:value s a val_loss -->x\nprose<!-- /moejax:value -->"
  assert report.render(text, {"s": summ}) == text
  # n: the seeds with a value; 0 for an arm without a metric that another arm has (never
  # reached a speed-up's reference), an error for a metric no arm has (a typo).
  reach = {"arms": {"a": {"metrics": {"speedup_steps": {"interval": {"n": 2}}}},
                    "b": {"metrics": {}}}, "comparisons": {}, "mdd": {}}
  assert report.value(reach, "a", "speedup_steps", "n") == "2"
  assert report.value(reach, "b", "speedup_steps", "n") == "0"
  with pytest.raises(report.ReportError, match="has no metric 'speedup_step'"):
    report.value(reach, "b", "speedup_step", "n")
  # A summary that is not there yet: pending, not an error.
  assert report.render("<!-- moejax:value t a val_loss -->x<!-- /moejax:value -->", {}) == (
      "<!-- moejax:value t a val_loss -->(pending)<!-- /moejax:value -->")
