"""Checkpoints of the earlier routed-expert layout: 'w_gate' and 'w_up' joined on restore.

A gated expert stack is stored as one 'w_gate_up' [E, d, 2f] (gate and up
side by side: :mod:`moejax.topology.experts`). Checkpoints written before
that hold two arrays 'w_gate' and 'w_up' [E, d, f] in its place, in the
params and in every optimizer-state tree that mirrors them (AdamW's
moments [E, d, f] each; Muon's momentum, kept per output block as
[E, d, 2, f]). Restoring reads those two arrays where the model has the
one, joins them (side by side on the last axis, or stacked on the block
axis when the model's array has one) and says so in one line. The
checkpoint's checksums describe what was saved, so verification reads the
restored tree split back (:func:`as_saved`, exact: joining and slicing move
no bits).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from moejax.topology import experts as experts_lib
from moejax.train import notes

GATE_UP = experts_lib.GATE_UP
HALVES = ("w_gate", "w_up")


def _stacked(half: tuple, want: tuple) -> bool:
  """Whether the model's array ``want`` holds two ``half`` arrays on a block axis."""
  return len(half) >= 1 and want == half[:-1] + (2,) + half[-1:]


def _joins(gate: tuple, up: tuple, want: tuple) -> bool:
  return gate == up and len(gate) >= 1 and (
      want == gate[:-1] + (2 * gate[-1],) or _stacked(gate, want))


def legacy_pairs(want: Mapping[str, tuple], have: Mapping[str, tuple]) -> dict:
  """{path of a model's 'w_gate_up' leaf: (gate shape, up shape)} for each one the checkpoint
  (``have``, {path: shape}) stores as its two halves instead."""
  out = {}
  for path, shape in want.items():
    head, _, leaf = path.rpartition("/")
    if leaf != GATE_UP or path in have:
      continue
    gate, up = (f"{head}/{h}" for h in HALVES)
    if gate in have and up in have and gate not in want and up not in want and _joins(
        have[gate], have[up], tuple(shape)):
      out[path] = (have[gate], have[up])
  return out


def converted_paths(pairs: Mapping[str, Any]) -> set:
  """Every path a conversion accounts for: the model's 'w_gate_up' and the stored halves."""
  out = set(pairs)
  for path in pairs:
    head = path.rpartition("/")[0]
    out |= {f"{head}/{h}" for h in HALVES}
  return out


def _map_dicts(tree, pairs, fn, has):
  """``tree`` with ``fn(dict, path of its 'w_gate_up')`` applied to each dict holding ``has``
  whose 'w_gate_up' path is one of ``pairs`` (any pytree around them: optax states too)."""
  is_target = lambda x: isinstance(x, dict) and has(x)  # noqa: E731

  def visit(path, node):
    if not is_target(node):
      return node
    where = jax.tree_util.keystr(path, simple=True, separator="/")
    key = f"{where}/{GATE_UP}" if where else GATE_UP
    return fn(node, key) if key in pairs else node
  return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=is_target)


def legacy_target(abstract: Any, pairs: Mapping[str, tuple]) -> Any:
  """``abstract`` with each converted 'w_gate_up' replaced by the two stored halves."""
  if not pairs:
    return abstract

  def split(node, key):
    want = node[GATE_UP]
    out = {k: v for k, v in node.items() if k != GATE_UP}
    for name, shape in zip(HALVES, pairs[key]):
      out[name] = jax.ShapeDtypeStruct(shape, want.dtype,
                                       sharding=getattr(want, "sharding", None))
    return out
  return _map_dicts(abstract, pairs, split, lambda d: GATE_UP in d)


def join(restored: Any, abstract: Any, pairs: Mapping[str, tuple], where: str,
         once: Optional[str] = None) -> Any:
  """``restored`` (read with :func:`legacy_target`) with each pair of halves joined into
  'w_gate_up', placed like ``abstract``'s; says so in one line, once per process for the
  key ``once`` (the checkpoint's directory; None: every time)."""
  if not pairs:
    return restored
  wants = {}
  _map_dicts(abstract, pairs, lambda node, key: wants.setdefault(key, node[GATE_UP]),
             lambda d: GATE_UP in d)

  def fuse(node, key):
    want, (gate, up) = wants[key], (node[h] for h in HALVES)
    value = (jnp.stack([gate, up], axis=-2) if _stacked(tuple(gate.shape), tuple(want.shape))
             else experts_lib.fuse_gate_up(gate, up))
    sharding = getattr(want, "sharding", None)
    out = {k: v for k, v in node.items() if k not in HALVES}
    out[GATE_UP] = jax.device_put(value, sharding) if sharding is not None else value
    return out
  merged = _map_dicts(restored, pairs, fuse, lambda d: all(h in d for h in HALVES))
  if jax.process_index() == 0 and notes.first_time("joined", once):
    print(f"note: {where} stores the routed experts' w_gate and w_up apart (the layout "
          f"before w_gate_up): joined into w_gate_up ({len(pairs)} arrays)", file=sys.stderr)
  return merged


def as_saved(tree: Any, pairs: Mapping[str, tuple]) -> Any:
  """``tree`` with each converted 'w_gate_up' split back into the stored halves."""
  if not pairs:
    return tree

  def split(node, key):
    value = node[GATE_UP]
    if _stacked(pairs[key][0], tuple(value.shape)):
      halves = (value[..., 0, :], value[..., 1, :])
    else:
      halves = experts_lib.split_gate_up(value)
    out = {k: v for k, v in node.items() if k != GATE_UP}
    out.update(zip(HALVES, halves))
    return out
  return _map_dicts(tree, pairs, split, lambda d: GATE_UP in d)
