"""A result block says whether the code that computes numbers has changed since its runs."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from moejax.ablation import freshness, summary as summary_lib
from moejax.results import report

FILES = {"moejax/routing/topk.py": b"def route(): return 1\n",
         "moejax/layer.py": b"LAYER = 1\n",
         "moejax/ablation/tables.py": b"# renders tables\n",
         "moejax/serve/quantize.py": b"# serving\n",
         "configs/ablations/quick.py": b"STEPS = 250\n",
         "experiments/ablate.py": b"# binary\n",
         "moejax/routing/README.md": b"not python\n"}


def test_scope_and_parts():
  assert freshness.in_scope("moejax/routing/topk.py") and freshness.in_scope("configs/tiny.py")
  assert freshness.in_scope("experiments/ablate.py")
  for out in ("moejax/ablation/tables.py", "moejax/serve/quantize.py", "experiments/train.py",
              "moejax/train/metrics_log.py",
              "moejax/routing/README.md", "tests/test_layer.py"):
    assert not freshness.in_scope(out), out
  assert freshness.part("moejax/routing/topk.py") == "moejax/routing"
  assert freshness.part("moejax/layer.py") == "moejax/layer.py"
  assert freshness.part("configs/ablations/quick.py") == "configs"
  fp = freshness.fingerprint(FILES)
  assert set(fp["parts"]) == {"moejax/routing", "moejax/layer.py", "configs",
                              "experiments/ablate.py"}


def test_only_code_in_scope_moves_the_fingerprint():
  base = freshness.fingerprint(FILES)
  presented = freshness.fingerprint({**FILES, "moejax/ablation/tables.py": b"# new look\n",
                                     "moejax/serve/quantize.py": b"# faster\n"})
  assert presented == base
  moved = freshness.fingerprint({**FILES, "moejax/routing/topk.py": b"def route(): return 2\n"})
  assert moved["fingerprint"] != base["fingerprint"]
  assert freshness.changed_parts([base], moved) == ["moejax/routing"]
  assert freshness.changed_parts([base], base) == []
  added = freshness.fingerprint({**FILES, "moejax/balance/new_rule.py": b"X = 1\n"})
  assert freshness.changed_parts([base], added) == ["moejax/balance"]
  # A suite resumed across commits: every recorded fingerprint must be the current one.
  assert freshness.changed_parts([base, moved], moved) == ["moejax/routing"]
  assert freshness.changed_parts([], base) is None and freshness.changed_parts([base], None) is None


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_fingerprint_at_a_commit_equals_the_files_of_that_commit(tmp_path):
  def git(*args):
    subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
  git("init", "-q")
  for path, content in FILES.items():
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_bytes(content)
  git("add", "-A")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
  first = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True,
                         capture_output=True, text=True).stdout.strip()
  (tmp_path / "moejax/layer.py").write_bytes(b"LAYER = 2\n")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
  assert freshness.at_commit(first, str(tmp_path)) == freshness.fingerprint(FILES)
  assert freshness.current(str(tmp_path)) == freshness.fingerprint(
      {**FILES, "moejax/layer.py": b"LAYER = 2\n"})
  summ = {"provenance": {"commits": [first[:12]]}}
  assert freshness.backfill(summ, str(tmp_path))
  assert summ["provenance"]["code"] == [freshness.fingerprint(FILES)]
  # A recorded fingerprint is kept unless asked to rehash (after the scope rule changed).
  old_rule = {"provenance": {"commits": [first[:12]], "code": [{"fingerprint": "x"}]}}
  assert not freshness.backfill(old_rule, str(tmp_path))
  assert freshness.backfill(old_rule, str(tmp_path), rehash=True)
  assert old_rule["provenance"]["code"] == [freshness.fingerprint(FILES)]
  assert not freshness.backfill({"provenance": {"commits": [first[:12] + "+dirty"]}},
                                str(tmp_path))  # an uncommitted tree cannot be recovered


def _summary(code):
  return {"suite": "s", "baseline": "a", "seed_counts": {"a": 1},
          "arms": {"a": {"arm": "a", "budget": {}, "metrics": {}}}, "comparisons": {},
          "mdd": {}, "provenance": {"code": code}}


def test_blocks_and_overview_say_current_stale_or_unverified(monkeypatch):
  # The tables themselves are tested in test_report; here only the freshness line.
  monkeypatch.setattr(report.tables, "section_markdown", lambda summary: "TABLES\n")
  old = freshness.fingerprint(FILES)
  new = freshness.fingerprint({**FILES, "moejax/routing/topk.py": b"def route(): return 2\n"})
  text = ("<!-- moejax:generated overview -->\n<!-- moejax:end overview -->\n"
          "<!-- moejax:generated s -->\n<!-- moejax:end s -->\n")
  same = report.render(text, {"s": _summary([old])}, code=old)
  assert f"- code: current (fingerprint `{old['fingerprint']}`" in same
  assert "| s | 1 | a |" in same and "stale" not in same
  stale = report.render(text, {"s": _summary([old])}, code=new)
  assert "- **stale**: code that computes numbers has changed since these runs " \
         "(moejax/routing)" in stale
  assert "| s (stale) | 1 | a |" in stale
  unknown = report.render(text, {"s": _summary([])}, code=new)
  assert "- **unverified**" in unknown and "| s (unverified) |" in unknown
  # The committed-file check fails when code moves under a block: render differs.
  assert report.render(same, {"s": _summary([old])}, code=new) != same


def test_a_suite_records_the_code_it_ran(tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  summ = summary_lib.suite_summary(workdir)
  assert summ["provenance"]["code"] == [freshness.current()]
  assert report.stale_parts(json.loads(json.dumps(summ))) == []
