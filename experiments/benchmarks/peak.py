r"""``--suite=peak``: this machine's matmul peak for the trainer's MFU, measured once.

  python -m experiments.bench --suite=peak

Measures the dense matmul roof in float32 and bfloat16 (the best of a few
seconds of 512^3 matmuls each) and caches it in the user's cache directory
(``moejax.train.mfu.calibration_path``): the trainer's MFU on a device without
a datasheet peak (a CPU) is against it, read, never measured again under a
run's load.
"""

from __future__ import annotations

import jax

from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry


def peak_suite() -> dict:
  """Calibrates this machine's peak for the trainer's MFU (moejax.train.mfu.calibrate)."""
  from moejax.train import mfu  # pylint: disable=g-import-not-at-top
  return {"calibrations": mfu.calibrate(), "path": mfu.calibration_path(),
          "conditions": bench_lib.conditions()}


def print_peak_table(res: dict) -> None:
  from moejax.train import mfu  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  print(f"matmul peak of this machine, cached in {res['path']} (the trainer's MFU reads it):")
  for key, rec in res["calibrations"].items():
    hit = mfu.table_peak(device.device_kind, rec["dtype"])
    used = (f"; runs use the datasheet peak {hit[1] / 1e12:.4g} TFLOP/s ({hit[0]})" if hit
            else "")
    print(f"  {key}: {rec['tflops']:.4g} TFLOP/s ({rec['matmul']}){used}")


SUITE = registry.register(registry.Suite(
    "peak", "this machine's matmul peak, cached once for the trainer's MFU",
    peak_suite, print_peak_table))
