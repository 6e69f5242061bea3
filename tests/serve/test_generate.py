"""Generation over a left-padded batch (moejax.serve.generate)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ModelConfig, MoEConfig, RoutingConfig
from moejax.model import Transformer
from moejax.serve import Decoder, SamplingConfig, generate, left_pad
from moejax.serve.generate import prefill_inputs
from tests.configs import moe_config

V = 32
N = 6


@pytest.fixture(scope="module")
def model():
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    dense_ff_width=64,
                    moe=moe_config(num_experts=4, expert_width=16, backend="blocked",
                                  routing=RoutingConfig(top_k=2)))
  return Transformer(cfg, rngs=nnx.Rngs(0))


def test_left_pad_by_hand():
  tokens, lengths = left_pad([[5, 6, 7], [9]], pad_id=0, multiple=4)
  np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 9]])
  np.testing.assert_array_equal(lengths, [3, 1])
  positions, write = prefill_inputs(lengths, 4)
  np.testing.assert_array_equal(positions, [[0, 0, 1, 2], [0, 0, 0, 0]])
  np.testing.assert_array_equal(write, [[0, 1, 1, 1], [0, 0, 0, 1]])
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    left_pad([[1], []])


_FULL_FORWARD = nnx.jit(lambda m, t: m(t)[0])
_NAIVE_LENGTH = 16


def _naive_greedy(model, prompt, n):
  """Argmax continuation by re-running the full forward on the growing sequence.

  The sequence is right-padded to one fixed length, so every step reuses one
  compiled forward: attention is causal and this MoE routes each token on its
  own (top-k, dropless), so the logits at the last real position do not see
  the padding.
  """
  seq = list(prompt)
  assert len(seq) + n <= _NAIVE_LENGTH
  for _ in range(n):
    padded = seq + [0] * (_NAIVE_LENGTH - len(seq))
    logits = _FULL_FORWARD(model, jnp.asarray([padded], jnp.int32))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


def test_greedy_batch_equals_each_prompt_alone_and_the_uncached_loop(model):
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  dec = Decoder(model)
  batch = generate(dec, prompts, max_new_tokens=N)
  assert batch.steps == N - 1 and batch.prompt_lengths == [5, 2]
  for i, prompt in enumerate(prompts):
    alone = generate(dec, [prompt], max_new_tokens=N)
    assert batch.tokens[i] == alone.tokens[0] == _naive_greedy(model, prompt, N)


def test_stop_token_ends_a_row(model):
  dec = Decoder(model)
  free = generate(dec, [[1, 2, 3], [7, 8]], max_new_tokens=N)
  stop = free.tokens[0][2]
  out = generate(dec, [[1, 2, 3], [7, 8]], max_new_tokens=N, stop_id=stop)
  assert out.tokens[0] == free.tokens[0][:free.tokens[0].index(stop)] and out.stopped[0]
  row1 = free.tokens[1]
  assert out.tokens[1] == (row1[:row1.index(stop)] if stop in row1 else row1)


def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy(model):
  dec = Decoder(model)
  hot = SamplingConfig(temperature=1.5)
  a = generate(dec, [[1, 2, 3]], max_new_tokens=N, sampling=hot, seed=3)
  b = generate(dec, [[1, 2, 3]], max_new_tokens=N, sampling=hot, seed=3)
  assert a.tokens == b.tokens
  others = {tuple(generate(dec, [[1, 2, 3]], max_new_tokens=N, sampling=hot, seed=s).tokens[0])
            for s in range(4)}
  assert len(others) > 1  # temperature 1.5 over 32 tokens does vary
  nucleus = generate(dec, [[1, 2, 3]], max_new_tokens=N,
                     sampling=SamplingConfig(temperature=1.0, top_p=1e-6), seed=5)
  assert nucleus.tokens == generate(dec, [[1, 2, 3]], max_new_tokens=N).tokens
