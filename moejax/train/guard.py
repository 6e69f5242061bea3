"""The NaN / inf guard: what the loop checks before it saves, and after it restores, a state.

A run must never call a non-finite state "the last good checkpoint". Three
checks, each cheap:

- :func:`check_rows`: every step's ``loss`` and ``grad_norm`` (host floats,
  read back at each log / eval / checkpoint step). A finite loss can come
  with a NaN gradient norm (a huge learning rate: the update that follows is
  NaN), so both are checked.
- :func:`nonfinite_leaves`: one jitted all-finite reduction per floating leaf
  of a state tree (params, optimizer moments, router bias, ...), stacked and
  read back once; it names the leaves that hold a NaN or inf. The loop runs
  it on the whole TrainState before every checkpoint and on every restored
  checkpoint, so the router state (moved by the bias controller, not by the
  gradients) is covered too.

:class:`NonFiniteError` is raised by the loop with the step, what was not
finite, and the newest checkpoint on disk (which passed this guard).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax.tree_util import keystr
import jax.numpy as jnp
import numpy as np

ROW_KEYS = ("loss", "grad_norm")   # per-step host metrics that must be finite


class NonFiniteError(FloatingPointError):
  """A loss, gradient norm or state leaf became NaN / inf; nothing after it was saved."""


def first_nonfinite_row(rows: Sequence[dict], first_step: int):
  """(step, key, row) of the first row whose loss or grad norm is not finite, else None."""
  for i, row in enumerate(rows):
    for key in ROW_KEYS:
      if key in row and not math.isfinite(row[key]):
        return first_step + i, key, row
  return None


@jax.jit
def _finite_flags(leaves: list) -> jax.Array:
  """bool[n]: leaf i holds only finite values."""
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_leaves(tree: Any) -> list[str]:
  """Paths (``params/blocks/0/...``) of the floating leaves holding a NaN or inf.

  Integer leaves (steps, PRNG key data, counters) cannot be non-finite and are
  skipped. One device round trip for the whole tree.
  """
  flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
          if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not flat:
    return []
  flags = np.asarray(jax.device_get(_finite_flags([x for _, x in flat])))
  return [keystr(p, simple=True, separator="/") for (p, _), ok in zip(flat, flags) if not ok]


def describe(paths: Sequence[str], limit: int = 3) -> str:
  """``params: 23 leaves (blocks/0/attn/k_proj/kernel, ...); router_state: 1 leaf (...)``."""
  groups: dict[str, list[str]] = {}
  for p in paths:
    head, _, rest = p.partition("/")
    groups.setdefault(head, []).append(rest or head)
  parts = []
  for head, rests in groups.items():
    shown = ", ".join(rests[:limit]) + (", ..." if len(rests) > limit else "")
    parts.append(f"{head}: {len(rests)} leaf{'' if len(rests) == 1 else 's'} ({shown})")
  return "; ".join(parts)
