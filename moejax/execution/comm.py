"""Communication accounting of expert-parallel dispatch, against the analytic minimum.

Legend: T tokens on one device, K slots per token, D devices of the expert
axis, N nodes, d model width, b bytes per activation element, row = one
token vector of d * b bytes.

Per forward pass of one layer the dispatch all_to_all and the combine
all_to_all move the same rows in opposite directions, so every byte count
here is *both directions* (2 x dispatch); the backward pass repeats it.
Rows a device keeps for itself are never counted. Quantities (bytes, summed
over all devices of the mesh):

* ``wire``: what the implementation puts on the wire, padding included
  (capacity path: every remote buffer slice of the step's bucket, full or
  not; ragged path: exactly the routed rows with the native collective,
  the bucket with the emulated one).
* ``copies``: remote rows actually routed (no padding). Per-copy dispatch
  (``dispatch_unit='copy'``): one per token copy, so a token with two
  experts on one remote device counts twice; ``token``: one per token and
  remote device; ``node``: one per token and remote node across nodes plus
  the forwards inside the destination node.
* ``min_device``: the analytic minimum for the routing decisions made: each
  token sent once to every *distinct* remote device holding one of its
  experts (what a deduplicating dispatch would send).
* ``min_node``: the same with nodes: once per distinct remote node
  (DeepSeek-V3 sends across nodes once and forwards inside the node).
* ``wire_cross_node`` / ``copies_cross_node``: the part of ``wire`` /
  ``copies`` whose destination is on another node.

* ``meta`` (one direction, dispatch only): the expert ids and gate weights
  a deduplicating dispatch sends with each wire row (8 bytes per slot).

Derived: ``padding_waste`` = 1 - copies / wire, ``wire_over_min`` =
wire / min_device, ``wire_max_device`` = the most bytes one device sends
(both directions; the all_to_all waits for the busiest device).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.balance import stats

BYTE_KEYS = ("wire", "copies", "min_device", "min_node", "wire_cross_node",
             "copies_cross_node")


def _distinct(targets: jax.Array, sent: jax.Array, num: int) -> jax.Array:
  """bool[T, num]: token t sends at least one copy to target j."""
  onehot = jax.nn.one_hot(jnp.where(sent, targets, num), num + 1, dtype=jnp.bool_)
  return jnp.any(onehot, axis=1)[:, :num]


def minimum_bytes(dest: jax.Array, sent: jax.Array, me: jax.Array, node_of: np.ndarray,
                  row_bytes: int) -> dict[str, jax.Array]:
  """``min_device`` and ``min_node`` of one device (one direction), f32 scalars.

  Args:
    dest: int32[T, K] expert-axis device each slot goes to.
    sent: bool[T, K] the slot is dispatched (valid, FFN expert, not dropped).
    me: int32[] this device's expert-axis index.
    node_of: int[D] static node of each expert-axis position.
    row_bytes: d * itemsize.
  """
  d = len(node_of)
  n_nodes = int(np.max(node_of)) + 1
  node_of = jnp.asarray(node_of, jnp.int32)
  remote = jnp.arange(d) != me
  per_dev = _distinct(dest, sent, d)                          # [T, D]
  per_node = _distinct(node_of[dest], sent, n_nodes)          # [T, N]
  f = lambda v: jnp.asarray(v, jnp.float32) * row_bytes
  return {"min_device": f(jnp.sum(per_dev & remote[None, :])),
          "min_node": f(jnp.sum(per_node & (jnp.arange(n_nodes) != node_of[me])[None, :]))}


def transfer_bytes(positions: jax.Array, rows: jax.Array, wire_rows: jax.Array,
                   me: jax.Array, node_of: np.ndarray,
                   row_bytes: int) -> dict[str, jax.Array]:
  """``wire``, ``copies`` and their cross-node parts of one exchange (one direction).

  Args:
    positions: int32[G] expert-axis position of each destination of the exchange.
    rows: int32[G] rows routed to each destination (no padding).
    wire_rows: int32[G] rows put on the wire for each destination (padding included).
    me, node_of, row_bytes: as :func:`minimum_bytes`.
  """
  node_of = jnp.asarray(node_of, jnp.int32)
  remote = positions != me
  other_node = node_of[positions] != node_of[me]
  f = lambda v: jnp.asarray(v, jnp.float32) * row_bytes
  return {"wire": f(jnp.sum(jnp.where(remote, wire_rows, 0))),
          "copies": f(jnp.sum(jnp.where(remote, rows, 0))),
          "wire_cross_node": f(jnp.sum(jnp.where(other_node, wire_rows, 0))),
          "copies_cross_node": f(jnp.sum(jnp.where(other_node, rows, 0)))}


def local_dispatch_bytes(dest: jax.Array, sent: jax.Array, wire_rows: jax.Array,
                         me: jax.Array, node_of: np.ndarray,
                         row_bytes: int) -> dict[str, jax.Array]:
  """One device's bytes (one direction) for the per-copy dispatch, keyed like BYTE_KEYS.

  ``wire_rows``: int32[D] rows put in the buffer for each destination
  device; every other argument as :func:`minimum_bytes`.
  """
  d = len(node_of)
  copies_to = jnp.sum(jax.nn.one_hot(jnp.where(sent, dest, d), d + 1)[..., :d],
                      axis=(0, 1)).astype(jnp.int32)          # [D]
  out = transfer_bytes(jnp.arange(d, dtype=jnp.int32), copies_to, wire_rows, me, node_of,
                       row_bytes)
  out.update(minimum_bytes(dest, sent, me, node_of, row_bytes))
  return out


def summarize(local: dict[str, jax.Array], axis_names: Sequence[str]) -> dict[str, jax.Array]:
  """Mesh totals of both directions plus the derived ratios (f32 scalars)."""
  axis_names = tuple(axis_names)
  out = {k: 2.0 * stats.psum(local[k], axis_names) for k in BYTE_KEYS}
  # Expert ids and gate weights travel with the rows of a deduplicating
  # dispatch, one way only.
  out["meta"] = stats.psum(jnp.asarray(local.get("meta", 0.0), jnp.float32), axis_names)
  out["wire_max_device"] = 2.0 * (jax.lax.pmax(local["wire"], axis_names) if axis_names
                                  else local["wire"])
  out["padding_waste"] = jnp.where(out["wire"] > 0,
                                   1.0 - out["copies"] / jnp.maximum(out["wire"], 1.0), 0.0)
  out["wire_over_min"] = jnp.where(out["min_device"] > 0,
                                   out["wire"] / jnp.maximum(out["min_device"], 1.0), 0.0)
  return out


def analytic_bytes(dest, sent, node_of, row_bytes: int, unit: str = "copy") -> dict[str, float]:
  """Host-side (numpy) ``copies``, ``min_device``, ``min_node`` and cross-node copies.

  Args:
    dest: int[G, D, T, K] expert-axis device of every slot, for G data/fsdp
      groups of D devices with T tokens each (a group's devices exchange
      tokens with each other only).
    sent: bool[G, D, T, K].
    node_of: int[D] (for ``unit='node'``: N equal nodes of consecutive positions).
    unit: the dispatch unit whose ``copies`` to count: ``copy`` (one row per
      remote copy), ``token`` (one per distinct remote device), ``node``
      (one per distinct remote node, landing on the device with the
      source's index in that node, plus one per further device of the node
      the token is forwarded to).
  Returns both directions, summed over the mesh, like :func:`summarize`.
  """
  dest, sent, node_of = np.asarray(dest), np.asarray(sent, bool), np.asarray(node_of)
  g, d, t, k = dest.shape
  per_node = int(np.sum(node_of == node_of[0]))
  out = dict.fromkeys(("copies", "min_device", "min_node", "copies_cross_node"), 0.0)
  for gi in range(g):
    for src in range(d):
      for tok in range(t):
        devs = dest[gi, src, tok][sent[gi, src, tok]]
        remote = devs[devs != src]
        distinct = sorted(set(remote.tolist()))
        nodes = node_of[devs]
        far = sorted(set(nodes[nodes != node_of[src]].tolist()))
        out["min_device"] += len(distinct)
        out["min_node"] += len(far)
        if unit == "copy":
          out["copies"] += len(remote)
          out["copies_cross_node"] += int(np.sum(node_of[remote] != node_of[src]))
        elif unit == "token":
          out["copies"] += len(distinct)
          out["copies_cross_node"] += sum(node_of[j] != node_of[src] for j in distinct)
        else:  # node: cross once per node, then forward from the peer inside it
          out["copies_cross_node"] += len(far)
          forwards = 0
          for n in set(nodes.tolist()):
            landing = src if n == node_of[src] else n * per_node + src % per_node
            forwards += len(set(devs[nodes == n].tolist()) - {landing})
          out["copies"] += len(far) + forwards
  return {key: 2.0 * row_bytes * v for key, v in out.items()}
