"""The routing-consistency perturbations ep1 / ep2 / ep8 on sub-meshes of 8 simulated devices.

A child process (tests/serve/consistency_ep_child.py): the device count is
fixed when JAX starts.
"""

import pathlib

import pytest

from tests.parallel import children

CHILD = pathlib.Path(__file__).with_name("consistency_ep_child.py")
# topk is slow (a second model's compiles on 8 devices); hash covers the mechanism by default.
# An 8-device child process (~30 s); the library's perturbations run in the default tests.
GROUPS = (pytest.param("hash", marks=pytest.mark.slow), pytest.param("topk", marks=pytest.mark.slow))


@pytest.fixture(scope="module")
def selected_groups(request):
  return children.run_child(CHILD, *children.selected(request, "group"))


@pytest.mark.parametrize("group", GROUPS)
def test_expert_parallel_perturbations(group, selected_groups):
  out = selected_groups[group]
  assert out.endswith(f"OK {group}"), out
