"""A batch-wide router from outside the package under expert parallelism (issue 37).

tests/plugins/sinkhorn_router.py registers ``balanced_sinkhorn``: batch-centred
logits and a log-domain Sinkhorn balance, every statistic over tokens taken
through the RoutingContext. On 8 simulated CPU devices (a child process,
tests/plugins/batch_wide_child.py; the device count is fixed when JAX starts)
``ep_moe_layer`` must equal the single-device layer on the whole batch
(outputs, loads, losses, metrics, routing, gradients), and so must the
shipped S-BASE in training and expert choice with
``scope='batch'``; the same rule declaring
``expert_parallel=False`` is refused in one line before it runs.
"""

import pathlib

import pytest

from tests.parallel import children

CHILD = pathlib.Path(__file__).with_name("batch_wide_child.py")
GROUPS = ("plugin", "sbase", "expert_choice", "refused")


@pytest.fixture(scope="module")
def selected_groups(request):
  return children.run_child(CHILD, *children.selected(request, "group"))


@pytest.mark.parametrize("group", GROUPS)
def test_batch_wide_router_under_ep_moe_layer(group, selected_groups):
  out = selected_groups[group]
  assert out.endswith(f"OK {group}"), out
