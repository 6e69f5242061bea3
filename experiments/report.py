r"""Regenerates the tables and plots of RESULTS.md from ablation result directories.

    python -m experiments.report [ID=]RESULT_DIR ... --out RESULTS.md --results_dir results
    python -m experiments.report --out RESULTS.md --check     # CI: are tables and plots current?
    python -m experiments.report ID=RESULT_DIR --out /tmp/preview.md   # writes /tmp/preview.md only
    python -m experiments.report --notebooks    # re-execute notebooks/*.ipynb with outputs

What it reads and writes:

- ``--summaries`` (default: ``results/`` of this repository) is read only:
  the committed summary JSONs ``ID.json`` that every block is rendered from;
- each RESULT_DIR (a suite directory written by ``experiments.ablate``) gives
  a new summary (arms with 95% intervals over seeds, differences to the
  baseline with verdicts, the minimal detectable difference, provenance,
  corpus fingerprint, and per arm the downsampled training curves and the
  final layer x expert load; moejax.ablation.summary) under ID (the suite's
  name unless given as ``ID=DIR``, e.g. ``lossfree@m=/tmp/abl/lossfree_m``),
  which replaces that summary of ``--summaries`` for this run;
- ``--out`` is the Markdown file written: every generated block and inline
  value regenerated (moejax.results.report), the hand-written prose kept; a
  new summary without a block gets a new section at the end;
- ``--results_dir`` (default: none) is where the new summaries are written
  (``RESULTS_DIR/ID.json``) and the images of every summary
  (``RESULTS_DIR/plots/ID/*.png``, redrawn only where missing or stale;
  moejax.results.images), and the blocks link those images. Without it
  nothing but ``--out`` is written: the new summaries are rendered from
  memory, their blocks say that no plots were drawn, and the other blocks
  link the images under ``--summaries``.

The regeneration of the committed file is therefore
``--out RESULTS.md --results_dir results`` (``--summaries`` defaults to the
same folder). ``--check``: write nothing; exit 1 naming the blocks that differ
when ``--out`` is not what ``--summaries`` generate, or the embedded images
that are missing or stale (their data hash is not that of the summary).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from experiments import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OUT = flags.DEFINE_string("out", "RESULTS.md", "The Markdown file to regenerate (without "
                           "--results_dir the only file written).")
_SUMMARIES = flags.DEFINE_string("summaries", os.path.join(ROOT, "results"),
                                 "Read only: the committed per-suite summary JSONs that the "
                                 "blocks are rendered from.")
_RESULTS = flags.DEFINE_string("results_dir", None, "Where to write the summaries of the "
                               "RESULT_DIR arguments (ID.json) and every summary's plots "
                               "(plots/ID/*.png). Default: none (nothing but --out is written).")
_CHECK = flags.DEFINE_bool("check", False, "Only check that --out and its images are current; "
                           "write nothing.")
_EFFECTS = flags.DEFINE_bool("effects", False, "With --results_dir: re-read every summary's "
                             "effect sizes from its suite file (configs/ablations/NAME.py, "
                             "suite.effects) and annotate its comparisons (bounded / seeds "
                             "needed; moejax.ablation.power) from the committed intervals.")
_NOTEBOOKS = flags.DEFINE_bool("notebooks", False, "Re-execute notebooks/*.ipynb in place "
                               "from the committed results (commit them with their outputs).")


def _fail(msg: str):
  print(f"error: {msg}", file=sys.stderr)
  sys.exit(1)


def _new_summaries(args) -> tuple[dict, dict]:
  """({id: summary}, {id: re-check record}) of the RESULT_DIR arguments."""
  from moejax.ablation import summary  # pylint: disable=g-import-not-at-top
  from moejax.results import recheck  # pylint: disable=g-import-not-at-top
  pending, records = {}, {}
  for arg in args:
    sid, _, path = arg.rpartition("=") if "=" in arg else ("", "", arg)
    if not os.path.isdir(path):
      raise app.UsageError(f"{path}: not a directory (a suite directory of experiments.ablate)")
    try:
      summ = summary.suite_summary(path)
    except FileNotFoundError as e:
      _fail(str(e))
    # As results/ID.json will hold it (sorted keys: the MDD line lists metrics in that order),
    # so that rendering from memory equals rendering from the written file.
    sid = sid or summ["suite"]
    pending[sid] = json.loads(json.dumps(summ, sort_keys=True))
    record = recheck.make_record(sid, path, pending[sid])
    if record is None:
      print(f"{sid}: {path} has no first steps of its runs (a suite run before re-check "
            "records): no record; its block keeps the file rule", file=sys.stderr)
    else:
      records[sid] = json.loads(json.dumps(record, sort_keys=True))
  return pending, records


def _annotate(summ: dict) -> bool:
  """Annotates ``summ`` with its suite file's effects; whether it has any."""
  from moejax.ablation import power, suite as suite_lib  # pylint: disable=g-import-not-at-top
  path = os.path.join(ROOT, "configs", "ablations", f"{summ.get('suite')}.py")
  if not os.path.exists(path):
    return False
  effects = suite_lib.suite_effects(suite_lib.load_suite_file(path))
  if not effects:
    return False
  power.annotate(summ, effects)
  return True


def _notebooks() -> None:
  from moejax.results import notebooks  # pylint: disable=g-import-not-at-top
  for path in notebooks.refresh(ROOT):
    print(f"executed {os.path.relpath(path, ROOT)} (commit it with its outputs)")


