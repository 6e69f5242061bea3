"""Data parallelism: the tiny run on 2 simulated CPU devices logs the 1-device losses."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from moejax.train import metrics_log
from tests.train import helpers


@pytest.mark.slow
def test_two_devices_match_one(tiny_run, tmp_path, data_dir, compilation_cache):
  _, workdir, _, _ = tiny_run
  two = str(tmp_path / "two")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2", **compilation_cache)
  done = subprocess.run([sys.executable, "-m", "experiments.train", "--config=configs/tiny.py",
                         f"--workdir={two}", f"--config.data.data_dir={data_dir}"],
                        cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  for split, keys in (("train", ("loss", "ce", "aux_loss", "max_vio_batch")),
                      ("eval", ("loss", "max_vio_global"))):
    one = {r["step"]: r for r in metrics_log.read_metrics(workdir, split)}
    got = {r["step"]: r for r in metrics_log.read_metrics(two, split)}
    assert sorted(got) == sorted(one)
    for step in one:
      for key in keys:
        # Same global batch, other reduction order: equal up to float rounding.
        np.testing.assert_allclose(got[step][key], one[step][key], rtol=2e-4, atol=1e-5,
                                   err_msg=f"{split} step {step} {key}")
