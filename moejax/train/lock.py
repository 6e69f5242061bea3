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
- a file naming another host (a SLURM requeue on another node, a shared
  filesystem): that host's processes cannot be seen from here, so the
  holder's liveness is read from its **heartbeat**: a live holder touches
  the lock file (its mtime) every :data:`HEARTBEAT_SECONDS` (60 s) from a
  daemon thread. A file whose mtime is older than :data:`STALE_SECONDS`
  (10 minutes) is taken over, and said so; a fresher one is refused, naming
  the holder and both fixes: wait for the heartbeat to go stale, or pass
  ``take_over=True`` (the binaries' ``--take_over_lock``), which takes over
  another host's lock whatever its age, naming the holder it replaces.
  (A lock held by a live process on this host is refused even then: its
  ``flock`` proves it alive.)

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
import threading
import time
from typing import Callable, Optional

from moejax.train.checkpoint import WorkdirError

LOCK_FILE = "run.lock"
# The holder touches its lock file this often; another host's lock file untouched for longer
# than STALE_SECONDS is a dead run's (10 heartbeats missed: room for a slow network
# filesystem and for clock skew between hosts, as the mtime is the file server's).
HEARTBEAT_SECONDS = 60.0
STALE_SECONDS = 600.0


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


def _age(path: str) -> Optional[float]:
  """Seconds since the lock file's heartbeat (its mtime); None when it is gone."""
  try:
    return max(time.time() - os.stat(path).st_mtime, 0.0)
  except FileNotFoundError:
    return None


def _other_host(workdir: str, path: str, info: dict, age: Optional[float],
                take_over: bool) -> Optional[str]:
  """Another host's lock: the line saying why it is taken over, or WorkdirLockedError."""
  beat = "no heartbeat" if age is None else f"heartbeat {age:.0f}s ago"
  if take_over:
    return (f"{workdir}: taking over the lock of {_owner(info)} ({beat}), as --take_over_lock "
            "asks")
  if age is None or age > STALE_SECONDS:
    return (f"{workdir}: taking over the stale lock of {_owner(info)} (another host; {beat}, "
            f"over the {STALE_SECONDS / 60:.0f}-minute limit)")
  raise WorkdirLockedError(
      f"{workdir} is in use by another run ({_owner(info)}; {beat}): that host's processes are "
      f"not visible here, and its heartbeat is fresh. Fix: if that run is known to be dead "
      f"(a requeued job), pass --take_over_lock; or wait until its heartbeat is "
      f"{STALE_SECONDS / 60:.0f} minutes old (then the lock is taken over by itself); or use "
      f"another --workdir")


def _try_flock(fd: int) -> bool:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return False
    raise


def check_unlocked(workdir: str, take_over: bool = False) -> None:
  """WorkdirLockedError when a live process holds ``workdir``'s lock; reads only.

  ``take_over``: another host's lock does not count (see the module docstring).
  """
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
    _other_host(workdir, path, info, _age(path), take_over)


class WorkdirLock:
  """The exclusive lock of one workdir (see the module docstring); a context manager."""

  def __init__(self, workdir: str, say: Optional[Callable[[str], None]] = None,
               take_over: bool = False):
    self.workdir, self.path = workdir, os.path.join(workdir, LOCK_FILE)
    self.say = say or (lambda text: None)
    self.take_over = take_over
    self._fd: Optional[int] = None
    self._stop_beat = threading.Event()
    self._beat: Optional[threading.Thread] = None

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
        try:
          line = _other_host(self.workdir, self.path, previous, _age(self.path), self.take_over)
        except WorkdirLockedError:
          os.close(fd)
          raise
        self.say(line)
      else:
        state = "no longer running" if not _pid_alive(previous.get("pid")) else "not holding it"
        self.say(f"{self.workdir}: taking over the stale lock of {_owner(previous)} ({state})")
    info = {"pid": os.getpid(), "host": host,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
    os.fsync(fd)
    self._fd = fd
    self._stop_beat.clear()
    self._beat = threading.Thread(target=self._heartbeat, args=(fd,), daemon=True,
                                  name="moejax-lock-heartbeat")
    self._beat.start()
    return self

  def _heartbeat(self, fd: int) -> None:
    """Touches the lock file every HEARTBEAT_SECONDS until released (see the module docstring)."""
    while not self._stop_beat.wait(HEARTBEAT_SECONDS):
      try:
        os.utime(fd)
      except OSError:
        pass  # a full or failing disk: the run reports its own write errors

  def release(self) -> None:
    if self._fd is None:
      return
    self._stop_beat.set()
    if self._beat is not None:
      self._beat.join(timeout=5.0)
      self._beat = None
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
