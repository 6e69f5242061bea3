"""The causal-leakage probe: expert choice peeks at the future, token choice does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from moejax.config import ModelConfig, MoEConfig, RoutingConfig
from moejax.evaluate.leakage import LeakageProbe, causal_leakage
from moejax.model import Transformer
from tests.configs import moe_config

B, S = 4, 6


def _model(kind: str) -> Transformer:
  router = RoutingConfig.build(kind=kind, top_k=2,
                               **(dict(capacity=1.0) if kind == "expert_choice" else {}))
  cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, dense_ff_width=32,
                    moe=moe_config(num_experts=4, expert_width=16, routing=router))
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _tokens():
  # Random tokens: the model can only fit them by memorising, through every
  # path including the experts, so routing that changes costs loss.
  return jax.random.randint(jax.random.key(1), (B, S + 1), 0, 16, jnp.int32)


def _train(model, tokens, steps=40):
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    def loss_fn(model):
      logits, aux = model(tokens[:, :-1], train=True)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      return ce + aux["loss"]
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  for _ in range(steps):
    step(model, opt)
  return model


@pytest.fixture(scope="module")
def topk_probe():
  return LeakageProbe(_model("topk"))


def test_token_choice_has_no_leakage(topk_probe):
  tokens = _tokens()
  r = topk_probe(tokens[:, :-1], tokens[:, 1:])
  assert r["max_logit_diff"] < 1e-4, r
  assert abs(r["gap"]) < 1e-5, r


def test_expert_choice_leaks_and_causal_evaluation_is_worse():
  tokens = _tokens()
  model = _train(_model("expert_choice"), tokens)
  r = causal_leakage(model, tokens[:, :-1], tokens[:, 1:])
  assert r["max_logit_diff"] > 1e-2, r
  # Fitted with whole-chunk routing (which peeks), the model loses when it
  # is routed on prefixes only, as it would be when generating.
  assert r["gap"] > 1e-3, r


def test_probe_over_batches_weights_by_tokens_and_respects_the_mask(topk_probe):
  tokens = _tokens()
  mask = jnp.ones((B, S), bool).at[:, 4:].set(False)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}
  one = topk_probe(batch["inputs"], batch["targets"], mask)
  over = topk_probe.over([batch, batch, batch], num_batches=2, max_len=S)
  assert over["tokens"] == 2 * B * 4
  assert over["chunk_loss"] == pytest.approx(one["chunk_loss"])
  assert one["chunk_loss"] != pytest.approx(topk_probe(batch["inputs"], batch["targets"])["chunk_loss"])
  with pytest.raises(ValueError, match="same"):
    topk_probe(tokens[:, :-1], tokens[:, :3])
