"""Orbax's and TFDS's log chatter kept out of a caller's output, unless asked for.

Orbax logs at INFO every checkpoint manager it builds and every restore
(about 30 lines for one ``moejax.load``), and warns about options moejax sets
on purpose (``read_only=True, setting max_to_keep=None``); TFDS notes every
custom dataset config it opens. None of it is something a moejax user acts
on. Both log through absl, that is the Python logger ``"absl"``.

:class:`LibraryChatter` is the filter that drops those records below ERROR.
Errors pass, except orbax's own records of a failed write (a full disk, a
read-only directory: the exception :func:`moejax.train.write_failure.classify`
recognises): when a checkpoint write fails, orbax logs several ERROR records,
each with the same TensorStore traceback (a few thousand characters), while
the trainer reports that failure in its one ``error:`` line (path, errno,
resume point, fix), so they are dropped too. :func:`quiet_library_logs` applies it to the ``absl``
logger for the duration of a ``with`` block only, so a Python caller's
logging config is left as it was; the binaries install it on their handlers
for the whole run (``experiments.cli.quiet_logs``). Either way it stays off
when the caller asked for logs (:func:`chatter_wanted`).
"""

from __future__ import annotations

import contextlib
import logging
import os

from absl import flags

# Path components of the libraries whose notes are chatter.
NOISY_PACKAGES = ("orbax", "tensorflow_datasets")


class LibraryChatter(logging.Filter):
  """Drops INFO / WARNING records logged from the :data:`NOISY_PACKAGES`, and orbax's ERROR
  records of a write failure (reported by moejax's own ``error:`` line)."""

  def filter(self, record: logging.LogRecord) -> bool:
    parts = (record.pathname or "").split(os.sep)
    if not any(p in parts for p in NOISY_PACKAGES):
      return True
    if record.levelno < logging.ERROR:
      return False
    return not ("orbax" in parts and reported_write_failure(record))


def reported_write_failure(record: logging.LogRecord) -> bool:
  """Whether the record's exception (or, without one, its message) is a failed write."""
  # pylint: disable=g-import-not-at-top
  from moejax.train import write_failure  # imported here: moejax.train imports this module
  error = record.exc_info[1] if record.exc_info and record.exc_info[1] is not None else None
  if error is None:
    error = RuntimeError(record.getMessage())
  return write_failure.classify(error) is not None


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
