r"""Side-by-side table of ablation results with intervals, flagging budget and corpus mismatches.

    python -m experiments.compare /tmp/quick /tmp/lossfree/aux_1e-2 [--tolerance=0.02]
        [--baseline=lossfree/aux_1e-2]

Each argument is a suite directory, an arm directory or any directory above
several; every ``result.json`` under it is one run, and runs are grouped as
``<suite>/<arm>``: mean and 95% interval over that row's seeds. With a
baseline (``--baseline``, or the suite's own baseline when every row comes
from one suite) each row is compared with it: the difference, its interval
(paired over the seeds both rows ran; unpaired Welch when fewer than two are
common), the document bootstrap of the validation loss and the verdict
(moejax.ablation.stats). Directories with different seed counts compare; the
output says so and which pairing each difference used. The output fits 100
columns (moejax.ablation.terminal: a header line per row, a line per
metric); ``--markdown`` prints the markdown tables of summary.md instead.

Flagged: rows whose total params, active params/token, FLOPs/token or
training tokens differ by more than ``--tolerance`` (relative), or whose
optimizer settings differ (not an equal-budget comparison), and rows measured
on different corpora (another Python's standard library, another tokenizer:
moejax.data.fingerprint). Exit status 0 even when flagged (it is a report);
1 when no result is found.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from experiments import cli

_TOL = flags.DEFINE_float("tolerance", 0.02, "Relative budget difference that is flagged.")
_CSV = flags.DEFINE_string("csv", None, "Also write the table as CSV here.")
_MARKDOWN = flags.DEFINE_bool("markdown", False, "Print markdown tables (as summary.md and "
                              "RESULTS.md have them, lines of 150+ columns) instead of the "
                              "text that fits 100 columns.")
_BASELINE = flags.DEFINE_string("baseline", None, "Row (<suite>/<arm>) the others are compared "
                                "with; default: the suite's baseline when all rows are of one "
                                "suite.")


def _suite_baseline(results) -> str | None:
  """``<suite>/<baseline>`` when every run belongs to one suite whose suite.json names it."""
  suites = {r.get("suite", "?") for r in results}
  if len(suites) != 1:
    return None
  for r in results:
    path = r["_path"]
    for up in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
      candidate = os.path.join(up, "suite.json")
      if os.path.exists(candidate):
        with open(candidate, encoding="utf-8") as f:
          base = json.load(f).get("baseline")
        return f"{suites.pop()}/{base}" if base else None
  return None


def main(argv):
  dirs = argv[1:]
  if not dirs:
    raise app.UsageError("usage: python -m experiments.compare DIR [DIR ...]")
  cli.check_writable_file("--csv", _CSV.value, "compare.csv")  # before the tables, not after
  from moejax.ablation import summary, terminal  # pylint: disable=g-import-not-at-top
  results = []
  for d in dirs:
    found = summary.find_results(d)
    if not found:
      print(f"error: no result.json under {d} (run experiments.ablate first)", file=sys.stderr)
      sys.exit(1)
    results += found
  label = lambda r: f"{r.get('suite', '?')}/{r['arm']}"
  baseline = _BASELINE.value or _suite_baseline(results)
  labels = {label(r) for r in results}
  if baseline is not None and baseline not in labels:
    if _BASELINE.value:
      print(f"error: --baseline={baseline} is not a row; rows: {sorted(labels)}",
            file=sys.stderr)
      sys.exit(1)
    baseline = None
  summ = summary.summarise_results(results, label=label, baseline=baseline,
                                   order=[baseline] if baseline else [])
  summ["suite"] = "compare"
  summ["budget_flags"] = []  # printed below, with the tolerance of this command
  corpus_flags = summ["corpus"]["flags"]
  summ["corpus"] = dict(summ["corpus"], flags=[])  # printed below
  print(_markdown(summ) if _MARKDOWN.value else terminal.render(summ, whole=False))
  if _CSV.value:
    summary.write_csv(summ, cli.file_to_write(_CSV.value))
  if corpus_flags:
    print("CORPUS MISMATCH (not measured on the same data):")
    for line in corpus_flags:
      print("\n".join(terminal.flag_lines(line)))
  flags_ = summary.budget_mismatches(summ, _TOL.value)
  if flags_:
    print("BUDGET MISMATCH (not an equal-budget comparison):")
    for line in flags_:
      print("\n".join(terminal.flag_lines(line)))
  else:
    print(f"budgets match within {100 * _TOL.value:g}% (total, active, FLOPs/token, tokens, "
          "optimizer)")


def _markdown(summ) -> str:
  """The markdown tables (--markdown): budget, arms, comparisons, the MDD and the notes."""
  from moejax.ablation import tables  # pylint: disable=g-import-not-at-top
  parts = [tables.budget_table(summ), tables.arms_table(summ)]
  comp = tables.comparison_table(summ)
  if comp:
    parts += [comp, tables.mdd_line(summ)]
  notes = tables.notes(summ)
  return "\n\n".join(parts) + "\n" + ("\n" + "\n".join(notes) if notes else "")


if __name__ == "__main__":
  cli.run(main)
