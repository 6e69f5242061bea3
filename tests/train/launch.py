"""Launches ``python -m experiments.train`` as N local processes (gloo on 127.0.0.1), as a user would.

Shared by the multi-process trainer and ablation tests (``command``: another
binary's command line, e.g. ``experiments.ablate``): every process gets
``--coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=I``
and ``JAX_NUM_CPU_DEVICES`` devices; the binary initialises
``jax.distributed`` itself (experiments/distributed.py).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

from tests import fast_compile
from tests.train import helpers

# Compile time dominates these tiny steps (tests/fast_compile.py).
BASE_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": fast_compile.XLA_FLAGS}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def train_args(data_dir: str, workdir: str, overrides: dict) -> list[str]:
  """The binary's command line: configs/tiny.py with ``--config.KEY=VALUE`` overrides."""
  return [sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}",
          *(f"--config.{k}={v}" for k, v in overrides.items())]


@dataclasses.dataclass
class Launched:
  """The processes of one launch and the files their output goes to."""

  procs: list
  outs: list[str]
  errs: list[str]

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
      p.wait()

  def text(self, i: int, stream: str = "out") -> str:
    with open((self.outs if stream == "out" else self.errs)[i], encoding="utf-8",
              errors="replace") as f:
      return f.read()


def start(data_dir: str, workdir: str, overrides: dict, *, processes: int, devices: int,
          env_extra: dict, extra_flags=(), log_dir: str, command=None) -> Launched:
  """Starts ``processes`` processes of the binary (each ``devices`` CPU devices).

  ``command``: the command line to launch instead of :func:`train_args`'s.
  """
  env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), **BASE_ENV, **env_extra)
  port = free_port()
  launched = Launched([], [], [])
  for i in range(processes):
    args = list(command or train_args(data_dir, workdir, overrides)) + list(extra_flags)
    if processes > 1:
      args += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
               f"--process_id={i}"]
    out, err = (os.path.join(log_dir, f"process{i}.{s}") for s in ("out", "err"))
    with open(out, "w") as fo, open(err, "w") as fe:
      launched.procs.append(subprocess.Popen(args, env=env, stdout=fo, stderr=fe,
                                             cwd=helpers.ROOT))
    launched.outs.append(out)
    launched.errs.append(err)
  return launched


def run(data_dir: str, workdir: str, overrides: dict, *, processes: int, devices: int,
        env_extra: dict, log_dir: str, timeout: int = 600, command=None,
        status: int = 0) -> list[str]:
  """Runs a launch to its end; every process must exit ``status``. Returns their stdouts."""
  os.makedirs(log_dir, exist_ok=True)
  launched = start(data_dir, workdir, overrides, processes=processes, devices=devices,
                   env_extra=env_extra, log_dir=log_dir, command=command)
  try:
    for p in launched.procs:
      p.wait(timeout=timeout)
  finally:
    launched.kill()
  for i, p in enumerate(launched.procs):
    assert p.returncode == status, (f"process {i} exited {p.returncode}:\nstdout:\n"
                               f"{launched.text(i)[-3000:]}\nstderr:\n"
                               f"{launched.text(i, 'err')[-6000:]}")
  return [launched.text(i) for i in range(processes)]
