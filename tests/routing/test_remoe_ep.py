"""ReMoE under expert parallelism: the single-device layer, and a per-token target (issue 37).

On 8 simulated CPU devices (a child process, tests/routing/remoe_ep_child.py;
the device count is fixed when JAX starts) ``ep_moe_layer`` must equal the
single-device layer on the whole batch, and lambda's update must be the
same from one device, 8 devices or two halves of the batch.
"""

import pathlib

import pytest

from tests.parallel import children

CHILD = pathlib.Path(__file__).with_name("remoe_ep_child.py")
GROUPS = ("layer", "target")


@pytest.fixture(scope="module")
def selected_groups(request):
  return children.run_child(CHILD, *children.selected(request, "group"))


@pytest.mark.parametrize("group", GROUPS)
def test_remoe_under_ep_moe_layer(group, selected_groups):
  out = selected_groups[group]
  assert out.endswith(f"OK {group}"), out
