"""Model FLOP utilisation: the model's FLOPs per step, the device's peak, and their ratio.

::

    meter = mfu.Meter.for_run(cfg)            # peak resolved once, never measured here
    row.update(meter.row(steps=20, seconds=4.1))
    # {"model_tflops_per_s": 0.62, "mfu": 0.031, "peak_tflops": 20.1,
    #  "peak_source": "calibrated:cpu"}

What counts (the conventions of :mod:`moejax.topology.accounting`, not a
second count): a step trains B x S token positions (``data.batch_size`` x
``data.seq_len``, the global batch, padding included: it is computed), and
one position costs 3 x the accounting's forward FLOPs per token (backward
~ 2 forwards, the ``train_flops`` of :mod:`moejax.ablation.budget`): the
*active* routed experts (expected slots under balanced routing), shared
experts, the router, attention projections and mixing at S (every token
attends to all S positions: the causal mask's halving is not subtracted),
the LM head. Elementwise work, the balance losses, dispatch bookkeeping and
recomputation are not model FLOPs, so MFU is a lower bound on how busy the
matrix units are.

The peak, per device, for the dtype the run computes in
(``model.compute_dtype``), in this order (``peak_source`` says which):

1. ``train.peak_tflops`` (``"config"``);
2. the device kind's datasheet peak for that dtype (:data:`PEAKS`,
   ``"table:H200"``);
3. the calibration of this machine (:func:`calibrate`, run once by
   ``python -m experiments.bench --suite=peak`` and cached in
   :func:`calibration_path`, ``"calibrated:cpu"``): a CPU has no datasheet
   peak that a matmul reaches, so its MFU is against what a large dense
   matmul achieved on the same cores when they were calibrated; the
   simulated devices of ``JAX_NUM_CPU_DEVICES`` share them, so that roof
   counts once per process, not once per simulated device;
4. none (``"none"``): the rows have no ``mfu``, the lines say ``MFU n/a``
   and the start line names the command that calibrates.

The peak is never measured at the start of a run: a roof measured under
each run's load moved a CPU's MFU by 3x between runs of one model.

MFU = model FLOP/s of the whole job / (peak per device x devices).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from moejax.topology import accounting

# Dense (no 2:4 sparsity) peak FLOP/s per device for each compute dtype, from the vendors'
# data sheets: NVIDIA H100 / H200 Tensor Core GPU datasheets (SXM: bf16 989.4 TFLOPS,
# TF32 494.7; H100 PCIe: 756, 378), NVIDIA A100 datasheet (bf16 312, TF32 156, SXM and
# PCIe), Google Cloud TPU system-architecture pages (bf16 per chip: v4 275, v5e 197, v5p
# 459, v6e Trillium 918; a jax device is one chip on these generations). float32 is what
# JAX's default matmul precision runs a float32 matmul at: TF32 on these GPUs, bf16
# passes on TPUs (so their float32 peak is the bf16 one).
# (label, jax device_kind, exact, {dtype: peak}): exact compares the whole kind (TPU
# kinds, where "TPU v5" is a v5p but a prefix of "TPU v5 lite"), otherwise a substring
# (GPU kinds carry the memory size: "NVIDIA H100 80GB HBM3"). The first match wins, so a
# specific entry (H100 PCIe) precedes its family.
_TPU = lambda peak: {"bfloat16": peak, "float32": peak}
PEAKS = (
    ("H100 PCIe", "H100 PCIe", False, {"bfloat16": 756e12, "float32": 378e12}),
    ("H200", "H200", False, {"bfloat16": 989e12, "float32": 494e12}),
    ("H100", "H100", False, {"bfloat16": 989e12, "float32": 494e12}),
    ("A100", "A100", False, {"bfloat16": 312e12, "float32": 156e12}),
    ("TPU v4", "TPU v4", True, _TPU(275e12)),
    ("TPU v5e", "TPU v5 lite", True, _TPU(197e12)),
    ("TPU v5e", "TPU v5e", True, _TPU(197e12)),
    ("TPU v5p", "TPU v5", True, _TPU(459e12)),
    ("TPU v5p", "TPU v5p", True, _TPU(459e12)),
    ("TPU v6e", "TPU v6 lite", True, _TPU(918e12)),
    ("TPU v6e", "TPU v6e", True, _TPU(918e12)),
)
# The bf16 column, as experiments.device_check reads it.
PEAK_BF16 = tuple((label, kind, exact, peaks["bfloat16"]) for label, kind, exact, peaks in PEAKS)
CALIBRATE_SECONDS = 3.0  # per dtype: the best of many runs is the roof, not one lucky one
ROOF_SIZE = 512          # n of its n x n x n matmuls (CPU: a few ms each)
CALIBRATE_COMMAND = "python -m experiments.bench --suite=peak"
CALIBRATION_FILE = "peak.json"


@dataclasses.dataclass(frozen=True)
class Peak:
  """The peak MFU is measured against.

  per_device: FLOP/s of one device; devices: how many of them the job runs
  on (a calibrated CPU roof: the processes, whose simulated devices share
  their host's cores); source: ``config``, ``table:<label>`` or
  ``calibrated:<platform>``.
  """

  per_device: float
  devices: int
  source: str

  @property
  def total(self) -> float:
    return self.per_device * self.devices


def table_peak(device_kind: str, dtype: str = "bfloat16") -> Optional[tuple[str, float]]:
  """(label, FLOP/s) of ``device_kind`` computing in ``dtype`` in :data:`PEAKS`, else None."""
  for label, kind, exact, peaks in PEAKS:
    if ((device_kind == kind) if exact else (kind in device_kind)) and dtype in peaks:
      return label, peaks[dtype]
  return None


def calibration_path() -> str:
  """``$XDG_CACHE_HOME/moejax/peak.json`` (``~/.cache/moejax/peak.json`` without it).

  ``MOEJAX_CACHE_DIR`` replaces the directory (the tests point it at an empty one, so
  that no developer's calibration changes what they see).
  """
  root = os.environ.get("MOEJAX_CACHE_DIR") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
      "moejax")
  return os.path.join(root, CALIBRATION_FILE)


def calibration_key(device, dtype: str) -> str:
  """What a calibration is of: the device kind, the dtype, and on CPU the core count."""
  cores = f":{os.cpu_count()}cores" if device.platform == "cpu" else ""
  return f"{device.platform}:{device.device_kind}{cores}:{dtype}"


def read_calibrations(path: Optional[str] = None) -> dict:
  """The cached calibrations ``{key: {"tflops", ...}}``; {} when none or unreadable."""
  try:
    with open(path or calibration_path(), encoding="utf-8") as f:
      out = json.load(f)
    return out if isinstance(out, dict) else {}
  except (OSError, ValueError):
    return {}


def calibrate(dtypes=("float32", "bfloat16"), device=None, seconds: Optional[float] = None,
              measure: Callable[..., float] = None, path: Optional[str] = None) -> dict:
  """Measures this machine's matmul roof for each of ``dtypes`` (``seconds`` each, default
  :data:`CALIBRATE_SECONDS`) and caches it.

  Returns ``{key: record}`` of what was written (the file keeps other keys).
  """
  seconds = CALIBRATE_SECONDS if seconds is None else seconds
  device = device or jax.devices()[0]
  measure = measure or measure_matmul_roof
  path = path or calibration_path()
  cached = read_calibrations(path)
  new = {}
  for dtype in dtypes:
    flops = measure(dtype, seconds=seconds)
    new[calibration_key(device, dtype)] = {
        "tflops": flops / 1e12, "dtype": dtype, "device_kind": device.device_kind,
        "matmul": f"{ROOF_SIZE}x{ROOF_SIZE}x{ROOF_SIZE}, best of {seconds:g} s",
        "date": datetime.datetime.now().isoformat(timespec="seconds")}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({**cached, **new}, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
  return new


@functools.lru_cache(maxsize=None)
def measure_matmul_roof(dtype: str = "float32", seconds: float = CALIBRATE_SECONDS,
                        n: int = ROOF_SIZE) -> float:
  """FLOP/s of n x n x n matmuls on the default device, best of ~``seconds`` of repeats.

  Eight chained matmuls per call amortise the dispatch; the best call is
  kept (the roof: what the device reaches, not its average under other
  load).
  """
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  b = (jnp.eye(n, dtype=jnp.float32) * 0.5 + a.astype(jnp.float32) * n ** -1.5).astype(dtype)
  chain = 8

  @jax.jit
  def f(x):
    for _ in range(chain):
      x = jnp.dot(x, b, preferred_element_type=jnp.float32).astype(dtype)
    return x

  jax.block_until_ready(f(a))  # compile
  best, end = float("inf"), time.perf_counter() + seconds
  while True:
    t0 = time.perf_counter()
    jax.block_until_ready(f(a))
    best = min(best, time.perf_counter() - t0)
    if time.perf_counter() > end:
      break
  return chain * 2.0 * n ** 3 / best


def resolve_peak(peak_tflops: Optional[float] = None, device=None, *, dtype: str = "float32",
                 devices: int = None, processes: int = None,
                 calibrations: Optional[dict] = None) -> Optional[Peak]:
  """The peak of this job (module docstring's order), None when there is none; reads only."""
  device = device or jax.devices()[0]
  devices = jax.device_count() if devices is None else devices
  processes = jax.process_count() if processes is None else processes
  if peak_tflops is not None:
    return Peak(float(peak_tflops) * 1e12, devices, "config")
  hit = table_peak(device.device_kind, dtype)
  if hit is not None:
    return Peak(hit[1], devices, f"table:{hit[0]}")
  cal = (read_calibrations() if calibrations is None else calibrations).get(
      calibration_key(device, dtype))
  if not cal or not isinstance(cal.get("tflops"), (int, float)) or cal["tflops"] <= 0:
    return None
  return Peak(float(cal["tflops"]) * 1e12, processes if device.platform == "cpu" else devices,
              f"calibrated:{device.platform}")


def step_flops(cfg) -> float:
  """Model FLOPs of one train step of ``cfg`` (an ExperimentConfig): 3 x fwd x B x S."""
  b = accounting.budget(cfg.model, seq_len=cfg.data.seq_len)
  return 3.0 * b.flops_per_token * cfg.data.batch_size * cfg.data.seq_len


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
  """Achieved FLOP/s (``flops`` in ``seconds``) over ``peak_flops``; 0 for no time."""
  return flops / seconds / peak_flops if seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Meter:
  """What a train row's MFU fields are computed from: FLOPs per step and the peak (None:
  none known, MFU n/a)."""

  flops_per_step: float
  peak: Optional[Peak]
  dtype: str = "float32"

  @classmethod
  def for_run(cls, cfg) -> "Meter":
    dtype = cfg.model.compute_dtype
    return cls(step_flops(cfg), resolve_peak(cfg.train.peak_tflops, dtype=dtype), dtype)

  def row(self, steps: int, seconds: float) -> dict:
    """``model_tflops_per_s``, ``mfu``, ``peak_tflops`` (per device), ``peak_devices``,
    ``peak_source`` (without a peak: the rate and ``peak_source`` "none" only).

    ``steps`` timed steps in ``seconds`` (none: the FLOP rate and MFU are 0,
    like tokens/s of a window holding only the compiling first step).
    """
    flops = self.flops_per_step * steps
    out = {"model_tflops_per_s": flops / seconds / 1e12 if steps and seconds > 0 else 0.0}
    if self.peak is None:
      return {**out, "peak_source": "none"}
    return {**out, "mfu": mfu(flops, seconds, self.peak.total) if steps else 0.0,
            "peak_tflops": self.peak.per_device / 1e12, "peak_devices": self.peak.devices,
            "peak_source": self.peak.source}

  def describe(self) -> str:
    """One line for the start of a run."""
    work = (f"{self.flops_per_step / 1e9:.4g} GFLOP of model FLOPs per step (3 x forward "
            "FLOPs/token x batch x seq_len, moejax.topology.accounting)")
    p = self.peak
    if p is None:
      return (f"MFU n/a: no known {self.dtype} peak for this device; calibrate this machine "
              f"once with `{CALIBRATE_COMMAND}` (cached in {calibration_path()}) or set "
              f"--config.train.peak_tflops; {work}")
    return f"MFU against {p.per_device / 1e12:.3g} TFLOP/s x {p.devices} ({p.source}); {work}"


def progress_text(row: dict) -> str:
  """`` | 0.62 TFLOP/s | MFU 3.1% of 20 TFLOP/s`` for the progress line, the peak beside
  the figure (``MFU n/a`` without one; empty without the fields)."""
  if "model_tflops_per_s" not in row:
    return ""
  text = f" | {row['model_tflops_per_s']:.3g} TFLOP/s | MFU "
  if "mfu" not in row:
    return text + "n/a"
  devices = row.get("peak_devices", 1)
  return (text + f"{100 * row['mfu']:.1f}% of {row['peak_tflops']:.3g} TFLOP/s"
          + (f" x {devices}" if devices != 1 else ""))
