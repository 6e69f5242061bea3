"""Global statistics under jax.shard_map on 4 simulated CPU devices equal full-batch ones.

The device count must be set before JAX initialises its backend, which this
pytest process has already done, so the check runs in a fresh subprocess
(global_stats_child.py) with JAX_NUM_CPU_DEVICES=4. It covers the
load-balance losses (both conventions, sequence-wise, DeepSeek-V2 device and
communication losses, balance_losses with scope 'global'), expert load,
co-activation, active budget, drop rate, routing_metrics, and the gradient of
the global loss, on a 1-D ('data') and a 2-D ('data', 'expert') mesh.
"""

import os
import pathlib
import subprocess
import sys

CHILD = pathlib.Path(__file__).with_name("global_stats_child.py")


def test_shard_map_statistics_equal_single_device_full_batch():
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # a host-device-count flag here would fight the setting
  proc = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True,
                        text=True, timeout=300, cwd=CHILD.parents[2])
  assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
  assert proc.stdout.startswith("OK"), proc.stdout
