"""Generation: a batch of prompts in, sampled continuations out.

Legend: B batch (prompts), P prompt slots (longest prompt), N new tokens.

Padding: prompts are **left-padded** to the longest one. Every row then
ends its prompt at slot P - 1 and writes decode step t at slot P + t, so
all rows advance through the cache together (one scalar write index, one
``dynamic_update_slice``); rotary positions are per row (a row of length n
has positions 0 .. n-1 at slots P-n .. P-1) and pad slots are never marked
valid in the cache, so each row computes exactly what it would alone.
Rows are independent in every layer (attention is per row, decoding is
dropless), so the batch composition never changes a row's tokens.

A row stops at the tokenizer's stop token (byte 0, the document separator,
for byte-level models); the batch stops when every row has stopped or after
``max_new_tokens``. Stopped rows keep being computed (static shapes) and
their later tokens are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

from moejax.serve import sampling as sampling_lib
from moejax.serve.decode import Decoder


@dataclasses.dataclass
class Generation:
  """tokens: the new tokens of each prompt (the stop token excluded);
  stopped: whether that row emitted the stop token; prefill_s / decode_s:
  wall time of the prefill call and of the decode loop (compiles included
  on a first call); steps: decode steps run."""

  tokens: list
  stopped: list
  prompt_lengths: list
  prefill_s: float
  decode_s: float
  steps: int


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0,
             multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32[B, P], lengths int32[B]): prompts right-aligned, P rounded up to ``multiple``.

  Rounding P up lets prompts of nearby lengths share one compiled prefill.
  """
  if not prompts:
    raise ValueError("generate: no prompts. Fix: pass at least one token sequence")
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  if lengths.min() == 0:
    raise ValueError(f"generate: prompt {int(np.argmin(lengths))} is empty. Fix: give every "
                     "prompt at least one token (byte-level prompts start with the separator)")
  p = int(-(-lengths.max() // multiple) * multiple)
  tokens = np.full((len(prompts), p), pad_id, np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, p - len(prompt):] = np.asarray(prompt, np.int32)
  return tokens, lengths


def prefill_inputs(lengths: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
  """(positions int32[B, P], write bool[B, P]) of a left-padded batch."""
  pad = (p - lengths)[:, None]
  slots = np.arange(p, dtype=np.int32)[None, :]
  return np.maximum(slots - pad, 0).astype(np.int32), slots >= pad


def load_run(workdir: str, step: Optional[int] = None):
  """(ExperimentConfig, model, step) of a training run's workdir (the latest checkpoint).

  Params and router state restored with :func:`moejax.load`.
  """
  import os

  from moejax.train import load as load_lib
  from moejax.train.checkpoint import CONFIG_FILE

  if not os.path.exists(os.path.join(workdir, CONFIG_FILE)):
    raise FileNotFoundError(f"--workdir={workdir} has no {CONFIG_FILE}. Fix: pass the "
                            "directory of a run made by experiments.train")
  cfg = load_lib.run_config(workdir)
  model, step = load_lib.model_at(cfg, workdir, step)
  return cfg, model, step


@functools.partial(jax.jit, static_argnums=2)
def _sample(logits, key, cfg):
  return sampling_lib.sample(logits, key, cfg)


def generate(model: nnx.Module | Decoder, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int,
             sampling: sampling_lib.SamplingConfig = sampling_lib.SamplingConfig(),
             seed: int = 0, stop_id: Optional[int] = None, pad_multiple: int = 1) -> Generation:
  """Samples up to ``max_new_tokens`` after each prompt (token ids; see module docstring).

  Args:
    model: a Transformer or a :class:`Decoder` (reuse one to keep compiles).
    prompts: B token sequences (e.g. ``Tokenizer.encode(text)``).
    max_new_tokens: N >= 1.
    sampling: greedy (default), temperature, top-k, top-p.
    seed: PRNG seed of the draws (step t uses fold_in(key(seed), t)).
    stop_id: a row stops after emitting this token (None: never).
    pad_multiple: round the prompt slots P up to a multiple of this.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
  dec = model if isinstance(model, Decoder) else Decoder(model)
  tokens, lengths = left_pad(prompts, multiple=pad_multiple)
  b, p = tokens.shape
  positions, write = prefill_inputs(lengths, p)
  caches = dec.init_caches(b, p + max_new_tokens)
  key = jax.random.key(seed)

  t0 = time.perf_counter()
  logits, caches, _ = dec.extend(tokens, positions, write, caches, 0, last_only=True)
  nxt = _sample(logits[:, -1], jax.random.fold_in(key, 0), sampling)
  nxt = np.asarray(nxt)
  t1 = time.perf_counter()

  out, done = [nxt], (nxt == stop_id) if stop_id is not None else np.zeros(b, bool)
  pos, steps = lengths.copy(), 0
  ones = np.ones((b, 1), bool)
  while len(out) < max_new_tokens and not done.all():
    logits, caches, _ = dec.extend(nxt[:, None], pos[:, None], ones, caches, p + steps,
                                   last_only=True)
    steps += 1
    pos = pos + 1
    nxt = np.asarray(_sample(logits[:, -1], jax.random.fold_in(key, steps), sampling))
    out.append(nxt)
    if stop_id is not None:
      done |= nxt == stop_id
  t2 = time.perf_counter()

  seqs, stopped = [], []
  for row in np.stack(out, axis=1).tolist():
    if stop_id is not None and stop_id in row:
      seqs.append(row[: row.index(stop_id)])
      stopped.append(True)
    else:
      seqs.append(row)
      stopped.append(False)
  return Generation(tokens=seqs, stopped=stopped, prompt_lengths=lengths.tolist(),
                    prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps)
