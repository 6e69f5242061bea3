"""The expert-parallel layer across 2 local processes x 4 CPU devices (jax.distributed, gloo).

The test picks a free port, launches both processes of multiprocess_child.py
with the coordinator on 127.0.0.1, and requires each to report equality with
the single-device reference for the shards it holds. Whatever happens, both
processes are killed (by their own pids) and the port is checked to be free
again.
"""

import os
import pathlib
import socket
import subprocess
import sys

from tests import fast_compile

CHILD = pathlib.Path(__file__).with_name("multiprocess_child.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("127.0.0.1", port))
      return True
    except OSError:
      return False


def test_two_processes_equal_single_device():
  port = _free_port()
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu",
             XLA_FLAGS=fast_compile.XLA_FLAGS)
  procs = [subprocess.Popen([sys.executable, str(CHILD), str(i), "2", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=CHILD.parents[2]) for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=400))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}:\nstdout:\n{out}\nstderr:\n{err[-5000:]}"
    assert f"OK {i}" in out, out
  assert _port_is_free(port), f"port {port} still bound after both processes exited"
