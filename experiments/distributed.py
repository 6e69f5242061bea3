"""Multi-process launches of the training binaries: ``jax.distributed`` from the cluster or flags.

``experiments.train``, ``experiments.finetune`` and ``experiments.ablate``
call :func:`start` (through ``cli.run(..., distributed=True)``) after their
flags are parsed and before anything touches a device:

* explicit flags ``--coordinator_address=HOST:PORT --num_processes=N
  --process_id=I`` (and ``--local_device_ids``): a launch by hand or by a
  launcher JAX does not know; a value a flag leaves out comes from the
  cluster environment when there is one (``JAX_COORDINATOR_ADDRESS`` is
  read for the address);
* no flags: JAX's own cluster detection (``jax._src.clusters``; jax 0.10:
  SLURM under ``srun``, Open MPI under ``mpirun``, Cloud TPU VMs on GCE and
  GKE, Kubernetes indexed jobs; ``mpi4py`` is opt-in and not used), and
  only when it finds more than one process;
* neither (a laptop, one SLURM task, one TPU host): nothing is called,
  nothing is printed; the run is the single-process run it always was.
  ``--num_processes=1`` forces this inside a cluster environment.

A bad combination (``--num_processes`` without a coordinator, a process id
outside ``[0, N)``, ...) is one ``error:`` line naming the flag, the value
and the fix, before JAX starts (:class:`LaunchError`).

A peer that dies mid-run (killed, out of memory, its host lost) makes the
survivors' next collective or coordination call fail; :func:`describe_failure`
maps those runtime errors to one line saying so and how to resume, which
``cli.run`` prints before exiting at once (``os._exit``: the shutdown
barrier and checkpoint threads would otherwise wait for the dead peer).
``--heartbeat_timeout_seconds`` bounds how long a peer that stopped
answering without closing its connections (a lost host) goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

from absl import flags

from experiments import stderr_guard

# jax.distributed.initialize's own defaults (jax 0.10), stated here so --helpfull shows them.
HEARTBEAT_TIMEOUT_S = 100
INITIALIZATION_TIMEOUT_S = 300

FLAG_NAMES = ("coordinator_address", "num_processes", "process_id", "local_device_ids",
            "heartbeat_timeout_seconds", "initialization_timeout_seconds")


class LaunchError(ValueError):
  """A multi-process launch that cannot work; the message is the whole ``error:`` line."""


@dataclasses.dataclass(frozen=True)
class Launch:
  """What :func:`initialize` passes to ``jax.distributed.initialize``.

  ``source``: ``"flags"`` or the JAX cluster environment's name (``slurm``,
  ``ompi``, ``gcetpu``, ...), which then fills in every field left None.
  """

  source: str
  num_processes: int
  coordinator_address: Optional[str] = None
  process_id: Optional[int] = None
  local_device_ids: Optional[tuple[int, ...]] = None
  heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_S
  initialization_timeout_seconds: int = INITIALIZATION_TIMEOUT_S


def define_flags(flag_values=flags.FLAGS) -> None:
  """The launch flags of the training binaries (defined once per flag set)."""
  if "num_processes" in flag_values:
    return
  fv = flag_values
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordinator "
                    "(multi-process runs; default: the cluster's, or "
                    "$JAX_COORDINATOR_ADDRESS).", flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run (default: "
                     "the cluster's; 1 forces a single-process run).", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "This process's index in [0, --num_processes) "
                     "(default: the cluster's).", flag_values=fv)
  flags.DEFINE_list("local_device_ids", None, "Local devices this process uses, e.g. "
                  "0,1,2,3 (default: JAX's; under SLURM / Open MPI on GPUs one per "
                  "process, numbered by the local rank).", flag_values=fv)
  flags.DEFINE_integer("heartbeat_timeout_seconds", HEARTBEAT_TIMEOUT_S, "A process that "
                     "sends no heartbeat for this long is declared dead and the run "
                     "stops.", flag_values=fv)
  flags.DEFINE_integer("initialization_timeout_seconds", INITIALIZATION_TIMEOUT_S, "How "
                     "long every process waits for the others to join.", flag_values=fv)


def detect_cluster():
  """JAX's cluster environment class this process runs in, or None (no cluster found).

  Uses JAX's own detection (the environment variables of SLURM / Open MPI,
  the Cloud TPU VM metadata, ...) in JAX's order, skipping the opt-in
  methods (mpi4py) as ``jax.distributed.initialize()`` does.
  """
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    kinds = list(clusters.ClusterEnv._cluster_types)  # pylint: disable=protected-access
  except (ImportError, AttributeError):  # another jax: explicit flags still work
    return None
  for env in kinds:
    if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
      return env
  return None


def _flag_error(flag: str, value, problem: str, fix: str) -> LaunchError:
  return LaunchError(f"--{flag}={value}: {problem}. Fix: {fix}")


def _device_ids(values: Optional[Sequence[str]]) -> Optional[tuple[int, ...]]:
  if not values:
    return None
  text = ",".join(values)
  try:
    ids = tuple(int(v) for v in values)
  except ValueError:
    raise _flag_error("local_device_ids", text, "not a list of integers",
                    "pass local device numbers, e.g. --local_device_ids=0,1,2,3") from None
  if min(ids) < 0 or len(set(ids)) != len(ids):
    raise _flag_error("local_device_ids", text, "has a negative or repeated id",
                    "list each local device once, e.g. --local_device_ids=0,1,2,3")
  return ids


def _check_address(address: str, where: str) -> None:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise LaunchError(f"{where}={address}: not HOST:PORT. Fix: give process 0's host and a "
                    "free port every process can reach, e.g. node001:12345")


def plan(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
         process_id: Optional[int] = None, local_device_ids: Optional[Sequence[str]] = None,
         heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_S,
         initialization_timeout_seconds: int = INITIALIZATION_TIMEOUT_S,
         cluster=detect_cluster) -> Optional[Launch]:
  """The launch the flags and the environment describe; None: one process, nothing to do.

  Raises LaunchError (the ``error:`` line) for values that cannot work.
  ``cluster``: returns JAX's cluster environment class or None (a
  parameter so that tests need no cluster).
  """
  for flag, value in (("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
                    ("initialization_timeout_seconds", initialization_timeout_seconds)):
    if value is None or value < 1:
      raise _flag_error(flag, value, "must be at least 1 second", f"pass --{flag}=60, say")
  if num_processes is not None and num_processes < 1:
    raise _flag_error("num_processes", num_processes, "must be at least 1",
                    "pass the number of processes of the run (1 for a single process)")
  if process_id is not None and process_id < 0:
    raise _flag_error("process_id", process_id, "must not be negative",
                    "number the processes 0, 1, ..., N-1")
  ids = _device_ids(local_device_ids)
  if num_processes == 1:
    if process_id not in (None, 0):
      raise _flag_error("process_id", process_id, "is outside [0, 1) with --num_processes=1",
                      "drop --process_id, or pass the real --num_processes")
    return None
  explicit = (coordinator_address, num_processes, process_id) != (None, None, None)
  env = cluster()
  if not explicit:
    if env is None:
      return None  # a plain single-process launch: JAX is not even asked
    count = _env_call(env, "get_process_count")
    if count <= 1:
      return None
    return Launch(env.name, count, local_device_ids=ids,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                initialization_timeout_seconds=initialization_timeout_seconds)
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  where = "--coordinator_address" if coordinator_address else "JAX_COORDINATOR_ADDRESS"
  count = num_processes if num_processes is not None else (
      _env_call(env, "get_process_count") if env else None)
  pid = process_id if process_id is not None else (
      _env_call(env, "get_process_id") if env else None)
  if count is None:
    raise LaunchError(
        f"--coordinator_address / --process_id given without --num_processes and no cluster "
        "environment (SLURM, Open MPI, a TPU pod) to read it from. Fix: pass --num_processes=N "
        "on every process")
  if address is None and env is None:
    raise _flag_error("num_processes", count, "needs a coordinator and none is known",
                    "pass --coordinator_address=HOST:PORT (process 0's host, a free port) to "
                    "every process")
  if pid is None:
    raise _flag_error("num_processes", count, "needs --process_id and no cluster environment "
                    "numbers the processes", "pass --process_id=I (0 <= I < N) to each process")
  if not 0 <= pid < count:
    raise _flag_error("process_id", pid, f"is outside [0, {count}) (--num_processes={count})",
                    f"number the processes 0 to {count - 1}")
  if address is not None:
    _check_address(address, where)
  if count == 1:
    return None
  return Launch("flags", count, address, pid, ids, heartbeat_timeout_seconds,
              initialization_timeout_seconds)


def _env_call(env, method: str) -> int:
  try:
    return int(getattr(env, method)())
  except Exception as e:  # pylint: disable=broad-except
    raise LaunchError(
        f"the {env.name} cluster environment was detected but its {method.split('_', 1)[1]} "
        f"could not be read ({type(e).__name__}: {e}). Fix: pass --coordinator_address, "
        "--num_processes and --process_id explicitly, or --num_processes=1 for one "
        "process") from e


def initialize(launch: Launch, say=print) -> None:
  """``jax.distributed.initialize`` for ``launch``; must come before any JAX computation.

  On CPU the cross-process collectives are gloo's (jax 0.10's default, set
  explicitly for older versions, unless $JAX_CPU_COLLECTIVES_IMPLEMENTATION
  chooses). A coordinator that cannot be reached in time is a LaunchError.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(
        coordinator_address=launch.coordinator_address, num_processes=launch.num_processes,
        process_id=launch.process_id,
        local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
        cluster_detection_method=None if launch.source == "flags" else launch.source,
        initialization_timeout=launch.initialization_timeout_seconds,
        heartbeat_timeout_seconds=launch.heartbeat_timeout_seconds)
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise LaunchError(
        f"jax.distributed.initialize ({launch.source}, {launch.num_processes} processes, "
        f"coordinator {launch.coordinator_address or 'from the cluster'}) failed: {first}. "
        f"Fix: start every process within --initialization_timeout_seconds="
        f"{launch.initialization_timeout_seconds} with the same --num_processes and "
        "coordinator, each with its own --process_id, and check process 0's host and port are "
        "reachable") from e
  say(f"process {jax.process_index()} of {jax.process_count()} ({launch.source}): "
      f"{jax.local_device_count()} local of {jax.device_count()} devices "
      f"({jax.devices()[0].platform})")


