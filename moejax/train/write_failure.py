"""A write that fails mid-run (a full disk, a read-only or unwritable directory): one clear error.

The failure reaches the loop in several shapes: an ``OSError`` from
metrics.jsonl or the TensorBoard events (Python's own writes, with an errno
and often the file name), or, from a checkpoint, orbax's ``OSError`` (the
temporary directory cannot be created) or TensorStore's ``ValueError``
(``RESOURCE_EXHAUSTED: Failed writing: "PATH" ... [os_error_code='28']``),
re-raised in the main thread by orbax's ``wait_until_finished``.
:func:`classify` finds the errno and the path in any of them (or in their
causes); :func:`failure` turns one into :class:`WriteFailed`: the path, the
errno's name (ENOSPC, EROFS, ...), the last complete checkpoint (the resume
point: orbax renames a checkpoint into place only when it is complete) and
the fix. :func:`remove_temporaries` deletes the half-written checkpoint
directories (``<step>.orbax-checkpoint-tmp*``) it leaves, freeing their
space (a restart's checkpoint manager would delete them too, and
:func:`moejax.train.checkpoint.checkpoint_steps` never counts them).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Optional

from moejax.train import checkpoint as ckpt_lib
from moejax.train.write_errors import WRITE_ERRNOS, classify  # noqa: F401 (also this module's API)

TEMPORARY_MARK = ".orbax-checkpoint-tmp"


class WriteFailed(ckpt_lib.WorkdirError):
  """A file of the run could not be written; nothing after the last checkpoint is kept."""


def reported_by_moejax(record: logging.LogRecord) -> bool:
  """Whether an orbax log record is about a write failure (its exception, or without one its
  message, :func:`classify`), which the trainer reports in its own ``error:`` line
  (``moejax.chatter.LibraryChatter``'s ``reported`` in the binaries)."""
  if "orbax" not in (record.pathname or "").split(os.sep):
    return False
  error = record.exc_info[1] if record.exc_info and record.exc_info[1] is not None else None
  return classify(error if error is not None else RuntimeError(record.getMessage())) is not None


def failure(e: BaseException, workdir: str, last_step: Optional[int],
            path: Optional[str] = None) -> Optional[WriteFailed]:
  """The :class:`WriteFailed` of ``e`` (None: not a write failure).

  ``path``: the file being written when the error carries none (metrics.jsonl).
  """
  found = classify(e)
  if found is None:
    return None
  code, where = found
  where = where or path or workdir
  name = errno.errorcode.get(code, str(code))
  resume = (f"the last complete checkpoint is step {last_step} in "
            f"{os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)} (the run resumes from it)"
            if last_step is not None else "no checkpoint was written before it")
  fix = ("free space on that filesystem (df -h " + workdir + ")" if code in
         (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "make that directory writable")
  return WriteFailed(f"cannot write {where}: {name} ({os.strerror(code)}); the run stopped, "
                     f"{resume}. Fix: {fix}, then run the same command again")


def remove_temporaries(workdir: str) -> list[str]:
  """Deletes the half-written checkpoint directories in ``workdir``; returns those deleted."""
  root = os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)
  out = []
  try:
    names = os.listdir(root)
  except OSError:
    return out
  for name in names:
    if TEMPORARY_MARK in name:
      path = os.path.join(root, name)
      shutil.rmtree(path, ignore_errors=True)  # a read-only filesystem: it stays, harmless
      if not os.path.exists(path):
        out.append(path)
  return out


def stopped(e: BaseException, workdir: str, ckpt) -> Optional[WriteFailed]:
  """The loop's :class:`WriteFailed` for ``e`` (None: not a write failure), temporaries removed.

  A save still in flight (orbax writes asynchronously) is waited for first:
  it may complete (the resume point) or fail (its error is ``e``'s, or one
  of the same disk); only then are the temporaries deleted and the newest
  complete checkpoint read from the directory.
  """
  if classify(e) is None:
    return None
  try:
    ckpt.wait()
  except Exception:  # pylint: disable=broad-except
    pass  # the failure being reported, or another of the same disk
  steps = ckpt_lib.checkpoint_steps(workdir)
  out = failure(e, workdir, steps[-1] if steps else None,
                path=os.path.join(workdir, "metrics.jsonl"))
  if out is not None:
    remove_temporaries(workdir)
  return out


def finish(ckpt, writer, failing: bool) -> None:
  """Waits for the checkpoint in flight and closes the checkpointer and the metrics writer.

  ``failing`` (the run is already stopping on an exception): orbax's wait
  re-raises a failed save, and its close may fail on the same disk; either
  would replace the error being raised, so they are dropped here; that error
  says what failed.
  """
  try:
    ckpt.wait()
  except Exception:  # pylint: disable=broad-except
    if not failing:
      raise
  finally:
    try:
      ckpt.close()
    except Exception:  # pylint: disable=broad-except
      # Closing flushes orbax's last metadata: on the full disk that stopped the run it
      # fails with a bare "[Errno 28]" (a write(), no file name), which would replace the
      # error that names the path and the resume point.
      if not failing:
        raise
    finally:
      writer.close()


def late(e: BaseException, workdir: str) -> Optional[WriteFailed]:
  """The :class:`WriteFailed` of a write failure outside the training loop (the run's
  first files, its last summary), with the workdir's newest complete checkpoint; None when
  ``e`` is not one."""
  if classify(e) is None:
    return None
  steps = ckpt_lib.checkpoint_steps(workdir) if os.path.isdir(workdir) else []
  return failure(e, workdir, steps[-1] if steps else None)
