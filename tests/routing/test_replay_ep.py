"""Routing replay under expert parallelism equals replay on one device (issue 41).

On 8 simulated CPU devices (a child process, tests/routing/replay_ep_child.py;
the device count is fixed when JAX starts).
"""

import pathlib

import pytest

from tests.parallel import children

CHILD = pathlib.Path(__file__).with_name("replay_ep_child.py")
GROUPS = ("equal", "own")


@pytest.fixture(scope="module")
def selected_groups(request):
  return children.run_child(CHILD, *children.selected(request, "group"))


@pytest.mark.parametrize("group", GROUPS)
def test_replay_under_ep_moe_layer(group, selected_groups):
  out = selected_groups[group]
  assert out.endswith(f"OK {group}"), out
