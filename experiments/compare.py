r"""Side-by-side table of ablation results, flagging budget mismatches.

    python -m experiments.compare /tmp/quick /tmp/lossfree/aux_1e-2 [--tolerance=0.02]

Each argument is a suite directory, an arm directory or any directory above
several; every ``result.json`` under it is one run, and runs are grouped as
``<suite>/<arm>`` (mean over seeds). Rows whose total params, active
params/token, FLOPs/token or training tokens differ by more than
``--tolerance`` (relative), or whose optimizer settings differ, are flagged:
their quality numbers are not an equal-budget comparison. Exit status 0 even
when flagged (it is a report); 1 when no result is found.
"""

from __future__ import annotations

import sys

from absl import app, flags

_TOL = flags.DEFINE_float("tolerance", 0.02, "Relative budget difference that is flagged.")
_CSV = flags.DEFINE_string("csv", None, "Also write the table as CSV here.")


def main(argv):
  dirs = argv[1:]
  if not dirs:
    raise app.UsageError("usage: python -m experiments.compare DIR [DIR ...]")
  from moejax.ablation import summary  # pylint: disable=g-import-not-at-top
  results = []
  for d in dirs:
    found = summary.find_results(d)
    if not found:
      print(f"error: no result.json under {d} (run experiments.ablate first)", file=sys.stderr)
      sys.exit(1)
    results += found
  rows = summary.aggregate(results, label=lambda r: f"{r.get('suite', '?')}/{r['arm']}")
  print(summary.markdown(rows))
  if _CSV.value:
    summary.write_csv(rows, _CSV.value)
  flags_ = summary.budget_mismatches(rows, _TOL.value)
  if flags_:
    print("BUDGET MISMATCH (not an equal-budget comparison):")
    for line in flags_:
      print(f"  ! {line}")
  else:
    print(f"budgets match within {100 * _TOL.value:g}% (total, active, FLOPs/token, tokens, "
          "optimizer)")


if __name__ == "__main__":
  app.run(main)
