"""Model FLOP utilisation: the model's FLOPs per step, the device's peak, and their ratio.

::

    meter = mfu.Meter.for_run(cfg)            # peak resolved (on CPU: measured) once
    row.update(meter.row(steps=20, seconds=4.1))
    # {"model_tflops_per_s": 0.62, "mfu": 0.031, "peak_tflops": 20.1, "peak_source": "measured:cpu"}

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

The peak, per device, in this order (``peak_source`` says which):

1. ``train.peak_tflops`` (``"config"``);
2. the dense bf16 peak of the device kind (:data:`PEAK_BF16`,
   ``"table:H200"``);
3. otherwise the matmul roof measured at start (:func:`measure_matmul_roof`,
   ``"measured:cpu"``): on CPU in f32 (XLA:CPU has no fast bf16 matmul), on
   an accelerator missing from the table in bf16. A CPU has no datasheet
   peak that a matmul reaches, so its MFU is against what a large dense
   matmul achieves on the same cores; the simulated devices of
   ``JAX_NUM_CPU_DEVICES`` share them, so the roof counts once per process,
   not once per simulated device.

MFU = model FLOP/s of the whole job / (peak per device x devices).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp

from moejax.topology import accounting

# Dense (no 2:4 sparsity) bf16 peak FLOP/s per device, from the vendors' data
# sheets: NVIDIA H100 / H200 Tensor Core GPU datasheets (SXM: 989.4 TFLOPS,
# H100 PCIe: 756), NVIDIA A100 datasheet (312, SXM and PCIe), Google Cloud TPU
# system-architecture pages (v4: 275, v5e: 197, v5p: 459, v6e Trillium: 918,
# per chip; a jax device is one chip on these generations).
# (label, jax device_kind, exact, peak): exact compares the whole kind (TPU kinds,
# where "TPU v5" is a v5p but a prefix of "TPU v5 lite"), otherwise a
# substring (GPU kinds carry the memory size: "NVIDIA H100 80GB HBM3"). The
# first match wins, so a specific entry (H100 PCIe) precedes its family.
PEAK_BF16 = (
    ("H100 PCIe", "H100 PCIe", False, 756e12),
    ("H200", "H200", False, 989e12),
    ("H100", "H100", False, 989e12),
    ("A100", "A100", False, 312e12),
    ("TPU v4", "TPU v4", True, 275e12),
    ("TPU v5e", "TPU v5 lite", True, 197e12),
    ("TPU v5e", "TPU v5e", True, 197e12),
    ("TPU v5p", "TPU v5", True, 459e12),
    ("TPU v5p", "TPU v5p", True, 459e12),
    ("TPU v6e", "TPU v6 lite", True, 918e12),
    ("TPU v6e", "TPU v6e", True, 918e12),
)
ROOF_SECONDS = 0.5     # how long the start-up matmul benchmark runs
ROOF_SIZE = 512        # n of its n x n x n matmuls (CPU: a few ms each)


@dataclasses.dataclass(frozen=True)
class Peak:
  """The peak MFU is measured against.

  per_device: FLOP/s of one device; devices: how many of them the job runs
  on (a measured CPU roof: the processes, whose simulated devices share
  their host's cores); source: ``config``, ``table:<label>`` or
  ``measured:<platform>``.
  """

  per_device: float
  devices: int
  source: str

  @property
  def total(self) -> float:
    return self.per_device * self.devices


def table_peak(device_kind: str) -> Optional[tuple[str, float]]:
  """(label, bf16 FLOP/s) of ``device_kind`` in :data:`PEAK_BF16`, else None."""
  for label, kind, exact, peak in PEAK_BF16:
    if (device_kind == kind) if exact else (kind in device_kind):
      return label, peak
  return None


@functools.lru_cache(maxsize=None)
def measure_matmul_roof(dtype: str = "float32", seconds: float = ROOF_SECONDS,
                        n: int = ROOF_SIZE) -> float:
  """FLOP/s of n x n x n matmuls on the default device, best of ~``seconds`` of repeats.

  Eight chained matmuls per call amortise the dispatch; the best call is
  kept (the roof: what the device reaches, not its average under other
  load). Cached: one measurement per process, however many runs it trains.
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


def resolve_peak(peak_tflops: Optional[float] = None, device=None, *, devices: int = None,
                 processes: int = None, measure=measure_matmul_roof) -> Peak:
  """The peak of this job (module docstring's order); ``measure`` runs only when needed."""
  device = device or jax.devices()[0]
  devices = jax.device_count() if devices is None else devices
  processes = jax.process_count() if processes is None else processes
  if peak_tflops is not None:
    return Peak(float(peak_tflops) * 1e12, devices, "config")
  hit = table_peak(device.device_kind)
  if hit is not None:
    return Peak(hit[1], devices, f"table:{hit[0]}")
  if device.platform == "cpu":
    return Peak(measure("float32"), processes, "measured:cpu")
  return Peak(measure("bfloat16"), devices, f"measured:{device.platform}")


def step_flops(cfg) -> float:
  """Model FLOPs of one train step of ``cfg`` (an ExperimentConfig): 3 x fwd x B x S."""
  b = accounting.budget(cfg.model, seq_len=cfg.data.seq_len)
  return 3.0 * b.flops_per_token * cfg.data.batch_size * cfg.data.seq_len


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
  """Achieved FLOP/s (``flops`` in ``seconds``) over ``peak_flops``; 0 for no time."""
  return flops / seconds / peak_flops if seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Meter:
  """What a train row's MFU fields are computed from: FLOPs per step and the peak."""

  flops_per_step: float
  peak: Peak

  @classmethod
  def for_run(cls, cfg) -> "Meter":
    return cls(step_flops(cfg), resolve_peak(cfg.train.peak_tflops))

  def row(self, steps: int, seconds: float) -> dict:
    """``model_tflops_per_s``, ``mfu``, ``peak_tflops`` (per device), ``peak_source``.

    ``steps`` timed steps in ``seconds`` (none: the FLOP rate and MFU are 0,
    like tokens/s of a window holding only the compiling first step).
    """
    flops = self.flops_per_step * steps
    return {"model_tflops_per_s": flops / seconds / 1e12 if steps and seconds > 0 else 0.0,
            "mfu": mfu(flops, seconds, self.peak.total) if steps else 0.0,
            "peak_tflops": self.peak.per_device / 1e12, "peak_source": self.peak.source}

  def describe(self) -> str:
    """One line for the start of a run."""
    p = self.peak
    return (f"MFU against {p.per_device / 1e12:.3g} TFLOP/s x {p.devices} ({p.source}); "
            f"{self.flops_per_step / 1e9:.4g} GFLOP of model FLOPs per step "
            "(3 x forward FLOPs/token x batch x seq_len, moejax.topology.accounting)")


def progress_text(row: dict) -> str:
  """`` | 0.62 TFLOP/s | MFU 3.1%`` for the progress line (empty without the fields)."""
  if "mfu" not in row:
    return ""
  return f" | {row['model_tflops_per_s']:.3g} TFLOP/s | MFU {100 * row['mfu']:.1f}%"
