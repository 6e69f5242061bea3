"""The expert-parallel layer on 8 simulated CPU devices equals the single-device layer.

The device count must be set before JAX initialises, which this pytest process
has already done with one device, so the groups run in ep_child.py in a fresh
subprocess with JAX_NUM_CPU_DEVICES=8, all the groups this test run selected in
one child (each group passes or fails on its own; tests/parallel/children.py):

* ``routers``: every router kind (top-k softmax/sigmoid+bias+groups+shared,
  Switch with capacity, score-priority capacity, expert choice, hash, top-p
  with zero-computation experts, hierarchical, GELU with heterogeneous
  widths): outputs, gradients, loads, metrics, losses, controller state and
  drops against the single-device reference (whole batch, or per shard for
  the per-group rules), with the default dispatch (each token once per
  destination device, bucketed padded all_to_all).
* ``routers_node``: every router again with the node dispatch (once per
  node across nodes, forwarded inside the node), on the capacity and the
  ragged transport.
* ``buckets``: a maximally skewed router (every token to the experts of one
  device) on every dispatch unit and transport: equal to the reference,
  nothing dropped, the largest bucket on the wire; a balanced router picks
  a smaller one.
* ``dispatch``: the ragged path (emulated collective) on expert axes of 8
  and 4, its refusal of the native collective on CPU, FSDP, ragged vs
  capacity dispatch with drops, and the per-copy dispatch.
* ``topology``: node- and device-limited routing (bounds, fewer cross-node
  bytes, equality with the single-device layer under the derived config,
  byte counts of every dispatch unit against the host-side analytic count,
  the node unit's cross-node rows at the once-per-node minimum) and placement with
  replicas (equal outputs and gradients, lower max device load).
* ``scmoe``: a ScMoE transformer (routed experts on the previous block's
  representation, shared experts on the current one) run expert-parallel
  equals the same model on one device (logits, gradients, router loads).
"""

import pathlib

import pytest

from tests.parallel import children

CHILD = pathlib.Path(__file__).with_name("ep_child.py")
GROUPS = ("routers", "routers_node", "buckets", "dispatch", "topology", "scmoe")


@pytest.fixture(scope="module")
def selected_groups(request):
  """{group: its section of the output} of one child running every group selected here."""
  return children.run_child(CHILD, *children.selected(request, "group"))


# routers_node (~40 s on CI) is slow-only (and buckets, topology, scmoe: tests/conftest.py's
# SLOW names what covers each in the default run).
@pytest.mark.parametrize("group", [pytest.param(g, marks=pytest.mark.slow) if g == "routers_node"
                                   else g for g in GROUPS])
def test_expert_parallel_equals_single_device(group, selected_groups):
  out = selected_groups[group]
  assert out.endswith(f"OK {group}"), out
