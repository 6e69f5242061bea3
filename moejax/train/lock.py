"""One run per workdir: a lock file holding the owner's PID and host.

::

    with WorkdirLock(workdir, say=print):   # creates workdir; WorkdirLockedError if in use
      ...                                   # write config, metrics, checkpoints

Two runs writing one workdir (a second ``experiments.train`` started while
the first still trains, or two ``experiments.ablate`` on one suite directory)
would silently interleave checkpoints and replace each other's metrics. The
lock is ``WORKDIR/run.lock``: a JSON line ``{"pid", "host", "started",
"argv"}`` under an exclusive ``flock``. The kernel drops the ``flock`` when
its process ends, however it ends (exception, SIGTERM, SIGKILL), so:

- held by a live process -> the second run is refused, naming that PID and
  host (:class:`WorkdirLockedError`, nothing written);
- a file left by a dead process on this host (killed: its ``flock`` is gone)
  -> taken over, and said so;
- a file naming another host -> refused (on a network filesystem we cannot
  see that host's processes): the message says to delete the file if that
  run is known to be dead.

:meth:`WorkdirLock.release` (on leaving the ``with``, also on an exception)
deletes the file before dropping the ``flock``. A waiter that opened the old
file checks after locking that the path still names the file it locked, so
a release racing with two starts still admits only one.
:func:`check_unlocked` is the read-only peek the loop does before its
(slow) checks, so a busy workdir is refused at once.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from typing import Callable, Optional

from moejax.train.checkpoint import WorkdirError

LOCK_FILE = "run.lock"


class WorkdirLockedError(WorkdirError):
  """Another live run holds the workdir's lock."""


def _read(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.loads(f.read() or "{}")
  except (OSError, ValueError):
    return {}


def _pid_alive(pid) -> bool:
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by someone else
  return True


def _owner(info: dict) -> str:
  return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started "
          f"{info.get('started', '?')}")


def _refusal(workdir: str, path: str, info: dict, why: str) -> WorkdirLockedError:
  return WorkdirLockedError(
      f"{workdir} is in use by another run ({_owner(info)}){why}; two runs in one workdir "
      f"would overwrite each other's checkpoints and metrics. Fix: wait for that run to end "
      f"or stop it, or use another --workdir; if it is known to be dead, delete {path}")


def _try_flock(fd: int) -> bool:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return False
    raise


def check_unlocked(workdir: str) -> None:
  """WorkdirLockedError when a live process holds ``workdir``'s lock; reads only."""
  path = os.path.join(workdir, LOCK_FILE)
  if not os.path.exists(path):
    return
  try:
    fd = os.open(path, os.O_RDONLY)
  except FileNotFoundError:
    return
  try:
    if not _try_flock(fd):
      raise _refusal(workdir, path, _read(path), "")
    fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)
  info = _read(path)
  if info.get("host") not in (None, socket.gethostname()):
    raise _refusal(workdir, path, info, " (another host: its processes are not visible here)")


class WorkdirLock:
  """The exclusive lock of one workdir (see the module docstring); a context manager."""

  def __init__(self, workdir: str, say: Optional[Callable[[str], None]] = None):
    self.workdir, self.path = workdir, os.path.join(workdir, LOCK_FILE)
    self.say = say or (lambda text: None)
    self._fd: Optional[int] = None

  def acquire(self) -> "WorkdirLock":
    os.makedirs(self.workdir, exist_ok=True)
    host = socket.gethostname()
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      if not _try_flock(fd):
        os.close(fd)
        raise _refusal(self.workdir, self.path, _read(self.path), "")
      try:
        same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same_file = False
      if same_file:
        break
      os.close(fd)  # the holder released (deleted) it between our open and flock: retry
    previous = _read(self.path)
    if previous:
      if previous.get("host") != host:
        os.close(fd)
        raise _refusal(self.workdir, self.path, previous,
                       " (another host: its processes are not visible here)")
      state = "no longer running" if not _pid_alive(previous.get("pid")) else "not holding it"
      self.say(f"{self.workdir}: taking over the stale lock of {_owner(previous)} ({state})")
    info = {"pid": os.getpid(), "host": host,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    os.close(self._fd)  # drops the flock
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
