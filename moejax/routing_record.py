"""Routing recordings: the per-layer expert selection of chosen batches, in one small file.

Legend: B sequences, S tokens per sequence, K slots per token, E_r router
outputs of a MoE layer.

A forward of :class:`~moejax.model.Transformer` already returns each routed
layer's selection before capacity (``aux['moe'][name]['selection']``, a
:class:`~moejax.routing.replay.RoutingReplay` [B, S, K]); :func:`selections`
collects them. :func:`write_recording` stores them with the tokens'
identities (the token ids and each sequence's index in the caller's batch
stream) as one ``.npz``: per layer ``<layer>/expert_ids`` (int16 when E_r
fits, else int32) and ``<layer>/valid`` (bits, ``np.packbits``).
:func:`read_recording` reads one back and refuses, in one line, a file
whose layers, K, expert ids or shapes do not fit a model config;
:meth:`Recording.replay` is the ``replay=`` argument of the model's forward
(and of a train step's batch).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig
from moejax.routing.replay import RoutingReplay

FORMAT = "moejax.routing_record/1"


def selections(aux: dict) -> dict[str, RoutingReplay]:
  """``{'layer_<i>': RoutingReplay [B, S, K]}`` of a model forward's aux (routed layers)."""
  return {name: layer["selection"] for name, layer in aux["moe"].items() if "selection" in layer}


def replay_layers(cfg: ModelConfig) -> dict[str, int]:
  """``{'layer_<i>': K}``: the layers a replay of ``cfg``'s model covers and their slots."""
  moe = cfg.moe
  if moe is None or not moe.layer.routed:
    return {}
  k = moe.router.result_k(moe)
  return {f"layer_{i}": k for i in range(cfg.n_layers)
          if cfg.is_moe_layer(i) and not cfg.is_mod_layer(i)}


@dataclasses.dataclass(frozen=True)
class Recording:
  """A routing recording read back: numpy arrays, checked against a config.

  Attributes:
    layers: ``{'layer_<i>': RoutingReplay}`` int32 expert ids / bool valid [B, S, K].
    tokens: int32[B, S] the token ids the selection was made on.
    batch_index: int64[B] each sequence's index in the batch stream it came from.
  """

  layers: Mapping[str, RoutingReplay]
  tokens: np.ndarray
  batch_index: np.ndarray

  def replay(self, rows: Optional[np.ndarray] = None,
             tokens: Optional[np.ndarray] = None) -> dict[str, RoutingReplay]:
    """The model's ``replay=`` argument (jax arrays), of every row or of ``rows``.

    ``tokens``: the int[B, S] batch it will replay on; refused in one line
    unless they are the recorded tokens (of ``rows``).
    """
    take = (lambda a: a) if rows is None else (lambda a: a[np.asarray(rows)])
    if tokens is not None:
      want, got = take(self.tokens), np.asarray(tokens)
      if want.shape != got.shape or not np.array_equal(want, got):
        bad = (f"shape {got.shape}, recorded {want.shape}" if want.shape != got.shape else
               "token [{}, {}]".format(*np.argwhere(want != got)[0]))
        raise ValueError(f"routing recording: the batch to replay on differs from the recorded "
                         f"tokens ({bad}). Fix: replay on the recorded batch (Recording.tokens, "
                         "rows by batch_index)")
    return {n: RoutingReplay(jnp.asarray(take(r.expert_ids)), jnp.asarray(take(r.valid)))
            for n, r in self.layers.items()}


