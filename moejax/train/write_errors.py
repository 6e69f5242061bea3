"""Which exception is a failed write of a file (a full disk, a read-only or unwritable path).

:func:`classify` finds the errno and the path in any shape such a failure
reaches moejax in (or in its causes): Python's ``OSError`` (metrics.jsonl,
the TensorBoard events, orbax's directories) and TensorStore's
``ValueError`` (``RESOURCE_EXHAUSTED: Failed writing: "PATH" ...
[os_error_code='28']``). Used by :mod:`moejax.train.write_failure` (the
run's one error) and by :mod:`moejax.train.checkpoint` (orbax's event loops
keep such errors to the trainer).
"""

from __future__ import annotations

import errno
import os
import re
from typing import Optional

# The errnos of "this path cannot be written" (the disk, the filesystem, the permissions).
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                errno.EFBIG)
_CODE = re.compile(r"os_error_code='(\d+)'")
_PATH = re.compile(r'(?:Failed writing|Error writing|Error opening)[^"]*"([^"]+)"')


def classify(e: BaseException) -> Optional[tuple[int, Optional[str]]]:
  """(errno, path or None) of a write failure in ``e`` or its causes, else None."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
      return e.errno, e.filename
    code = _CODE.search(str(e))
    if code and int(code.group(1)) in WRITE_ERRNOS:
      # The first absolute path: in 'Error writing "KEY" in OCDBT database at local file
      # "/DIR/": Failed writing: "/DIR/d/FILE"' the first quoted name is an array's key
      # inside the database.
      paths = _PATH.findall(str(e))
      return int(code.group(1)), next((p for p in paths if os.path.isabs(p)),
                                      paths[0] if paths else None)
    e = e.__cause__ or e.__context__
  return None
