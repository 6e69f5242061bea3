"""Whether a directory can be created and written, found by trying before a run starts.

Permission bits do not answer it: root passes ``os.access`` on a read-only
bind mount's parent, on ``/sys`` (mkdir: EPERM) and on ``/proc`` (mkdir:
ENOENT), so the failure would come later, after the dataset was prepared
or the budget table printed. :func:`problem` creates and removes one empty
directory in the nearest existing ancestor of the path instead; it leaves
nothing behind. :func:`writable_example` is the fix's example: the same
name under the home or the temporary directory, whichever passes the same
test.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Optional

_PROBE_PREFIX = ".moejax-write-probe-"
_DEFAULT_NAME = "moejax_run"


def nearest_existing(path: str) -> str:
  """``path`` (absolute), or its nearest ancestor that exists."""
  probe = os.path.abspath(os.path.expanduser(path))
  while not os.path.exists(probe):
    parent = os.path.dirname(probe)
    if parent == probe:
      break
    probe = parent
  return probe


def problem(path: str) -> Optional[str]:
  """Why ``path`` cannot be, or be created as, a writable directory; None when it can."""
  probe = nearest_existing(path)
  if not os.path.isdir(probe):
    return f"{probe} is a file, not a directory"
  if not os.access(probe, os.W_OK | os.X_OK):
    return f"{probe} is not writable"
  try:
    os.rmdir(tempfile.mkdtemp(prefix=_PROBE_PREFIX, dir=probe))
  except OSError as e:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    return f"{probe} refuses new directories ({name}: {e.strerror or e})"
  return None


def writable_example(path: str) -> Optional[str]:
  """``path``'s last name under the home directory or the temporary one, whichever can be
  written (None when neither can)."""
  name = os.path.basename(os.path.normpath(path)) or _DEFAULT_NAME
  for root in (os.path.expanduser("~"), tempfile.gettempdir()):
    candidate = os.path.join(root, name)
    if os.path.abspath(candidate) != os.path.abspath(path) and problem(candidate) is None:
      return candidate
  return None
