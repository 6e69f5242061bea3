"""Multi-process launches of the training binaries (experiments/distributed.py, stderr_guard.py).

Unit tests: which launch the flags and a (fake) cluster environment
describe, the one-line errors of bad combinations, that a single-process
launch never calls ``jax.distributed.initialize``, the mapping of a dead
peer's runtime errors and of JAX's abort to one ``error:`` line. The real
2-process launches are in tests/train/test_train_multihost.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import jax
import pytest
from absl import flags

from experiments import distributed as D
from experiments import stderr_guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeSlurm:
  name = "slurm"

  def __init__(self, count: int, pid: int = 0):
    self.count, self.pid = count, pid

  def get_process_count(self):
    return self.count

  def get_process_id(self):
    return self.pid


def plan(cluster=None, **kw):
  return D.plan(cluster=lambda: cluster, **kw)


def test_no_flags_and_no_cluster_is_a_single_process_run():
  assert plan() is None
  assert plan(FakeSlurm(1)) is None          # one SLURM task
  assert plan(FakeSlurm(8), num_processes=1) is None  # forced single-process


def test_a_cluster_with_several_processes_is_initialised_by_jax_from_its_environment():
  launch = plan(FakeSlurm(4, 2), heartbeat_timeout_seconds=7)
  assert launch == D.Launch("slurm", 4, heartbeat_timeout_seconds=7)


def test_explicit_flags():
  launch = plan(coordinator_address="node1:1234", num_processes=2, process_id=1,
                local_device_ids=["0", "1"])
  assert launch == D.Launch("flags", 2, "node1:1234", 1, (0, 1))
  # A flag left out comes from the cluster (here its process id).
  assert plan(FakeSlurm(4, 3), coordinator_address="node1:1234") == D.Launch(
      "flags", 4, "node1:1234", 3)


def test_the_coordinator_address_may_come_from_jax_coordinator_address(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:999")
  assert plan(num_processes=2, process_id=0) == D.Launch("flags", 2, "10.0.0.1:999", 0)


@pytest.mark.parametrize("kw, expected", [
    (dict(num_processes=2, process_id=0),
     "--num_processes=2: needs a coordinator and none is known. Fix: pass "
     "--coordinator_address=HOST:PORT"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2),
     "--process_id=2: is outside [0, 2) (--num_processes=2). Fix: number the processes 0 to 1"),
    (dict(coordinator_address="h:1", num_processes=2),
     "--num_processes=2: needs --process_id and no cluster environment numbers the processes"),
    (dict(coordinator_address="h:1", process_id=0),
     "given without --num_processes and no cluster environment"),
    (dict(coordinator_address="h", num_processes=2, process_id=0),
     "--coordinator_address=h: not HOST:PORT"),
    (dict(num_processes=0), "--num_processes=0: must be at least 1"),
    (dict(num_processes=1, process_id=1), "--process_id=1: is outside [0, 1)"),
    (dict(local_device_ids=["0", "x"]), "--local_device_ids=0,x: not a list of integers"),
    (dict(local_device_ids=["0", "0"]), "--local_device_ids=0,0: has a negative or repeated"),
    (dict(heartbeat_timeout_seconds=0), "--heartbeat_timeout_seconds=0: must be at least 1"),
])
def test_bad_combinations_are_one_line_naming_the_flag_and_the_fix(kw, expected, monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  with pytest.raises(D.LaunchError) as e:
    plan(**kw)
  assert expected in str(e.value)
  assert "\n" not in str(e.value) and "Fix: " in str(e.value)


def test_a_single_process_launch_never_calls_initialize(monkeypatch):
  fv = flags.FlagValues()
  D.define_flags(fv)
  fv(["prog"])
  monkeypatch.setattr(D, "detect_cluster", lambda: None)
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append(a))
  said = []
  assert D.start(fv, say=said.append) is None
  assert calls == [] and said == []


def test_jax_knows_the_clusters_we_document():
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  names = {env.name for env in clusters.ClusterEnv._cluster_types}  # pylint: disable=protected-access
  assert {"slurm", "ompi", "gcetpu", "gketpu"} <= names
  assert D.detect_cluster() is None  # this machine is no cluster


def test_a_dead_peers_runtime_error_is_one_line_with_the_resume_point(tmp_path):
  os.makedirs(tmp_path / "checkpoints" / "3")
  os.makedirs(tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1")
  error = RuntimeError("UNKNOWN: Gloo all-to-all failed: [external/gloo/gloo/transport/tcp/"
                       "pair.cc:547] Connection closed by peer [127.0.0.1]:5542\nmore")
  message = D.describe_failure(error, str(tmp_path))
  assert message.startswith("process 0 of 1: a peer process of this run died")
  assert "(RuntimeError: UNKNOWN: Gloo all-to-all failed" in message
  assert message.endswith(f"it resumes from the newest checkpoint in {tmp_path} (step 3)")
  assert "\n" not in message
  assert D.describe_failure(RuntimeError("shapes (2,) and (3,) differ"), None) is None
  assert D.describe_failure(ValueError("Connection closed by peer"), None) is None


def test_the_guard_turns_jax_abort_into_the_error_line():
  text = (b"step 3\n"
          b"E1202 08:02:32.518370   22945 coordination_service.cc:1549] [1] Use error polling: "
          b"UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
          b"1\n"
          b"F1202 08:02:32.519 22956 client.h:80] " + D.FATAL_MARKER.encode() +
          b". This most likely indicates that another task died. absl::Status: UNAVAILABLE: "
          b"The following tasks are unhealthy (stopped sending heartbeats):\n"
          b"*** Check failure stack trace: ***\nFatal Python error: Aborted\n")
  sink = io.BytesIO()
  assert stderr_guard.copy(io.BytesIO(text), sink, D.FATAL_MARKER.encode(),
                           "peer lost ({cause}). Resume:", "")
  assert sink.getvalue().decode().splitlines() == [
      "step 3",
      "error: peer lost (JAX's coordination service: UNAVAILABLE: The following tasks are "
      "unhealthy (stopped sending heartbeats)). Resume: it resumes from the newest checkpoint "
      "in --workdir"]
  # Without the abort, the runtime's log lines held back are all printed.
  sink = io.BytesIO()
  assert not stderr_guard.copy(io.BytesIO(text.split(b"F1202")[0] + b"W1202 other\n"), sink,
                               D.FATAL_MARKER.encode(), "x", "")
  assert sink.getvalue() == text.split(b"F1202")[0] + b"W1202 other\n"


def test_the_guard_turns_gloos_abort_into_the_error_line():
  text = (b"step 4\nterminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
          b"  what():  [enforce fail at pair.cc:459] op.preamble.length <= op.nbytes. 8 vs 4.\n"
          b"Fatal Python error: Aborted\n")
  sink = io.BytesIO()
  assert stderr_guard.copy(io.BytesIO(text), sink, D.FATAL_MARKER.encode(), "lost ({cause}).", "")
  assert sink.getvalue().decode().splitlines()[1] == (
      "error: lost (gloo: [enforce fail at pair.cc:459] op.preamble.length <= op.nbytes). it "
      "resumes from the newest checkpoint in --workdir")


def test_the_binary_refuses_a_bad_launch_in_one_line_before_jax_starts(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
       f"--workdir={tmp_path}/run", "--num_processes=2", "--process_id=0"],
      cwd=ROOT, capture_output=True, text=True, timeout=120,
      env={k: v for k, v in os.environ.items() if k != "JAX_COORDINATOR_ADDRESS"})
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      "error: --num_processes=2: needs a coordinator and none is known. Fix: pass "
      "--coordinator_address=HOST:PORT (process 0's host, a free port) to every process"]
  assert not os.path.exists(tmp_path / "run")
