"""The processes of a multi-process run agreeing: who writes, barriers, one decision for all.

A multi-process run (``jax.distributed``, :mod:`experiments.distributed`)
runs the same program on every process; the files of a workdir are shared
(one filesystem), so they are written by process 0 alone (:func:`is_lead`)
and read by the others only after a barrier (:func:`sync`). A decision that
reads files (which runs of a suite are finished, whether a directory is
locked) is made once, by process 0, and sent to every process
(:func:`decided_by_lead`): processes that each read the directory could see
it at different moments (process 0 may already have written the next file)
and take different branches, and a branch without the others' collectives
hangs the run. An error in that decision reaches every process, so every
process stops with the same ``error:`` line instead of waiting for process 0.

One process (``jax.process_count() == 1``): every function is the plain
single-process operation; nothing is sent.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils


def is_lead() -> bool:
  """Whether this process writes the shared files (process 0; always, with one process)."""
  return jax.process_index() == 0


def sync(name: str) -> None:
  """A barrier of every process (nothing with one process); ``name`` must match on all."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


class LeadFailed(Exception):
  """Process 0's error in a :func:`decided_by_lead` decision, raised on the other processes.

  ``kind``: the error's type name on process 0; ``str(e)``: its message;
  ``line``: ``"kind: message"``, the ``error:`` line process 0 prints.
  """

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind

  @property
  def line(self) -> str:
    return f"{self.kind}: {self}"


def broadcast_json(value: Any) -> Any:
  """Process 0's ``value`` (JSON: dicts, lists, strings, numbers) on every process.

  Two broadcasts: the encoded length (every process must pass an array of
  the same shape), then the bytes. Other processes' ``value`` is ignored.
  """
  if jax.process_count() == 1:
    return json.loads(json.dumps(value))  # the same types the other processes would get
  data = (np.frombuffer(json.dumps(value).encode(), np.uint8) if is_lead()
          else np.zeros(0, np.uint8))
  size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
  buf = data if is_lead() else np.zeros(size, np.uint8)
  got = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
  return json.loads(got.tobytes().decode())


def decided_by_lead(decide: Callable[[], Any]) -> Any:
  """``decide()`` run by process 0, its JSON result returned on every process.

  An exception in ``decide`` is raised on process 0 as it is and on the other
  processes as :class:`LeadFailed` with its type name and message.
  """
  if jax.process_count() == 1:
    return decide()
  payload, error = None, None
  if is_lead():
    try:
      payload = {"value": decide()}
    except Exception as e:  # pylint: disable=broad-except  # sent, then raised below
      payload, error = {"error": [type(e).__name__, str(e)]}, e
  got = broadcast_json(payload)
  if error is not None:
    raise error
  if "error" in got:
    raise LeadFailed(*got["error"])
  return got["value"]


def host_tree(tree: Any) -> Any:
  """Every leaf of ``tree`` as a whole host array on this process.

  A leaf sharded over processes (``jax.device_get`` refuses it: this process
  holds only its shards) is gathered from all of them, so every process must
  call this with the same tree; a replicated leaf is read from the local
  copy.
  """
  def whole(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return jax.device_get(x.addressable_data(0))
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_get(x)
  return jax.tree.map(whole, tree)
