"""Notes a restore says once per process, however often the same checkpoint is loaded.

experiments.quantize loads its run once per scheme and an analysis reloads
checkpoints, so a note about a checkpoint's layout or its missing idea state
would repeat; the reader needs it once.
"""

from __future__ import annotations

from typing import Optional

_SAID: set[tuple[str, str]] = set()


def first_time(kind: str, key: Optional[str]) -> bool:
  """Whether note ``kind`` about ``key`` (a checkpoint's directory) is new in this process;
  from now on it is not. ``key`` None: always new."""
  if key is None:
    return True
  new = (kind, key) not in _SAID
  _SAID.add((kind, key))
  return new
