"""Routing replay in cached decoding (issue 41).

Decoding routes the new tokens of each call (the prompt, then one token per
step); a replay gives each call its tokens' recorded selection:

* decoding on a selection the router would not make equals the full
  forward on the same selection (float32, |diff| <= 2e-5, as decoding
  without replay equals the forward);
* a decode's own selections (``info['routing']``) replay it bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.model import Transformer
from moejax.routing.replay import RoutingReplay
from moejax.serve import Decoder
from tests.serve.test_decode import ATOL, moe, tiny

B, P, S = 2, 4, 8


def _sliced(replay, lo, hi):
  return {n: RoutingReplay(r.expert_ids[:, lo:hi], r.valid[:, lo:hi]) for n, r in replay.items()}


def _decode(dec, tokens, replay=None):
  """(logits f32[B, S, V], per-call selections): prefill P tokens, then one per step."""
  caches = dec.init_caches(B, S)
  pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
  cut = lambda lo, hi: None if replay is None else _sliced(replay, lo, hi)
  logits, caches, info = dec.extend(tokens[:, :P], pos[:, :P], np.ones((B, P), bool), caches,
                                    0, replay=cut(0, P))
  out, seen = [np.asarray(logits)], [info["routing"]]
  for t in range(P, S):
    logits, caches, info = dec.extend(tokens[:, t:t + 1], pos[:, t:t + 1], np.ones((B, 1), bool),
                                      caches, t, replay=cut(t, t + 1))
    out.append(np.asarray(logits))
    seen.append(info["routing"])
  return np.concatenate(out, axis=1), seen


def _joined(seen):
  names = seen[0].keys()
  return {n: RoutingReplay(jnp.concatenate([s[n]["expert_ids"] for s in seen], axis=1),
                           jnp.concatenate([s[n]["valid"] for s in seen], axis=1))
          for n in names}


def test_decoding_a_replayed_selection_equals_the_forward_on_it():
  model = Transformer(tiny(moe=moe()), rngs=nnx.Rngs(0))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (B, S), 0, 32, jnp.int32))
  own = model(jnp.asarray(tokens))[1]
  replay = {n: RoutingReplay(jnp.broadcast_to(jnp.asarray([3, 2], jnp.int32), (B, S, 2)),
                             jnp.ones((B, S, 2), bool)) for n in model.replay_layers()}
  assert any(not np.array_equal(own["moe"][n]["selection"].expert_ids, replay[n].expert_ids)
             for n in replay)
  want, aux = model(jnp.asarray(tokens), replay=replay)
  got, seen = _decode(Decoder(model), tokens, replay)
  np.testing.assert_allclose(got, np.asarray(want), atol=ATOL, rtol=0)
  for n, r in _joined(seen).items():
    np.testing.assert_array_equal(np.asarray(r.expert_ids), np.asarray(replay[n].expert_ids))


def test_a_decode_s_own_selections_replay_it_bit_for_bit():
  model = Transformer(tiny(moe=moe(routing=None, kind="topk", top_k=2)), rngs=nnx.Rngs(2))
  tokens = np.asarray(jax.random.randint(jax.random.key(3), (B, S), 0, 32, jnp.int32))
  dec = Decoder(model)
  first, seen = _decode(dec, tokens)
  again, _ = _decode(dec, tokens, _joined(seen))
  np.testing.assert_array_equal(again, first)
