"""Checkpoints that prove themselves: checksums of what was saved, checked on restore.

A checkpoint that restores and is finite can still be wrong: one flipped
bit in an array file gives a finite value that no NaN guard sees, and every
restart would resume from it. So each checkpoint step directory gets a
``checksums.json`` (:data:`FILE`) holding the sha256 of the host bytes of
every leaf of the saved state tree (keyed by its path,
``params/blocks/0/attn/q_proj/kernel``, with its shape and dtype) and of the
data iterator's JSON state. It is computed from the in-memory state the
loop hands to orbax (so it proves the disk holds what was trained, not
just what was written) and written only after orbax has committed the
step (:class:`moejax.train.checkpoint.Checkpointer`), into the committed
step directory, so that orbax's own pruning and ``move_aside`` take it with
the step.

The rule on restore (:func:`verify_step`):

- every recorded array and the data state match: *verified*;
- any recorded one differs (bytes, shape or dtype), or is missing, or
  ``checksums.json`` exists but cannot be read: *damaged* (the restore falls
  back to the previous checkpoint and names the leaf);
- no ``checksums.json`` (a checkpoint written before checksums existed, or a
  run killed between orbax's commit and the checksum write): accepted,
  *unverified*, and said so in one line.

Multi-process runs: a leaf another process holds shards of cannot be read
whole here. A fully replicated leaf is checksummed from this process's copy;
a leaf sharded over processes is recorded as unverified with the reason (on
save and, when restored into such a layout, on restore), never as a
mismatch. Every process reads the same replicated bytes and the same file,
so every process reaches the same verdict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional, Sequence

import jax
from jax.tree_util import keystr
import numpy as np

FILE = "checksums.json"
FORMAT = 1
ALGORITHM = "sha256"
DATA_KEY = "data"        # the record's entry for the data iterator's JSON state
SHARDED = "sharded over processes: this process cannot read it whole"


@dataclasses.dataclass(frozen=True)
class Mismatch:
  """One leaf (``path``, or :data:`DATA_KEY`) whose restored value is not what was saved."""

  path: str
  why: str

  def __str__(self) -> str:
    return f"{self.path}: {self.why}"


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What :func:`verify_step` found.

  Attributes:
    mismatches: the damaged leaves (empty: not damaged).
    verified: every leaf and the data state matched a recorded checksum.
    note: one line for the resume message (``verified: ...`` /
      ``unverified: ...`` / ``damaged: ...``).
  """

  mismatches: tuple = ()
  verified: bool = False
  note: str = ""


