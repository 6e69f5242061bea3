"""Directories built once per test run and shared by every pytest-xdist worker.

A session fixture runs once per worker under xdist, so an expensive one (a
finished training run, a finished suite) would be computed by each worker
that needs it. :func:`build_once` builds it once in the run's shared
temporary directory under a file lock (the recipe of the pytest-xdist docs);
the other workers wait for it and read the same directory. Without xdist it
is a plain ``tmp_path_factory.mktemp``.

Shared directories are read only by the tests; a test that writes copies.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Callable

import filelock
import pytest

_DONE = ".built"


def build_once(request: pytest.FixtureRequest, name: str,
               build: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """The directory ``name`` after ``build(directory)`` filled it, once per test run."""
  factory = request.getfixturevalue("tmp_path_factory")
  if not hasattr(request.config, "workerinput"):  # not an xdist worker
    path = factory.mktemp(name)
    build(path)
    return path
  root = factory.getbasetemp().parent  # the run's directory, above the workers' own
  path = root / name
  with filelock.FileLock(str(root / f"{name}.lock")):
    if not (path / _DONE).is_file():
      if path.exists():  # a worker failed half-way: build from scratch
        shutil.rmtree(path)
      path.mkdir()
      build(path)
      (path / _DONE).write_text("")
  return path
