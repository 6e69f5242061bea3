"""What every device-check step works from: the plan of sizes, and failures as records."""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Callable

import jax.numpy as jnp

BF16 = jnp.bfloat16


@dataclasses.dataclass
class Plan:
  """What runs where, and at which sizes."""

  platform: str
  dry_run: bool
  kernels: tuple[str, ...]              # moejax gmm backends checked
  options: dict[str, dict]              # their keyword arguments (tiling, interpret)
  peers: tuple[str, ...]                # megablox / tokamax / jax_mgpu
  gathers: tuple[str, ...]              # permute gather backends besides xla
  repeats: int
  inner: int                            # calls per timed repeat
  check_m: int
  check_kn: tuple[int, int]
  gmm_shape: tuple[int, int, int, int]  # m, k, n, G
  sweep: tuple[tuple[int, int, int], ...]
  gather_shape: tuple[int, int, int]    # T, K, d
  layer_td: tuple[int, int]
  layer_shapes: dict[str, dict]
  train_steps: int
  train_small: dict                     # overrides of the default config
  train_backend: str


def failure(e: BaseException) -> dict:
  """The error and the last frames of its traceback, for the JSON."""
  frames = traceback.format_exception(type(e), e, e.__traceback__)
  tail = "".join(frames).strip().splitlines()[-12:]
  return {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:500]}",
          "traceback": tail}


def guarded(fn: Callable[[], Any]) -> Any:
  """fn() or a failure record: one failing variant does not end its step."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001 - recorded, the step goes on
    return failure(e)
