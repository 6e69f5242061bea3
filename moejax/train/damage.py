"""Which part of a checkpoint is damaged, named by what it is, for the resume message.

A checkpoint step holds the train state (orbax ``state/``: the tree's
metadata and the arrays, in an OCDBT database) and the data iterator's
state (``data/metadata``, one JSON file). When an array's bytes are
damaged, orbax raises a bare ``Exception`` whose text ends in a repr of a
pybind11 bound method and the whole TensorStore spec; the cause under it is
TensorStore's status line, which names the array's key. :func:`restore_error`
turns that into "its array KEY cannot be read (STATUS: detail)", and any
other restore error into its first line without TensorStore's spec.
:func:`data_state_problem` reads the data iterator's file itself, so that
an emptied or truncated one is named as such rather than as unreadable
arrays.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

# orbax's JsonCheckpointHandler file of the "data" item (the iterator's state).
DATA_STATE_FILE = os.path.join("data", "metadata")
_SPEC_MARK = "See full TensorStore details"
# 'OUT_OF_RANGE: Error reading "KEY/0.0" in OCDBT database at local file "DIR/": DETAIL', the
# key's chunk or its metadata (KEY/.zarray, behind 'Error opening "zarr" driver: ').
_READING = re.compile(r'^(?P<status>[A-Z_]+): (?:Error opening "[^"]*" driver: )*'
                      r'Error reading "(?P<key>[^"]+)"(?: in [^"]*"[^"]*")?: (?P<detail>.*)$',
                      re.S)
_LIMIT = 160


def _first_line(e: BaseException) -> str:
  text = str(e).split(_SPEC_MARK, 1)[0].strip().rstrip(".")
  first = (text.splitlines() or [""])[0]
  return f"{type(e).__name__}: {first[:_LIMIT]}"


def restore_error(e: BaseException) -> str:
  """What a failed restore of a step's arrays says is damaged (``e`` and its causes)."""
  seen, cause = set(), e
  while cause is not None and id(cause) not in seen:
    seen.add(id(cause))
    m = _READING.match(str(cause).strip())
    if m:
      array = m.group("key").rsplit("/", 1)[0]  # KEY/0.0: the array, then the chunk
      detail = m.group("detail").strip().splitlines()[0][:_LIMIT]
      return f"its array {array} cannot be read ({m.group('status')}: {detail})"
    cause = cause.__cause__ or cause.__context__
  return f"its arrays cannot be restored ({_first_line(e)})"


def metadata_error(e: BaseException) -> str:
  """What a failed read of a step's tree metadata says (no TensorStore spec)."""
  return f"its metadata cannot be read ({_first_line(e)})"


def data_state_problem(step_dir: str) -> Optional[str]:
  """Why the data iterator's state file of the step in ``step_dir`` is unusable, else None."""
  path = os.path.join(step_dir, DATA_STATE_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    return f"its data-iterator state file {DATA_STATE_FILE} is missing"
  except (OSError, UnicodeDecodeError) as e:
    return f"its data-iterator state file {DATA_STATE_FILE} cannot be read ({_first_line(e)})"
  if not text.strip():
    return f"its data-iterator state file {DATA_STATE_FILE} is empty"
  try:
    state = json.loads(text)
  except ValueError as e:
    return f"its data-iterator state file {DATA_STATE_FILE} is not valid JSON ({e})"
  if not isinstance(state, dict):
    return (f"its data-iterator state file {DATA_STATE_FILE} holds a "
            f"{type(state).__name__}, not the iterator's state")
  return None
