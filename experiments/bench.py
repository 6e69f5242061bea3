r"""Benchmarks: ``python -m experiments.bench --suite=NAME`` runs one suite.

Usage:
  python -m experiments.bench --suite=layer --json_out=/tmp/layer.json
  python -m experiments.bench --suite=gmm --json_out=/tmp/gmm.json \
      --gmm_m=8192 --gmm_k=512 --gmm_n=384        # CPU-sized
  python -m experiments.bench --suite=ep --json_out=/tmp/ep.json
  python -m experiments.bench --suite=serving --json_out=/tmp/serving.json \
      --serving_plot=/tmp/serving.png
  python -m experiments.bench --suite=step --step_scale=m
  python -m experiments.bench --suite=step --step_twin
  python -m experiments.bench --suite=scaling --json_out=/tmp/scaling.json
  python -m experiments.bench --suite=profile --json_out=/tmp/profile.json
  python -m experiments.bench --suite=peak     # this machine's MFU peak, cached once

Each suite is one module of ``experiments/benchmarks/`` (its docstring says what
it times; its flags are its own, plus the shared ones of ``common.py``).

Every suite says what each variant did as it goes (``name: compiled and ran
in 0.31s``, ``FAILED: ...``, ``refused: ...``), then prints its table. A
variant that fails is a row saying so, and the binary then ends with one
``error:`` line naming the failed runs and exit status 1 (``--keep_going``:
status 0, and a note). absl's INFO lines and transformers' notices stay out of
the output (``-v`` shows them).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap

from absl import flags

from experiments import common_flags
from experiments import cli
from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry

SUITES = registry.load_all()  # every suite's flags are defined before argv is parsed

_SUITE = flags.DEFINE_enum(
    "suite", "layer", list(SUITES),
    "which benchmark: " + "; ".join(f"{s.name}: {s.summary}" for s in SUITES.values()))
_JSON = common_flags.json_out()
_KEEP_GOING = flags.DEFINE_bool("keep_going", False, "exit 0 even when a variant failed (its "
                                "row says so); without it a failure makes the exit status 1")


def run_suite(name: str) -> dict:
  """Runs suite ``name`` and prints its table; returns its results."""
  suite = registry.get(name)
  res = suite.run()
  suite.show(res)
  return res


def finish(res: dict, keep_going: bool) -> None:
  """Exit status 1 with one ``error:`` line naming the failed runs, unless ``keep_going``
  (then a note, status 0); nothing when every run ran."""
  failed = bench_lib.failures(res)
  if failed and not keep_going:
    cli.fail(f"{len(failed)} benchmark run(s) failed: {'; '.join(failed)[:600]}. Fix: see "
             "each one's row above, or pass --keep_going to exit 0 with them in the table")
  if failed:
    print(f"note: {len(failed)} benchmark run(s) failed (--keep_going: exit status 0)",
          file=sys.stderr)


def record_provenance() -> dict:
  """The command, commit, date and machine a benchmark record carries (docs/benchmarks.md's
  provenance blocks read them; experiments/record_blocks.py)."""
  from moejax.ablation import provenance  # pylint: disable=g-import-not-at-top
  prov = provenance.run_provenance()
  out = {key: prov[key] for key in ("command", "commit", "date", "machine")}
  # glibc's allocator settings change the timings (fresh large buffers fault
  # in page by page or by huge page) and are read at process start: the
  # command a reader reruns must carry them.
  tunables = os.environ.get("GLIBC_TUNABLES")
  if tunables:
    out["command"] = f"GLIBC_TUNABLES={shlex.quote(tunables)} {out['command']}"
  return out


def check_outputs(suite: registry.Suite) -> None:
  """One ``error:`` line, before anything runs, unless every path the run writes can be."""
  cli.check_writable_file("--json_out", _JSON.value)
  for flag, kind in suite.outputs:
    value = getattr(flags.FLAGS, flag)
    if kind == "dir":
      cli.check_writable(f"--{flag}", value)
    else:
      cli.check_writable_file(f"--{flag}", value, os.path.basename(value or "") or "out")


def main(argv):
  del argv
  check_outputs(registry.get(_SUITE.value))  # before the suite runs, not after
  bench_lib.PROGRESS[0] = sys.stdout  # a line per variant as it goes, before the table
  try:
    res = run_suite(_SUITE.value)
  except bench_lib.BenchFailed as e:
    cli.fail(f"{e}. Fix: see the error above; nothing was timed")
  print("\n" + textwrap.fill(f"conditions: {json.dumps(res['conditions'])}", width=100,
                             subsequent_indent="  "))
  if _JSON.value:
    res = {**record_provenance(), **res}
    with open(cli.file_to_write(_JSON.value), "w") as fh:
      json.dump(res, fh, indent=1)
    print(f"wrote {_JSON.value}")
  finish(res, _KEEP_GOING.value)


if __name__ == "__main__":
  # Transformers' notices (the torch peer's ExpertsInterface note) stay out of the table,
  # as absl's INFO lines and orbax / TFDS notes do (cli.run's quiet logs; -v shows them).
  if not any(a.startswith(("-v", "--verbosity")) for a in sys.argv[1:]):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
  cli.run(main)
