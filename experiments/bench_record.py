r"""Renders docs/benchmarks.md's record blocks from results/ (experiments/record_blocks.py).

Usage:
  python -m experiments.bench_record            # rewrites docs/benchmarks.md's blocks
  python -m experiments.bench_record --check    # exit 1 when a block differs from its record
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments.record_blocks import BLOCK, DOC, RecordError, render

_CHECK = flags.DEFINE_bool("check", False, "write nothing; exit 1 when a block is stale")
_DOC = flags.DEFINE_string("doc", DOC, "the record file whose blocks are rendered")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  with open(_DOC.value, encoding="utf-8") as fh:
    text = fh.read()
  try:
    new = render(text)
  except RecordError as e:
    sys.exit(f"error: {e}")
  if _CHECK.value:
    if new != text:
      sys.exit(f"error: {_DOC.value} differs from its records. Fix: python -m "
               "experiments.bench_record")
    print(f"{_DOC.value}: every block is its record")
    return
  with open(_DOC.value, "w", encoding="utf-8") as fh:
    fh.write(new)
  print(f"wrote {_DOC.value} ({len(BLOCK.findall(new))} blocks)")


if __name__ == "__main__":
  app.run(main)
