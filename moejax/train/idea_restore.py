"""Checkpoints written before an idea declared state: that state starts from its initial value.

An idea's state (:mod:`moejax.routing.state`) is stored in the router state
at ``router_state/.../ideas/<idea>/<field>``. A checkpoint written before the
idea declared it (a plugin rule that later gained an EMA) has no such
leaves; everything else in it is the run's. Restoring reads the checkpoint
without them and adds each from its initial value, as the config declares
it (:func:`initial`), and says so in one line. Any other array the
checkpoint lacks is still a model mismatch.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from moejax.routing import state as state_lib
from moejax.train import notes

IDEAS = "/ideas/"
_GONE = object()


def absent(want: dict, have: dict) -> set[str]:
  """The idea-state paths of ``want`` ({path: shape}) that ``have`` lacks."""
  return {k for k in want if k not in have and k.startswith("router_state/") and IDEAS in k}


def initial(cfg) -> Callable[[str], Any]:
  """path -> the initial value of an idea-state leaf of ``cfg`` (an ExperimentConfig)."""
  moe = cfg.model.moe
  first = state_lib.init(moe) if moe is not None else {}

  def fill(path: str):
    idea, field = path.split(IDEAS, 1)[1].split("/", 1)
    return first[idea][field]
  return fill


def _walk(tree, prefix: str, paths: set[str], leaf: Callable):
  if not isinstance(tree, dict):
    return leaf(tree, prefix)
  out = {}
  for k, v in tree.items():
    sub = _walk(v, f"{prefix}/{k}" if prefix else str(k), paths, leaf)
    if sub is not _GONE:
      out[k] = sub
  return _GONE if tree and not out else out  # a dict emptied by pruning goes too


def without(tree, paths: set[str]):
  """``tree`` (nested dicts) without the leaves at ``paths``."""
  if not paths:
    return tree
  return _walk(tree, "", paths, lambda v, p: _GONE if p in paths else v)


def graft(restored, abstract, paths: set[str], fill: Optional[Callable[[str], Any]],
          where: str, once: Optional[str] = None):
  """``restored`` with the leaves at ``paths`` added from ``fill``, placed like ``abstract``'s;
  says so in one line, once per process for the key ``once`` (None: every time)."""
  if not paths:
    return restored
  if fill is None:
    raise ValueError(f"{where} has no {sorted(paths)[0]} (and {len(paths) - 1} more idea-state "
                     "arrays): written before the idea declared state. Fix: restore with "
                     "fill=moejax.train.idea_restore.initial(cfg)")
  flat = dict(_paths(abstract))
  # Parents that pruning removed are rebuilt from the abstract tree's structure.
  merged = _rebuild(abstract, restored, "", paths, flat, fill)
  ideas = sorted({p.split(IDEAS, 1)[1].split("/", 1)[0] for p in paths})
  if jax.process_index() == 0 and notes.first_time("grafted", once):
    print(f"note: {where} has no state for {', '.join(ideas)} (written before it declared "
          "state): it starts from its initial value", file=sys.stderr)
  return merged


def _rebuild(abstract, restored, prefix, paths, flat, fill):
  """``abstract``'s dict structure with ``restored``'s subtrees, and ``fill``'s at ``paths``."""
  if prefix in paths:
    want = flat[prefix]
    value = jnp.asarray(fill(prefix), want.dtype).reshape(want.shape)
    sharding = getattr(want, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else value
  if not isinstance(abstract, dict):
    return restored
  return {k: _rebuild(v, restored.get(k) if isinstance(restored, dict) else None,
                      f"{prefix}/{k}" if prefix else str(k), paths, flat, fill)
          for k, v in abstract.items()}


def _paths(tree):
  return [(jax.tree_util.keystr(p, simple=True, separator="/"), x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
