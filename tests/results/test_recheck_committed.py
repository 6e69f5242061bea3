"""Every committed block's record re-checks at the current code (slow: minutes per block)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moejax.results import recheck
from tests.ablation import helpers


@pytest.mark.slow
def test_every_committed_record_is_current_or_from_another_machine_kind():
  records = recheck.load_records(os.path.join(helpers.ROOT, "results"))
  if not records:
    pytest.skip("no block has a re-check record yet (results/recheck/ is empty)")
  proc = subprocess.run([sys.executable, "-m", "experiments.recheck", "--nowrite"],
                        cwd=helpers.ROOT, capture_output=True, text=True, check=False)
  lines = proc.stdout.splitlines()
  assert len(lines) == len(records), proc.stdout + proc.stderr
  if all("corpus" in line for line in lines if ": cannot re-check" in line) and any(
      ": cannot re-check" in line for line in lines):
    pytest.skip("another Python: the records' corpus is not this interpreter's stdlib")
  stale = [line for line in lines if ": stale" in line or ": cannot re-check" in line]
  assert not stale, "\n".join(stale)
