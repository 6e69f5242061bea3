"""tests/conftest.py's slow lists name tests that exist: an entry left behind when its
file moves marks nothing, and the test it meant runs in the default run again."""

import os
import re

import pytest

from tests import conftest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("key", sorted(conftest.SLOW) + sorted(conftest.SLOW_CASES))
def test_every_slow_entry_names_a_test_that_exists(key):
  path, _, rest = key.partition("::")
  func = rest.partition("[")[0]
  file = os.path.join(HERE, path)
  assert os.path.isfile(file), f"{key}: tests/{path} does not exist (moved?)"
  with open(file, encoding="utf-8") as fh:
    assert re.search(rf"^def {re.escape(func)}\(", fh.read(), re.M), (
        f"{key}: tests/{path} has no test {func}")