def leaf_paths(tree: Any) -> list[tuple[str, Any]]:
  """``[("params/blocks/0/attn/q_proj/kernel", leaf), ...]``: dict keys, attributes and
  indices as strings (the names checksums and the checkpoint's shape check use)."""
  return [(keystr(p, simple=True, separator="/"), x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _readable(x: Any):
  """(what this process can read of ``x`` as a whole array, or None, why not)."""
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)  # the key's uint32 words: what orbax stores
    if x.is_fully_addressable:
      return x, ""
    if x.is_fully_replicated:
      return x.addressable_data(0), ""
    return None, SHARDED
  return np.asarray(x), ""


def digest(host: np.ndarray) -> str:
  """sha256 (hex) of an array's C-order bytes."""
  return hashlib.sha256(np.ascontiguousarray(host).reshape(-1).view(np.uint8)).hexdigest()


def data_digest(data_state: dict) -> str:
  """sha256 of the data state as canonical JSON (sorted keys: the order is not the content)."""
  return hashlib.sha256(json.dumps(data_state, sort_keys=True).encode()).hexdigest()


def checksums(tree: Any) -> dict[str, dict]:
  """{leaf path: {"sha256", "shape", "dtype"} or {"unverified": why}} of a state tree.

  One device-to-host transfer for every readable leaf together.
  """
  flat = leaf_paths(tree)
  readable = [_readable(x) for _, x in flat]
  hosts = jax.device_get([r for r, _ in readable if r is not None])
  out, it = {}, iter(hosts)
  for (path, _), (r, why) in zip(flat, readable):
    if r is None:
      out[path] = {"unverified": why}
      continue
    host = np.asarray(next(it))
    out[path] = {ALGORITHM: digest(host), "shape": list(host.shape), "dtype": str(host.dtype)}
  return out


def record(tree: Any, data_state: dict) -> dict:
  """The content of :data:`FILE` for a checkpoint of ``tree`` and ``data_state``."""
  return {"format": FORMAT, "algorithm": ALGORITHM, "arrays": checksums(tree),
          DATA_KEY: {ALGORITHM: data_digest(data_state)}}


def verify(tree: Any, recorded: dict[str, dict]) -> tuple[list[Mismatch], list[str]]:
  """(mismatches, unverified paths) of ``tree`` against ``recorded`` (:func:`checksums`).

  A recorded leaf absent from the tree is a mismatch; a leaf that cannot be
  read whole, now or when it was saved, or that the record lacks, is
  unverified.
  """
  now = checksums(tree)
  bad, unverified = [], []
  for path, want in recorded.items():
    have = now.get(path)
    if have is None:
      bad.append(Mismatch(path, "recorded but not in the restored state"))
    elif "unverified" in want or "unverified" in have:
      unverified.append(path)
    elif (have["shape"], have["dtype"]) != (want["shape"], want["dtype"]):
      bad.append(Mismatch(path, f"saved as {want['dtype']}{want['shape']}, restored as "
                                f"{have['dtype']}{have['shape']}"))
    elif have[ALGORITHM] != want[ALGORITHM]:
      bad.append(Mismatch(path, f"{ALGORITHM} {have[ALGORITHM][:12]}... read, "
                                f"{want[ALGORITHM][:12]}... recorded"))
  unverified.extend(p for p in now if p not in recorded)
  return bad, unverified


def write(step_dir: str, content: dict) -> str:
  """Writes ``content`` to ``step_dir/checksums.json`` atomically; returns the path."""
  path = os.path.join(step_dir, FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(content, f, sort_keys=True)
  os.replace(tmp, path)
  return path


def read(step_dir: str) -> Optional[dict]:
  """The recorded checksums of a step directory; None when it has none.

  Raises ValueError (with the reason) when the file exists but is not a
  checksum record this version reads: the checkpoint cannot prove itself.
  """
  path = os.path.join(step_dir, FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      content = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"its {FILE} cannot be read ({type(e).__name__}: {e})") from e
  if (not isinstance(content, dict) or content.get("format") != FORMAT
      or content.get("algorithm") != ALGORITHM or not isinstance(content.get("arrays"), dict)):
    raise ValueError(f"its {FILE} is not a format-{FORMAT} {ALGORITHM} record")
  return content


def verify_step(step_dir: str, tree: Any, data_state: dict) -> Verdict:
  """The :class:`Verdict` on a restored checkpoint (the rule in the module docstring)."""
  try:
    content = read(step_dir)
  except ValueError as e:
    return Verdict((Mismatch(FILE, str(e)),), note=f"damaged: {e}")
  if content is None:
    return Verdict(note=f"unverified: no {FILE} (written before checkpoints carried checksums, "
                        "or the run stopped before they were written)")
  bad, unverified = verify(tree, content["arrays"])
  want = content.get(DATA_KEY, {}).get(ALGORITHM)
  if want != data_digest(data_state):
    bad.append(Mismatch(DATA_KEY, "the data iterator state differs from the one saved"))
  if bad:
    return Verdict(tuple(bad), note=f"damaged: {describe(bad)}")
  n = len(content["arrays"]) - len(unverified)
  if unverified:
    return Verdict(note=f"unverified: {n} arrays and the data state match {FILE}; "
                        f"{len(unverified)} not checked ({unverified[0]}: {SHARDED})")
  return Verdict(verified=True, note=f"verified: {n} arrays and the data state match {FILE}")


def describe(bad: Sequence[Mismatch], limit: int = 2) -> str:
  """``1 value differs from the checksums recorded when it was saved (path: why)``."""
  shown = "; ".join(str(m) for m in bad[:limit]) + ("; ..." if len(bad) > limit else "")
  what = "1 value differs" if len(bad) == 1 else f"{len(bad)} values differ"
  return f"{what} from the checksums recorded when it was saved ({shown})"


def resume_suspect(resumed_from: Optional[int], verified: bool, newest: Optional[int],
                   at: int, steps: Sequence[int], checkpoint_dir: str, damaged_dir: str,
                   fix: str) -> Optional[str]:
  """The NaN guard's words when the resume point itself may be at fault, else None.

  It may be when the run resumed from checkpoint N and has saved no newer
  one before stopping at step ``at``: the NaN comes from N's state within
  the first steps after it (a bit flip that changed a value but kept it
  finite, in memory before the save or on disk without checksums). The fix
  then is to resume from the checkpoint before N, and only if the NaN comes
  back there, the optimisation ``fix`` (``Fix: lower ...``).
  """
  if resumed_from is None or newest != resumed_from:
    return None
  earlier = [s for s in steps if s < resumed_from]
  how = ("its arrays matched the checksums recorded when it was saved, so it was read back as "
         "written, but a state corrupted in memory before the save would match too"
         if verified else "it had no checksums to verify it against")
  then = (f"which resumes from checkpoint {earlier[-1]}" if earlier else
          "which trains the run again from step 0 (no earlier checkpoint)")
  src = os.path.join(checkpoint_dir, str(resumed_from))
  dst = os.path.join(damaged_dir, str(resumed_from))
  return (f"the run resumed from checkpoint {resumed_from} {at - resumed_from} step(s) before "
          f"this and has saved none since, so checkpoint {resumed_from} itself may be damaged "
          f"({how}). Fix: move it aside (mv {src} {dst}) and run the same command again, "
          f"{then}; only if the NaN comes back from there: {fix.split(': ', 1)[-1]}")
