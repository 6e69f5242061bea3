r"""Are the committed results still what the code computes? Re-trains each block's first steps.

    python -m experiments.recheck                 # every record in results/recheck/
    python -m experiments.recheck quick lossfree@m
    python -m experiments.recheck quick --nowrite # print only

For each block with a record (``results/recheck/ID.json``, written by
``experiments.report ID=DIR --results_dir results`` from a suite run), the
first steps of every arm's first seed are re-trained at the current code,
from the current configs (the suite command the record names), and
compared bit for bit with the record (moejax.results.recheck). One line
per block: ``current``, ``stale`` with the first arm, metric and step that
differ, or, on another machine kind, where the curves part (never
``stale`` there). The outcome is stored in the record (unless
``--nowrite``); ``python -m experiments.report --out RESULTS.md
--results_dir results`` then shows it in each block's first line.

On another machine kind, at a code where the block is current (its line
says so), the re-trained steps are stored as the record's **companion** for
this kind instead; later re-checks on this kind judge current / stale
against it (moejax.results.recheck).

Each block runs in its own process with the device count and XLA flags its
record names (suites trained on 8 simulated CPU devices are re-checked on 8,
the @avx2 blocks under ``--xla_cpu_max_isa=AVX2``). Exit status
1 when a block is stale or cannot be re-checked.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RESULTS = flags.DEFINE_string("results_dir", os.path.join(ROOT, "results"),
                               "The results folder whose recheck/ID.json records are checked.")
_WRITE = flags.DEFINE_bool("write", True, "Store each outcome in its record (the `check` "
                           "entry that RESULTS.md's block line reads).")
_ONE = flags.DEFINE_string("one", None, "Internal: re-check this block in this process and "
                           "print its outcome as JSON.")


def _fail(msg: str):
  print(f"error: {msg}", file=sys.stderr, flush=True)
  sys.exit(1)


def suite_from_command(command: str):
  """The suite an ``experiments.ablate`` command line trains, built from the current configs
  (its ``--config`` file and ``--config.*`` overrides; other flags do not change numbers)."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from moejax.ablation import suite as suite_lib  # pylint: disable=g-import-not-at-top
  args = shlex.split(command or "")
  if "experiments.ablate" not in args:
    raise ValueError(f"the record's command is not an experiments.ablate run: {command!r}")
  wanted = [a for a in args[args.index("experiments.ablate") + 1:] if a.startswith("--config")]
  fv = flags.FlagValues()
  # The override flags (--config.a.b) are defined from the argv given here.
  config_flags.DEFINE_config_file("config", None, "suite", flag_values=fv,
                                  sys_argv=["recheck", *wanted])
  cwd = os.getcwd()
  try:
    os.chdir(ROOT)  # the command's config path is relative to the repository
    fv(["recheck", *wanted])
    tree = fv.config
    hasattr(tree, "to_dict")
  finally:
    os.chdir(cwd)
  return suite_lib.suite_from_dict(tree)


def _check_one(sid: str) -> None:
  from moejax.results import recheck  # pylint: disable=g-import-not-at-top
  from moejax.ablation import freshness  # pylint: disable=g-import-not-at-top
  from moejax.data import fingerprint as fingerprint_lib  # pylint: disable=g-import-not-at-top
  record = recheck.load_records(_RESULTS.value)[sid]
  try:
    suite = suite_from_command(record.get("command"))
  except Exception as e:  # pylint: disable=broad-except
    outcome = recheck.Outcome("cannot", (f"cannot rebuild the suite: {e}",))
  else:
    corpus = fingerprint_lib.corpus_fingerprint(suite.arms[0].experiment.data)["id"]
    outcome = recheck.recheck(record, suite, corpus_id=corpus)
  print("RECHECK " + json.dumps({"outcome": outcome.as_dict(), "values": outcome.values,
                                 "code": (freshness.current() or {}).get("fingerprint"),
                                 "environment": recheck.environment(),
                                 "line": outcome.line(sid, record["steps"])}), flush=True)


def child_env(record: dict, base: dict) -> dict:
  """The environment a block's re-check process runs in: ``base`` with the record's device
  count and XLA flags (the @avx2 blocks ran under ``--xla_cpu_max_isa=AVX2``; the same
  code under other flags is another machine kind)."""
  env = dict(base)
  kind = record.get("environment", {}).get("kind", {})
  if kind.get("platform") == "cpu" and kind.get("devices", 1) > 1:
    env["JAX_NUM_CPU_DEVICES"] = str(kind["devices"])
  if "xla_flags" in kind:
    env["XLA_FLAGS"] = kind["xla_flags"]
  return env


def _spawn(sid: str, record: dict) -> dict:
  env = child_env(record, os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  proc = subprocess.run([sys.executable, "-m", "experiments.recheck", f"--one={sid}",
                         f"--results_dir={_RESULTS.value}"], env=env, cwd=ROOT,
                        capture_output=True, text=True, check=False)
  for line in proc.stdout.splitlines():
    if line.startswith("RECHECK "):
      return json.loads(line[len("RECHECK "):])
  tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
  return {"outcome": {"verdict": "cannot", "reasons": [f"the re-check process failed: {tail}"],
                      "machine": [], "first": None, "largest": 0.0},
          "code": None, "line": f"{sid}: cannot re-check: the process failed: {tail}"}


def main(argv):
  from moejax.results import recheck  # pylint: disable=g-import-not-at-top
  if _ONE.value:
    return _check_one(_ONE.value)
  records = recheck.load_records(_RESULTS.value)
  wanted = argv[1:] or sorted(records)
  missing = [s for s in wanted if s not in records]
  if missing:
    _fail(f"no re-check record for {', '.join(missing)} in {_RESULTS.value}/"
          f"{recheck.RECORD_DIR}/ (records: {', '.join(sorted(records)) or 'none'}). Fix: run the "
          "suite, then python -m experiments.report ID=SUITE_DIR --results_dir results")
  from moejax.ablation import freshness  # pylint: disable=g-import-not-at-top
  code_now = freshness.current()
  bad = 0
  for sid in wanted:
    t0 = time.perf_counter()
    got = _spawn(sid, records[sid])
    print(f"{got['line']} [{time.perf_counter() - t0:.0f}s]", flush=True)
    out = got["outcome"]
    bad += out["verdict"] in ("stale", "cannot")
    if not _WRITE.value or out["verdict"] == "cannot" or not got["code"]:
      continue
    record, made = recheck.store_outcome(records[sid], got, code_now)
    if made:
      print(f"  {sid}: companion record made for this machine kind at code `{got['code']}` "
            "(the block is current at this code); later re-checks on this kind judge "
            "against it", flush=True)
    recheck.write_record(record, recheck.record_path(_RESULTS.value, sid))
  if bad:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