def start(flag_values=flags.FLAGS, say=print) -> Optional[Launch]:
  """Plans and initialises the launch the parsed flags and the environment describe."""
  fv = flag_values
  launch = plan(**{name: fv[name].value for name in FLAG_NAMES})
  if launch is not None:
    initialize(launch, say)
  return launch


# Exit status of a process that stopped because a peer died (the Python path; JAX's own
# abort, see experiments/stderr_guard.py, exits 134).
PEER_LOST_EXIT = 1

# What the runtime says when a peer process is gone: gloo's collectives on CPU, the
# coordination service's heartbeat and RPC errors (jax 0.10 / XLA), NCCL on GPUs.
PEER_LOST_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Gloo all-to-all failed",
    "stopped sending heartbeats", "heartbeat timeout", "Failed to send RPC to coordination",
    "the JAX distributed service detected fatal errors", "remote task has failed",
    "NCCL operation", "ncclRemoteError", "ncclSystemError")

# The line jax 0.10's C++ client logs just before it aborts the process (see
# experiments/stderr_guard.py, which turns it into the error line).
FATAL_MARKER = "Terminating process because the JAX distributed service detected fatal errors"


def describe_failure(error: BaseException, workdir: Optional[str] = None) -> Optional[str]:
  """The ``error:`` line of a runtime error that means a peer process died; None otherwise.

  Only runtime errors (``JaxRuntimeError`` / ``XlaRuntimeError``, and the
  RuntimeErrors orbax wraps them in) whose text names a lost connection or
  a missed heartbeat count: a bug's traceback stays a traceback.
  """
  if not isinstance(error, RuntimeError):
    return None
  text = str(error)
  if not any(marker in text for marker in PEER_LOST_MARKERS):
    return None
  first = next((line.strip() for line in text.splitlines() if line.strip()), "")
  return peer_lost_message(f"{type(error).__name__}: {first[:300]}", workdir)


def peer_lost_message(cause: str, workdir: Optional[str] = None,
                      process: Optional[tuple[int, int]] = None) -> str:
  """The ``error:`` line (without ``error: ``) of a run that lost one of its processes.

  ``cause``: the runtime's words; ``process``: (index, count), default JAX's.
  """
  if process is None:
    import jax  # pylint: disable=g-import-not-at-top
    process = (jax.process_index(), jax.process_count())
  return (f"process {process[0]} of {process[1]}: a peer process of this run died or became "
          f"unreachable (killed, out of memory, preempted, its host lost, or stopped by an error "
          f"in its own output), so this one stops too ({cause}). Resume: launch the same command again on every process; "
          f"{stderr_guard.resume_point(workdir or '')}")


def guard_stderr(workdir: Optional[str]) -> None:
  """Routes stderr through :mod:`experiments.stderr_guard` (after :func:`initialize`)."""
  template = peer_lost_message("{cause}").rsplit("; ", 1)[0] + ";"
  stderr_guard.install(FATAL_MARKER, template, workdir or "")
