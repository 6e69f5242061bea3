"""Orbax's and TFDS's log chatter kept out of a caller's output, unless asked for.

Orbax logs at INFO every checkpoint manager it builds and every restore
(about 30 lines for one ``moejax.load``), and warns about options moejax sets
on purpose (``read_only=True, setting max_to_keep=None``); TFDS notes every
custom dataset config it opens. None of it is something a moejax user acts
on. Both log through absl, that is the Python logger ``"absl"``.

:class:`LibraryChatter` is the filter that drops those records below ERROR.
Errors pass, except, in the binaries, orbax's own records of a failed write
(a full disk, a read-only directory;
:func:`moejax.train.write_failure.reported_by_moejax`): when a checkpoint
write fails, orbax logs several ERROR records, each with the same
TensorStore traceback (a few thousand characters), while the trainer
reports that failure in its one ``error:`` line (path, errno, resume point,
fix), so they are dropped too. :func:`quiet_library_logs` applies it to the ``absl``
logger for the duration of a ``with`` block only, so a Python caller's
logging config is left as it was; the binaries install it on their handlers
for the whole run (``experiments.cli.quiet_logs``). Either way it stays off
when the caller asked for logs (:func:`chatter_wanted`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, Optional

from absl import flags

# Path components of the libraries whose notes are chatter.
NOISY_PACKAGES = ("orbax", "tensorflow_datasets")


class LibraryChatter(logging.Filter):
  """Drops INFO / WARNING records logged from the :data:`NOISY_PACKAGES`.

  ``reported``: ``record -> bool``, the ERROR records of those packages to
  drop too because moejax reports their failure itself (the binaries pass
  :func:`moejax.train.write_failure.reported_by_moejax`: orbax's records of a
  failed checkpoint write). Without it, every error passes.
  """

  def __init__(self, reported: Optional[Callable[[logging.LogRecord], bool]] = None):
    super().__init__()
    self.reported = reported

  def filter(self, record: logging.LogRecord) -> bool:
    parts = (record.pathname or "").split(os.sep)
    if not any(p in parts for p in NOISY_PACKAGES):
      return True
    if record.levelno < logging.ERROR:
      return False
    return self.reported is None or not self.reported(record)


def chatter_wanted() -> bool:
  """Whether the caller asked for library logs.

  absl's ``--verbosity`` (``-v``) was given on the command line, or the
  ``absl`` logger is enabled for DEBUG (``absl.logging.set_verbosity('debug')``,
  or the root logger at DEBUG).
  """
  verbosity = flags.FLAGS["verbosity"] if "verbosity" in flags.FLAGS else None
  if verbosity is not None and verbosity.present:
    return True
  return logging.getLogger("absl").isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def quiet_library_logs():
  """Within the block, orbax / TFDS notes below ERROR are dropped (unless asked for)."""
  if chatter_wanted():
    yield
    return
  logger, quiet = logging.getLogger("absl"), LibraryChatter()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)
