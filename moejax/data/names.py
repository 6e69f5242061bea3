"""What to say about an unknown dataset name: what works offline first, then what needs a download.

Both places that can meet an unknown name (:class:`~moejax.data.config.DataConfig`
when it is built, :func:`~moejax.data.datasets.get_dataset` when a name got
past it) describe it with :func:`unknown_dataset`, so the message is one:
the built-in corpora (generated here, no network) and the datasets already
prepared in the data dir are listed as available; the rest of the TFDS
registry is named as needing a download first. Each name is listed once
(the built-ins are TFDS builders too, so the registry holds them).

TFDS-free: the registry is passed in by the caller.
"""

from __future__ import annotations

import difflib
import os
from typing import Iterable, Sequence

# Directories under a TFDS data dir that are not datasets.
_NOT_DATASETS = ("downloads",)
# Examples of TFDS text datasets that need a download (named in the fix).
DOWNLOAD_EXAMPLES = ("tiny_shakespeare", "lm1b")


def _has_dataset_info(path: str, depth: int) -> bool:
  # TFDS layout: NAME/VERSION/dataset_info.json or NAME/CONFIG/VERSION/dataset_info.json.
  if os.path.isfile(os.path.join(path, "dataset_info.json")):
    return True
  if depth == 0 or not os.path.isdir(path):
    return False
  try:
    entries = sorted(os.listdir(path))
  except OSError:
    return False
  return any(_has_dataset_info(os.path.join(path, e), depth - 1) for e in entries)


def prepared_datasets(data_dir: str, exclude: Iterable[str] = ()) -> list[str]:
  """Names of the datasets prepared in ``data_dir`` (sorted), less ``exclude``."""
  try:
    entries = sorted(os.listdir(data_dir))
  except OSError:
    return []
  skip = set(exclude) | set(_NOT_DATASETS)
  return [e for e in entries if e not in skip and not e.startswith(".")
          and _has_dataset_info(os.path.join(data_dir, e), depth=2)]


def _suggestions(base: str, offline: Sequence[str], download: Sequence[str]) -> str:
  close = difflib.get_close_matches(base, offline, n=3)
  close += [c for c in difflib.get_close_matches(base, download, n=3) if c not in close]
  if not close:
    return ""
  named = [repr(c) if c in offline else f"{c!r} (needs a download)" for c in close[:3]]
  return f"did you mean {', '.join(named)}? "


def unknown_dataset(base: str, data_dir: str, builtin: Sequence[str], registry: Sequence[str],
                    shown: str = "") -> tuple[str, str]:
  """(problem, fix) for the unknown dataset name ``base`` (its name without config / version).

  ``builtin``: the built-in corpora (available offline); ``registry``: the
  TFDS registry's names (``tfds.list_builders()``); ``shown``: the name as
  given, named in the problem (a ConfigError names it as the value instead).
  """
  prepared = prepared_datasets(data_dir, exclude=builtin)
  offline = list(dict.fromkeys([*builtin, *prepared]))
  download = [n for n in dict.fromkeys(registry) if n not in offline]
  what = f"unknown dataset {shown!r}" if shown else "unknown dataset"
  problem = f"{what} (not built in, not prepared in {data_dir}, not in the TFDS registry)"
  available = f"{', '.join(builtin)} (built in)"
  if prepared:
    available += f", {', '.join(prepared)} (prepared in {data_dir})"
  examples = ", ".join(e for e in DOWNLOAD_EXAMPLES if e in download) or "tiny_shakespeare"
  fix = (f"{_suggestions(base, offline, download)}available offline: {available}; any other "
         f"TFDS text dataset (e.g. {examples}; {len(download)} in the registry) needs a "
         "download first (tfds build NAME on a machine with a network, then copy it into "
         f"{data_dir})")
  return problem, fix
