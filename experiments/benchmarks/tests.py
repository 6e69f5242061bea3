r"""The default test run (``--suite=tests``): how long the README's test command takes, and
its memory.

Usage:
  python -m experiments.bench --suite=tests --json_out=results/bench/tests.json

Runs the README's second command, ``python -m pytest -q -m "not slow" -p
no:cacheprovider`` (``--tests_args`` replaces the pytest arguments), in the
repository with an empty temporary HOME, as CI does, and records its exit
status, pytest's summary line (passed, skipped, failed), wall time, user
and system CPU seconds and peak RSS (``os.wait4`` on the pytest process: the
largest single process of the run, e.g. one pytest-xdist worker, as
``/usr/bin/time -v`` reports it).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile

from absl import flags

from experiments.benchmarks import registry
from experiments.benchmarks import train as train_bench

README_ARGS = ("-q", "-m", "not slow", "-p", "no:cacheprovider")
_ARGS = flags.DEFINE_string("tests_args", None, "--suite=tests: pytest's arguments instead of "
                            "the README's " + shlex.join(README_ARGS))
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def summary_line(lines: list[str]) -> str:
  """pytest's last line that counts results ("2451 passed, 4 skipped in 494.12s"), or ''."""
  for line in reversed(lines):
    if _COUNT.search(line) and " in " in line:
      return line.strip("= ")
  return ""


def counts(line: str) -> dict[str, int]:
  return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
          for n, kind in _COUNT.findall(line)}


def run() -> dict:
  args = shlex.split(_ARGS.value) if _ARGS.value is not None else list(README_ARGS)
  home = tempfile.mkdtemp(prefix="moejax_tests_home_")  # empty, as on a fresh machine
  logs = tempfile.mkdtemp(prefix="moejax_tests_log_")  # not in HOME, which stays empty
  log = os.path.join(logs, "pytest.log")
  try:
    usage = train_bench.timed_process([sys.executable, "-m", "pytest", *args], log,
                                      env={**os.environ, "HOME": home})
    with open(log, encoding="utf-8", errors="replace") as f:
      lines = [line.rstrip("\n") for line in f if line.strip()]
  finally:
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
  line = summary_line(lines)
  # Not "command": the record's own key is the bench command that made it.
  out = {"pytest_command": shlex.join(["python", "-m", "pytest", *args]), **usage,
         "summary": line, "counts": counts(line),
         "conditions": {"cpu_count": os.cpu_count(), "load_avg_1_5_15": list(os.getloadavg())}}
  if usage["exit"] != 0:
    out["error"] = f"pytest exit status {usage['exit']}: {line or ' | '.join(lines[-2:])}"
  return out


def markdown(res: dict) -> str:
  if "error" in res and not res.get("summary"):
    return f"`{res['pytest_command']}`: failed: {res['error'][:200]}\n"
  return (f"`{res['pytest_command']}` with an empty HOME: {res['summary'] or 'no summary line'}; "
          f"{train_bench.min_s(res['wall_s'])} wall, {res['user_s'] + res['sys_s']:.0f} s of "
          f"CPU (user + sys) on {res['conditions']['cpu_count']} cores, "
          f"**{res['peak_rss_mb'] / 1e3:.1f} GB peak RSS** (the largest single process).\n")


def show(res: dict) -> None:
  print(markdown(res))


SUITE = registry.register(registry.Suite(
    "tests", "the README's test command: its wall time, CPU time and peak RSS", run, show))
