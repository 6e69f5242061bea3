"""What to say about an unknown dataset name: what works offline first, then what needs a download.

Both places that can meet an unknown name (:class:`~moejax.data.config.DataConfig`
when it is built, :func:`~moejax.data.datasets.get_dataset` when a name got
past it) describe it with :func:`unknown_dataset`, so the message is one:
the built-in corpora (generated here, no network) and the datasets already
prepared in the data dir are listed as usable offline, and the suggestions
are drawn from them; a TFDS registry name is suggested only for a near-exact
typo, since it needs preparing first. Each name is listed once (the
built-ins are TFDS builders too, so the registry holds them).

TFDS-free: the registry is passed in by the caller.
"""

from __future__ import annotations

import difflib
import os
from typing import Iterable, Sequence

# Directories under a TFDS data dir that are not datasets.
_NOT_DATASETS = ("downloads",)


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


# A registry name is suggested only for a near-exact typo (difflib ratio): TFDS's 250 names
# would otherwise match on a shared suffix ("my_dataset" -> math_dataset, bee_dataset, ...),
# names that cannot be used here without a download anyway.
_REGISTRY_CUTOFF = 0.9


def _suggestions(base: str, offline: Sequence[str], download: Sequence[str]) -> str:
  close = [repr(c) for c in difflib.get_close_matches(base, offline, n=2)]
  near = difflib.get_close_matches(base, download, n=1, cutoff=_REGISTRY_CUTOFF)
  close += [f"{c!r} (TFDS: prepare it first)" for c in near]
  return f"did you mean {' or '.join(close)}? " if close else ""


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
  usable = f"{', '.join(builtin)} (built in)"
  if prepared:
    usable += f", {', '.join(prepared)} (prepared in {data_dir})"
  fix = (f"{_suggestions(base, offline, download)}usable offline: {usable}; a TFDS text "
         f"dataset needs preparing into {data_dir} first (tfds build NAME where there is a "
         "network)")
  return problem, fix
