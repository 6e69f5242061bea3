"""The expert-parallel layer on 8 simulated CPU devices equals the single-device layer.

The device count must be set before JAX initialises, which this pytest process
has already done with one device, so every group runs ep_child.py in a fresh
subprocess with JAX_NUM_CPU_DEVICES=8:

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

import os
import pathlib
import subprocess
import sys

import pytest

CHILD = pathlib.Path(__file__).with_name("ep_child.py")


def run_child(script, *args, devices=8, timeout=600):
  env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu",
             # Compile time dominates these tiny programs; LLVM's -O0 halves it
             # and the oracle and the layer under test compile alike.
             XLA_FLAGS="--xla_backend_optimization_level=0")
  proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                        text=True, timeout=timeout, cwd=CHILD.parents[2])
  assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
  return proc.stdout


# routers_node (~40 s on CI) is slow-only: the node dispatch unit also runs in
# the default run inside ``buckets`` (every unit and transport) and ``topology``.
@pytest.mark.parametrize("group", ["routers", pytest.param("routers_node", marks=pytest.mark.slow),
                                   "buckets", "dispatch", "topology", "scmoe"])
def test_expert_parallel_equals_single_device(group):
  out = run_child(CHILD, group)
  assert f"OK {group}" in out, out
