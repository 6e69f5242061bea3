r"""Regenerates the tables of RESULTS.md from ablation result directories.

    python -m experiments.report [ID=]RESULT_DIR ... --out RESULTS.md [--results_dir results]
    python -m experiments.report --out RESULTS.md --check     # CI: are the tables current?

For each RESULT_DIR (a suite directory written by ``experiments.ablate``):
its summary (arms with 95% intervals over seeds, differences to the baseline
with verdicts, the minimal detectable difference, provenance and corpus
fingerprint; moejax.ablation.summary) is written to ``RESULTS_DIR/ID.json``
(ID: the suite's name unless given as ``ID=DIR``, e.g.
``lossfree@m=/tmp/abl/lossfree_m``). Then every generated block and inline
value of ``--out`` is regenerated from all of ``RESULTS_DIR/*.json``
(moejax.ablation.report); the hand-written prose around them is kept. A
summary without a block in ``--out`` gets a new section at the end. Without
RESULT_DIR, only the regeneration runs (from the committed JSONs).

``--check``: write nothing; exit 1 and name the blocks that differ when
``--out`` is not what the JSONs generate.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

_OUT = flags.DEFINE_string("out", "RESULTS.md", "The Markdown file to regenerate.")
_RESULTS = flags.DEFINE_string("results_dir", "results", "Where the per-suite summary JSONs "
                               "live (committed with the repository).")
_CHECK = flags.DEFINE_bool("check", False, "Only check that --out is current; write nothing.")


def main(argv):
  from moejax.ablation import report, summary  # pylint: disable=g-import-not-at-top
  if _CHECK.value and len(argv) > 1:
    raise app.UsageError("--check regenerates from --results_dir only; pass no RESULT_DIR")
  pending = {}
  for arg in argv[1:]:
    sid, _, path = arg.rpartition("=") if "=" in arg else ("", "", arg)
    if not os.path.isdir(path):
      raise app.UsageError(f"{path}: not a directory (a suite directory of experiments.ablate)")
    try:
      summ = summary.suite_summary(path)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)
    pending[sid or summ["suite"]] = summ
  text = ""
  if os.path.exists(_OUT.value):
    with open(_OUT.value, encoding="utf-8") as f:
      text = f.read()
  elif _CHECK.value:
    print(f"error: {_OUT.value} does not exist", file=sys.stderr)
    sys.exit(1)
  else:
    text = "# Results\n"
  for sid, summ in pending.items():
    os.makedirs(_RESULTS.value, exist_ok=True)
    print(f"{sid}: {summary.write_json(summ, os.path.join(_RESULTS.value, sid + '.json'))}")
  summaries = report.load_summaries(_RESULTS.value)
  for sid in summaries:
    if sid not in report.block_ids(text) and sid in pending:
      text += report.new_section(sid, summaries[sid])
      print(f"{sid}: new section appended to {_OUT.value}; move it and write its prose")
  try:
    new = report.render(text, summaries)
  except report.ReportError as e:
    print(f"error: {_OUT.value}: {e}", file=sys.stderr)
    sys.exit(1)
  if _CHECK.value:
    stale = [sid for sid in report.block_ids(text) if _block(text, sid) != _block(new, sid)]
    if new != text:
      print(f"{_OUT.value} is not what {_RESULTS.value}/*.json generate"
            + (f" (blocks: {', '.join(stale)})" if stale else " (inline values)") +
            f". Fix: python -m experiments.report --out {_OUT.value}", file=sys.stderr)
      sys.exit(1)
    print(f"{_OUT.value} is current ({len(report.block_ids(text))} generated blocks)")
    return
  with open(_OUT.value, "w", encoding="utf-8") as f:
    f.write(new)
  print(f"wrote {_OUT.value}: {len(summaries)} summaries, "
        f"{len(report.block_ids(new))} generated blocks")


def _block(text: str, sid: str) -> str:
  from moejax.ablation import report  # pylint: disable=g-import-not-at-top
  return next(m.group(0) for m in report.BLOCK.finditer(text) if m.group("id") == sid)


if __name__ == "__main__":
  app.run(main)
