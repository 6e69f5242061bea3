"""Fixtures of the execution tests."""

import pytest

from moejax.execution import gmm


@pytest.fixture
def swap_backend():
  """``swap(backend)``: puts a variant of a registered gmm backend (``dataclasses.replace``
  of it) in the registry for one test; the originals come back afterwards."""
  olds = []

  def swap(backend):
    olds.append(gmm.KERNELS.swap(backend))

  yield swap
  for old in reversed(olds):
    gmm.KERNELS.swap(old)
