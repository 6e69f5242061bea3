"""Collectives in an order every device keeps: the checker on hand-made HLO, the EP step on CPU.

XLA:CPU's runtime may start the collective after a ``conditional`` before
the one inside it, differently on each device (docs/parallel.md, "Collective
order"). ``moejax.execution.collective_order`` finds that pattern in a
compiled program; the expert-parallel step on CPU must not contain it (the
bucket switch is off there), and many steps in a row must not hang.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from moejax.execution import collective_order as co

# A hang aborts the child at XLA:CPU's rendezvous termination timeout (40 s by
# default), naming the collective the devices waited in.
ORDER_CHILD = pathlib.Path(__file__).with_name("order_child.py")


def run_child(script, *args, devices=8, timeout=900) -> str:
  """``script`` with ``args`` on ``devices`` CPU devices; its stdout (exit status 0 asserted).

  The test run's XLA_FLAGS and compilation cache (tests/conftest.py) are inherited.
  """
  env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                        text=True, timeout=timeout, cwd=pathlib.Path(script).parents[2])
  assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
  return proc.stdout

BRANCH = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%branch (p: (f32[8,4])) -> (f32[8,4]) {
  %p = (f32[8,4]{1,0}) parameter(0)
  %g = f32[8,4]{1,0} get-tuple-element(%p), index=0
  %a2a = f32[8,4]{1,0} all-to-all(%g), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (f32[8,4]{1,0}) tuple(%a2a)
}

ENTRY %main (x: f32[8,4], m: f32[], i: s32[]) -> (f32[8,4], f32[]) {
  %x = f32[8,4]{1,0} parameter(0)
  %m = f32[] parameter(1)
  %i = s32[] parameter(2)
  %pmax = s32[] all-reduce(%i), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %tup = (f32[8,4]{1,0}) tuple(%x)
  %cond = (f32[8,4]{1,0}) conditional(%pmax, %tup, %tup), branch_computations={%branch, %branch}
  %y = f32[8,4]{1,0} get-tuple-element(%cond), index=0
  %v = f32[] OPERAND
  %psum = f32[] all-reduce(%v), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %out = (f32[8,4]{1,0}, f32[]) tuple(%y, %psum)
}
"""


def test_schedule_lists_top_level_and_nested_collectives_in_order():
  hlo = BRANCH.replace("OPERAND", "copy(%m)")
  assert co.schedule(hlo) == (co.Collective("pmax", "all-reduce"),
                              co.Collective("cond", "conditional", ("all-to-all",)),
                              co.Collective("psum", "all-reduce"))


def test_an_independent_collective_after_a_nested_one_is_a_hazard():
  (hazard,) = co.hazards(BRANCH.replace("OPERAND", "copy(%m)"))
  assert (hazard.first.name, hazard.then.name) == ("cond", "psum")


def test_a_data_dependency_on_the_conditional_orders_it():
  # The psum reads the conditional's result (through a reduce), so the runtime
  # waits for the branch's all_to_all before starting it.
  hlo = BRANCH.replace("OPERAND", "reduce(%y, %m), dimensions={0,1}, to_apply=%add")
  assert co.hazards(hlo) == ()


def test_top_level_collectives_alone_are_never_a_hazard():
  hlo = BRANCH.replace("OPERAND", "copy(%m)").replace(
      "conditional(%pmax, %tup, %tup), branch_computations={%branch, %branch}", "copy(%tup)")
  assert [c.name for c in co.schedule(hlo)] == ["pmax", "psum"]
  assert co.hazards(hlo) == ()


def test_text_without_an_entry_is_a_clear_error():
  with pytest.raises(ValueError, match="no ENTRY computation.*compile\\(\\).as_text"):
    co.schedule("HloModule m\n")


# One 8-device child: one compile of the default dispatch's step, 40 calls. The
# checker's detection is covered above on hand-made HLO; the slow test below
# also checks it on the step compiled with the switch (the code before the fix).
def test_ep_step_on_cpu_has_no_collective_in_control_flow_and_runs_many_times():
  out = run_child(ORDER_CHILD, "default", "40")
  assert "OK default" in out, out


# Every bucketed variant of the bench (six compiles) and 300 calls of each:
# slow-only (~5 min on 2 shared cores); the test above is its default-run case.
@pytest.mark.slow
def test_every_bucketed_variant_is_ordered_and_survives_a_long_loop():
  out = run_child(ORDER_CHILD, "all", "300")
  assert "OK all" in out, out