def write_recording(path: str, layers: Mapping[str, RoutingReplay], *, tokens,
                    batch_index, cfg: ModelConfig) -> str:
  """Writes ``layers`` (e.g. :func:`selections` of a forward) of ``tokens`` to ``path`` (.npz).

  ``batch_index``: int[B], which sequences of the run's batches these are.
  Checked against ``cfg`` before anything is written; the file appears
  whole (written aside, then renamed). Returns the path.
  """
  tokens = np.asarray(tokens, np.int32)
  batch_index = np.asarray(batch_index, np.int64)
  host = {n: RoutingReplay(np.asarray(r.expert_ids), np.asarray(r.valid, bool))
          for n, r in layers.items()}
  _check(host, tokens, batch_index, cfg, where=f"write_recording({path!r})")
  id_dtype = np.int16 if cfg.moe.num_routed <= np.iinfo(np.int16).max else np.int32
  out = {"format": np.asarray(FORMAT), "tokens": tokens, "batch_index": batch_index,
         "layers": np.asarray(sorted(host))}
  for name, r in host.items():
    out[f"{name}/expert_ids"] = r.expert_ids.astype(id_dtype)
    out[f"{name}/valid"] = np.packbits(r.valid.reshape(-1))
  tmp = f"{path}.tmp.npz"
  with open(tmp, "wb") as f:
    np.savez_compressed(f, **out)
  os.replace(tmp, path)
  return path


def read_recording(path: str, cfg: ModelConfig) -> Recording:
  """The recording at ``path``, refused in one line unless it fits a model of ``cfg``."""
  where = f"read_recording({path!r})"
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{where}: no such file. Fix: pass the .npz write_recording wrote")
  with np.load(path, allow_pickle=False) as z:
    fmt = str(z["format"]) if "format" in z.files else None
    if fmt != FORMAT:
      raise ValueError(f"{where}: format={fmt!r}, expected {FORMAT!r}. Fix: record it again "
                       "with moejax.routing_record.write_recording")
    tokens, batch_index = z["tokens"].astype(np.int32), z["batch_index"].astype(np.int64)
    layers = {}
    for name in (str(n) for n in z["layers"]):
      ids = z[f"{name}/expert_ids"].astype(np.int32)
      bits = np.unpackbits(z[f"{name}/valid"], count=ids.size).astype(bool)
      layers[name] = RoutingReplay(ids, bits.reshape(ids.shape))
  _check(layers, tokens, batch_index, cfg, where=where)
  return Recording(layers=layers, tokens=tokens, batch_index=batch_index)


def _check(layers, tokens, batch_index, cfg: ModelConfig, *, where: str) -> None:
  """One ValueError line naming the first field of the recording that does not fit ``cfg``."""
  want = replay_layers(cfg)
  if not want:
    raise ValueError(f"{where}: the model config has no routed MoE layer outside "
                     "mixture-of-depths blocks, nothing to record or replay. Fix: use the "
                     "config of the model the recording belongs to")
  if sorted(layers) != sorted(want):
    raise ValueError(f"{where}: layers={sorted(layers)}, the config routes {sorted(want)} "
                     f"(model.n_layers={cfg.n_layers}). Fix: use the recording of a model of "
                     "this config")
  if tokens.ndim != 2:
    raise ValueError(f"{where}: tokens has shape {tokens.shape}; expected [B, S]. Fix: pass the "
                     "int[B, S] token ids of the recorded batch")
  if batch_index.shape != tokens.shape[:1]:
    raise ValueError(f"{where}: batch_index has shape {batch_index.shape}, tokens "
                     f"{tokens.shape}. Fix: pass one index per sequence")
  e = cfg.moe.num_routed
  for name in sorted(layers):
    r, shape = layers[name], tokens.shape + (want[name],)
    for field in ("expert_ids", "valid"):
      if tuple(getattr(r, field).shape) != shape:
        raise ValueError(
            f"{where}: {name}.{field} has shape {tuple(getattr(r, field).shape)}, expected "
            f"{shape} (tokens {tokens.shape}, K={want[name]} of moe.routing.kind="
            f"{cfg.moe.routing.kind!r}). Fix: use the recording of a model of this config")
    if r.expert_ids.size and (r.expert_ids.min() < 0 or r.expert_ids.max() >= e):
      raise ValueError(
          f"{where}: {name}.expert_ids span [{r.expert_ids.min()}, {r.expert_ids.max()}], the "
          f"config has {e} router outputs (moe.topology.num_experts={cfg.moe.num_experts}). "
          "Fix: use the recording of a model of this config")
