"""The stderr of one process of a multi-process run, with JAX's fatal peer-lost abort as one line.

When the coordination service reports a process that died (no heartbeat
for ``--heartbeat_timeout_seconds``, or the coordinator itself gone), jax
0.10's C++ client logs ``Terminating process because the JAX distributed
service detected fatal errors`` and aborts the process from one of its own
threads: no Python exception, so ``cli.run`` cannot catch it, and the abort
prints a C++ stack trace and Python's dump of every thread (~60 lines).
(The client's ``missed_heartbeat_callback`` cannot replace it from Python:
its status argument does not convert, std::bad_cast, and that aborts too.)

So a multi-process launch (:func:`install`, before ``jax.distributed``
starts) routes its file descriptor 2 through this small process, which
copies every line to the real stderr until that marker and then prints the
run's one ``error:`` line (which process, that a peer died, how to resume
and from which checkpoint) instead of the dump. It outlives the aborted
process just long enough to read the pipe to its end; it ignores SIGINT /
SIGTERM / SIGHUP so that a signal to the process group does not cut the
output short. The process's exit status is the abort's (134, SIGABRT).

Run as ``python -I stderr_guard.py MARKER MESSAGE WORKDIR`` by :func:`install`;
it imports nothing but the standard library, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys


def install(marker: str, message: str, workdir: str = "") -> None:
  """Replaces this process's fd 2 by a pipe to the guard (which writes to the old fd 2)."""
  guard = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), marker, message,
                            workdir or ""], stdin=subprocess.PIPE, stdout=sys.__stderr__,
                           stderr=subprocess.DEVNULL, close_fds=True)
  sys.stderr.flush()
  os.dup2(guard.stdin.fileno(), 2)
  guard.stdin.close()  # fd 2 is now the only write end: the guard sees EOF when this process ends


def resume_point(workdir: str) -> str:
  """Where a relaunch resumes (the layout of moejax.train.checkpoint.checkpoint_steps,
  read without importing it: this process must start fast)."""
  if not workdir:
    return "it resumes from the newest checkpoint in --workdir"
  root = os.path.join(workdir, "checkpoints")
  try:
    steps = sorted(int(n) for n in os.listdir(root)
                   if n.isdigit() and os.path.isdir(os.path.join(root, n)))
  except OSError:
    steps = []
  if not steps:
    return f"no checkpoint of {workdir} was written yet, so it starts from step 0"
  return f"it resumes from the newest checkpoint in {workdir} (step {steps[-1]})"


# The coordination service's own log lines about the failure (glog: "E1202 08:02:32.518 ...
# coordination_service.cc:1549] ...", then continuation lines): held back while a
# failure unfolds, dropped when the abort follows, printed when it does not.
_RUNTIME_LOG = re.compile(rb"^[EWF]\d{4} [\d:.]+ +\d+ (coordination_service|preemption_sync)")
_GLOG = re.compile(rb"^[IEWF]\d{4} ")


# A gloo collective whose peer vanished mid-message can also end the process from a
# C++ thread (std::terminate on gloo::EnforceNotMet, "Received data size doesn't match").
GLOO_ABORT = b"terminate called after throwing an instance of 'gloo::"


def copy(source, sink, marker: bytes, message: str, workdir: str) -> bool:
  """Copies ``source`` to ``sink`` line by line; the marker line and all after it become
  ``error: MESSAGE <resume point>`` (``{cause}`` in MESSAGE: the status the runtime
  logged), and the runtime's log lines just before it are dropped. Returns whether the
  marker came."""
  held: list[bytes] = []
  for line in iter(source.readline, b""):
    if GLOO_ABORT in line:  # gloo's exception escaped its thread: the cause is the next line
      line = b"absl::Status: gloo: " + source.readline().partition(b"what():")[2].strip()
    if marker in line or line.startswith(b"absl::Status: gloo: "):
      sink.write(f"error: {message.replace('{cause}', _cause(line))} "
                 f"{resume_point(workdir)}\n".encode())
      sink.flush()
      for _ in iter(source.readline, b""):
        pass  # the C++ stack trace and Python's thread dump
      return True
    if _RUNTIME_LOG.match(line) or (held and not _GLOG.match(line)):
      held.append(line)
      continue
    sink.writelines(held + [line])
    held = []
    sink.flush()
  sink.writelines(held)
  sink.flush()
  return False


def _cause(line: bytes) -> str:
  status = line.decode(errors="replace").partition("absl::Status:")[2].strip()
  status = status.split(". ", 1)[0].rstrip(":.")
  if status.startswith("gloo: "):
    return status[:200]
  return "JAX's coordination service: " + (status[:160] or "fatal error")


def main(argv) -> None:
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  marker, message, workdir = argv[1], argv[2], argv[3]
  copy(sys.stdin.buffer, sys.stdout.buffer, marker.encode(), message, workdir)


if __name__ == "__main__":
  main(sys.argv)
