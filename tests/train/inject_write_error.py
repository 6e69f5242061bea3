"""Runs ``experiments.train`` with a write error injected at a seeded point of a checkpoint save.

``python tests/train/inject_write_error.py SEED ARGS...``: the trainer's own
command line (ARGS), in this process, with one change: at the start of the
save chosen by SEED, the process's file-size limit (``RLIMIT_FSIZE``) drops
to a size chosen by SEED, so that from then on every write that would grow a
file past it fails with ``EFBIG`` (``SIGXFSZ`` ignored, as a shell does for
``ulimit -f``). The failure comes from the operating system into whichever
of TensorStore's or orbax's threads is writing a file that large, mid-save,
as a full disk does (ENOSPC): no root, no mount, and the same seed fails the
same save at the same file size. What the process prints is what the binary
prints; the tests read its stderr.
"""

from __future__ import annotations

import random
import resource
import runpy
import signal
import sys

# Sizes the limit is drawn from: above the run's small files (config, history, metric rows
# of a short run, the TensorBoard events, a checkpoint's _METADATA) and well below the
# largest data file of a configs/tiny.py save. TensorStore splits a save's array data into
# files of sizes that depend on the timing of its writes (one of 320 KB, or two of 210-240
# KB, ...), so a limit near the total could miss every file of a save.
LIMIT_BYTES = (40_000, 120_000)


def plan(seed: int, saves: int = 3) -> tuple[int, int]:
  """(the save that fails, 1-based; the file-size limit in bytes) for ``seed``."""
  rng = random.Random(seed)
  return rng.randint(1, saves), rng.randint(*LIMIT_BYTES)


def install(seed: int) -> None:
  """Sets the limit at the start of the save :func:`plan` names."""
  from moejax.train import checkpoint  # pylint: disable=g-import-not-at-top
  which, limit = plan(seed)
  real_save = checkpoint.Checkpointer.save
  count = [0]

  def save(self, step, state, data_state):
    count[0] += 1
    if count[0] == which:
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
      resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return real_save(self, step, state, data_state)
  checkpoint.Checkpointer.save = save


if __name__ == "__main__":
  install(int(sys.argv[1]))
  sys.argv = ["experiments.train"] + sys.argv[2:]
  runpy.run_module("experiments.train", run_name="__main__", alter_sys=True)