def main(argv):
  from moejax.ablation import summary  # pylint: disable=g-import-not-at-top
  from moejax.results import claims, images, report  # pylint: disable=g-import-not-at-top
  if _NOTEBOOKS.value:
    return _notebooks()
  if _CHECK.value and (len(argv) > 1 or _RESULTS.value):
    raise app.UsageError("--check reads --summaries and their images only; pass no RESULT_DIR "
                         "and no --results_dir")
  if not os.path.isdir(_SUMMARIES.value):
    _fail(f"--summaries={_SUMMARIES.value}: not a directory (the committed results/ folder)")
  if not _CHECK.value:  # before the suites are read and anything is said
    cli.check_writable_file("--out", _OUT.value, "RESULTS.md")
    cli.check_writable("--results_dir", _RESULTS.value)
  from moejax.results import recheck  # pylint: disable=g-import-not-at-top
  pending, new_records = _new_summaries(argv[1:])
  from_dirs = set(pending)
  summaries = report.load_summaries(_SUMMARIES.value)
  summaries.update(pending)
  if _EFFECTS.value:
    if not _RESULTS.value:
      _fail("--effects rewrites the summaries: pass --results_dir (e.g. --results_dir results)")
    for sid in summaries:
      if _annotate(summaries[sid]):
        pending.setdefault(sid, summaries[sid])
  records = recheck.load_records(_SUMMARIES.value)
  for sid in from_dirs:  # a re-run replaces the block's record, or drops one it no longer has
    records.pop(sid, None)
  records.update(new_records)
  if os.path.exists(_OUT.value):
    with open(_OUT.value, encoding="utf-8") as f:
      text = f.read()
  elif _CHECK.value:
    _fail(f"{_OUT.value} does not exist")
  else:
    text = "# Results\n"
  appended = [sid for sid in pending if sid not in report.block_ids(text)]
  for sid in appended:
    text += report.new_section(sid, summaries[sid])
  images_dir = os.path.join(_RESULTS.value or _SUMMARIES.value, images.PLOTS_DIR)
  base = os.path.relpath(images_dir, os.path.dirname(os.path.abspath(_OUT.value)))
  shown = [sid for sid in report.block_ids(text) if sid in summaries]
  if _RESULTS.value:
    os.makedirs(_RESULTS.value, exist_ok=True)
    for sid, summ in pending.items():
      print(f"{sid}: {summary.write_json(summ, os.path.join(_RESULTS.value, sid + '.json'))}")
      if sid in new_records:
        path = recheck.record_path(_RESULTS.value, sid)
        print(f"{sid}: {recheck.write_record(new_records[sid], path)}")
    for sid in shown:
      for path in images.write(sid, summaries[sid], images_dir):
        print(f"{sid}: drew {path}")
    if claims.CLAIMS in report.block_ids(text):
      for path in images.write(claims.CLAIMS, claims.pseudo_summary(summaries), images_dir):
        print(f"{claims.CLAIMS}: drew {path}")
  try:
    new = report.render(text, summaries, base.replace(os.sep, "/"),
                        unplotted=() if _RESULTS.value else set(pending), records=records)
  except report.ReportError as e:
    _fail(f"{_OUT.value}: {e}")
  bad = [p for sid in shown if _RESULTS.value or sid not in pending
         for p in images.problems(sid, summaries[sid], images_dir)]
  if claims.CLAIMS in report.block_ids(text) and (_RESULTS.value or not pending):
    bad += images.problems(claims.CLAIMS, claims.pseudo_summary(summaries), images_dir)
  if _CHECK.value:
    return _check(text, new, bad)
  with open(cli.file_to_write(_OUT.value), "w", encoding="utf-8") as f:
    f.write(new)
  print(f"wrote {_OUT.value}: {len(summaries)} summaries, "
        f"{len(report.block_ids(new))} generated blocks")
  for sid in appended:  # said once it is true: after the write
    print(f"{sid}: new section appended to {_OUT.value}; move it and write its prose")
  for line in bad:  # a preview (no --results_dir) links the committed images as they are
    print(f"note: {_OUT.value} links an image that is {line.split(': ', 1)[1]}: "
          f"{line.split(': ', 1)[0]}", file=sys.stderr)


def _check(text: str, new: str, bad: list[str]) -> None:
  from moejax.results import report  # pylint: disable=g-import-not-at-top
  fix = (f"Fix: python -m experiments.report --out {_OUT.value} --results_dir "
         f"{_SUMMARIES.value}")
  if new != text:
    stale = [sid for sid in report.block_ids(text) if _block(text, sid) != _block(new, sid)]
    print(f"{_OUT.value} is not what {_SUMMARIES.value}/*.json generate"
          + (f" (blocks: {', '.join(stale)})" if stale else " (inline values)") + f". {fix}",
          file=sys.stderr)
    sys.exit(1)
  if bad:
    print(f"{_OUT.value} embeds images that are missing or stale:\n  " + "\n  ".join(bad) +
          f"\n{fix}", file=sys.stderr)
    sys.exit(1)
  print(f"{_OUT.value} is current ({len(report.block_ids(text))} generated blocks, their "
        "images included)")


def _block(text: str, sid: str) -> str:
  from moejax.results import report  # pylint: disable=g-import-not-at-top
  return next(m.group(0) for m in report.BLOCK.finditer(text) if m.group("id") == sid)


if __name__ == "__main__":
  cli.run(main)
