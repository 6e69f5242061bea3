"""Does a result still come out of the code? A fingerprint of the code that computes numbers.

Every ablation run records :func:`current` in its provenance: a sha256 over
the source files that can move a measured number (the model, routing,
balance, execution, training, data, evaluation and statistics code, the
shipped configs, the ablate binary), with one hash per part
(``moejax/routing``, ``moejax/layer.py``, ``configs``, ...). RESULTS.md's
generated blocks compare the fingerprint a summary recorded with the
checkout's (:func:`changed_parts`): a block whose code has changed since its
run is flagged **stale** in RESULTS.md itself, naming the parts that
changed, and since the committed RESULTS.md must equal what the report
generates, a commit that changes such code cannot land without the flag
(or a re-run).

The rule is deliberately simple and conservative: any edit of a file in
scope (a refactor that moves no number included) flags the blocks run
before it, until the suite is re-run. Files that only *present* numbers
(the Markdown tables, plots, trend and report rendering, provenance) and
code no suite runs (serving, checkpoint interop) are out of scope.

Summaries written before fingerprints existed can be backfilled from git
(:func:`at_commit`): the fingerprint of the commit their runs name, when
that commit was clean.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from typing import Iterable, Mapping, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCOPE = ("moejax/", "configs/", "experiments/ablate.py")
# Present or record numbers, or are never run by a suite: editing them moves no result
# (metrics_log: the metrics writer / reader and the progress line; moejax/results: the
# RESULTS.md and notebook tool, the re-check's judge included).
OUT_OF_SCOPE = ("moejax/train/metrics_log.py", "moejax/ablation/tables.py",
                "moejax/ablation/plots.py", "moejax/ablation/provenance.py",
                "moejax/ablation/freshness.py", "moejax/ablation/curves.py",
                "moejax/results/", "moejax/serve/", "moejax/interop/")


def in_scope(path: str) -> bool:
  """``path`` (relative, ``/``-separated) is a Python source that can move a number."""
  if not path.endswith(".py") or not any(path == s or path.startswith(s) for s in SCOPE):
    return False
  return not any(path == s or path.startswith(s) for s in OUT_OF_SCOPE)


def part(path: str) -> str:
  """The part a file is reported under: ``moejax/routing``, ``moejax/layer.py``, ``configs``."""
  bits = path.split("/")
  if bits[0] == "moejax" and len(bits) > 2:
    return "/".join(bits[:2])
  return path if bits[0] != "configs" else "configs"


def fingerprint(files: Mapping[str, bytes]) -> dict:
  """``{"fingerprint": hex, "parts": {part: hex}}`` of ``{path: content}`` (paths in scope)."""
  by_part: dict[str, hashlib._Hash] = {}
  total = hashlib.sha256()
  for path in sorted(p for p in files if in_scope(p)):
    entry = path.encode() + b"\0" + hashlib.sha256(files[path]).digest()
    total.update(entry)
    by_part.setdefault(part(path), hashlib.sha256()).update(entry)
  return {"fingerprint": total.hexdigest()[:16],
          "parts": {k: h.hexdigest()[:12] for k, h in sorted(by_part.items())}}


def _walk(root: str) -> Iterable[str]:
  for top in ("moejax", "configs"):
    for d, dirs, names in os.walk(os.path.join(root, top)):
      dirs[:] = sorted(x for x in dirs if x != "__pycache__")
      for n in names:
        yield os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
  yield "experiments/ablate.py"


@functools.lru_cache(maxsize=4)
def current(root: str = _ROOT) -> Optional[dict]:
  """The fingerprint of the code in ``root`` (the checkout moejax runs from); None when its
  configs/ or experiments/ are not there (an installed package cannot be checked)."""
  if not os.path.isdir(os.path.join(root, "configs")):
    return None
  files = {}
  for path in _walk(root):
    if in_scope(path) and os.path.isfile(os.path.join(root, path)):
      with open(os.path.join(root, path), "rb") as f:
        files[path] = f.read()
  return fingerprint(files)


def at_commit(commit: str, root: str = _ROOT) -> dict:
  """The fingerprint of ``commit``'s tree (git), for summaries older than fingerprints."""
  def git(*args, data=None):
    return subprocess.run(["git", "-C", root, *args], input=data, capture_output=True,
                          timeout=60, check=True).stdout
  names = [n for n in git("ls-tree", "-r", "--name-only", commit, "--", "moejax", "configs",
                          "experiments/ablate.py").decode().splitlines() if in_scope(n)]
  blobs = git("cat-file", "--batch", data="".join(f"{commit}:{n}\n" for n in names).encode())
  files, pos = {}, 0
  for name in names:  # --batch: "<sha> blob <size>\n<content>\n" per request
    head_end = blobs.index(b"\n", pos)
    size = int(blobs[pos:head_end].split()[2])
    files[name] = blobs[head_end + 1:head_end + 1 + size]
    pos = head_end + 1 + size + 1
  return fingerprint(files)


def changed_parts(recorded: Optional[Iterable[Mapping]], now: Optional[Mapping]
                  ) -> Optional[list[str]]:
  """The parts whose code differs between the fingerprints a summary's runs recorded and
  ``now``: [] when all runs ran the current code; None when that cannot be told (no
  fingerprint recorded, or no current one)."""
  recorded = list(recorded or [])
  if not recorded or now is None:
    return None
  parts = set()
  for fp in recorded:
    if fp["fingerprint"] == now["fingerprint"]:
      continue
    old, new = fp.get("parts", {}), now["parts"]
    parts |= {p for p in set(old) | set(new) if old.get(p) != new.get(p)}
  return sorted(parts)


def backfill(summary: dict, root: str = _ROOT, rehash: bool = False) -> bool:
  """Adds ``provenance.code`` to a summary that predates fingerprints, from git, when every
  commit its runs name is clean and known; returns whether it did. ``rehash``: recompute
  it even when recorded (after :data:`SCOPE` / :data:`OUT_OF_SCOPE` changed, a recorded
  fingerprint no longer hashes what the current rule hashes; a clean commit does)."""
  prov = summary.setdefault("provenance", {})
  commits = prov.get("commits") or []
  if ((prov.get("code") and not rehash) or not commits
      or any(c.endswith("+dirty") for c in commits)):
    return False
  try:
    prov["code"] = [at_commit(c, root) for c in commits]
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return False
  prov["code_source"] = "from git at the runs' commit (moejax.ablation.freshness.at_commit)"
  return True
