"""The finetune section: one-line errors for options that make no sense, resolution, components."""

from __future__ import annotations

import json

import jax
import pytest
from flax import nnx

from moejax.config import ConfigError, apply_overrides
from moejax.config import finetune as ft_config
from moejax.model import Transformer
from moejax.train.config import experiment_from_dict, experiment_to_json
from tests.train import helpers


def tiny(**overrides):
  return helpers.experiment("tiny", **overrides)


def finetune(**options):
  pairs = {"finetune.source": "/runs/pretrained"}
  pairs.update({f"finetune.{k}": v for k, v in options.items()})
  return apply_overrides(tiny(), pairs)


def dense(**options):
  cfg = tiny(model__moe=None)
  pairs = {"finetune.source": "/runs/pretrained"}
  pairs.update({f"finetune.{k}": v for k, v in options.items()})
  return apply_overrides(cfg, pairs)


@pytest.mark.parametrize("build, match", [
    (lambda: finetune(lora=("attention",), lora_rank=0),
     r"^finetune\.lora_rank=0: LoRA adapters on \('attention',\) need a rank of at least 1\. "
     r"Fix: set finetune\.lora_rank=8"),
    (lambda: finetune(lora_rank=4),
     r"^finetune\.lora_rank=4: is ignored without finetune\.lora\. Fix:"),
    (lambda: finetune(lora=("attention",), lora_rank=4, lora_alpha=-1.0),
     r"^finetune\.lora_alpha=-1\.0: must be a finite number > 0"),
    (lambda: dense(freeze=("router",)),
     r"^finetune\.freeze=\('router',\): freezes the router, but the model has no MoE layer "
     r"\(model\.moe is None\)\. Fix: remove 'router'"),
    (lambda: dense(lora=("experts",), lora_rank=2),
     r"^finetune\.lora=\('experts',\): adapts the experts, but the model has no MoE layer"),
    (lambda: finetune(lora=("dense",), lora_rank=2),
     r"^finetune\.lora=\('dense',\): adapts the dense, but the model has no dense FFN layer"),
    (lambda: finetune(freeze=("mod",)), r"no mixture-of-depths block"),
    (lambda: finetune(freeze=("routers",)), r"^finetune\.freeze='routers': unknown value\. "
                                            r"Fix: did you mean 'router'\?"),
    (lambda: finetune(freeze=("router",), controller="on"),
     r"^finetune\.controller='on': a frozen router's bias is frozen with it"),
    (lambda: dense(controller="frozen"),
     r"^finetune\.controller='frozen': the model has no aux-loss-free bias controller"),
    (lambda: finetune(freeze=("all",)),
     r"^finetune\.freeze=\('all',\): leaves nothing to train\. Fix:"),
    (lambda: apply_overrides(tiny(), {"finetune.freeze": ("router",)}),
     r"^finetune\.freeze=\('router',\): is a fine-tuning option, but finetune\.source is empty"),
    (lambda: apply_overrides(tiny(), {"model.moe.routing.freeze": True,
                                      "finetune.source": "/runs/pretrained"}),
     r"^model\.moe\.routing\.freeze=True: freezes the router, but finetune\.freeze does not"),
])
def test_bad_option_combinations_are_one_line_errors(build, match):
  with pytest.raises(ConfigError, match=match) as err:
    build()
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("moe, kind", [
    (dict(kind="peer", topology=dict(peer_num_keys=8, peer_heads=2, peer_top_k=2,
                                     peer_key_dim=8)), "moe.kind='peer'"),
    (dict(routing=dict(kind="hash", top_k=1)), "routing.kind='hash'"),
])
def test_peer_and_hash_layers_have_no_router_to_freeze(moe, kind):
  cfg = experiment_from_dict({"model": {"d_model": 32, "n_heads": 4, "moe": moe}})
  with pytest.raises(ConfigError, match=rf"its MoE layers have no router weights \({kind}\)"):
    apply_overrides(cfg, {"finetune.source": "/x", "finetune.freeze": ("router",)})


def test_resolution_sets_the_existing_switches_and_is_idempotent():
  cfg = finetune(freeze=("router",))
  assert cfg.model.moe.routing.freeze
  assert cfg.finetune.frozen_components(cfg.model) == {"router"}
  on = finetune(controller="on")
  assert on.model.moe.balance.bias_freeze_step == -1 and not on.model.moe.routing.freeze
  frozen = finetune(controller="frozen")
  assert frozen.model.moe.balance.bias_freeze_step == 0
  for c in (cfg, on, frozen, finetune(freeze=("all",), lora=("experts",), lora_rank=2)):
    again = experiment_from_dict(json.loads(experiment_to_json(c)))
    assert again == c


def test_lora_targets_freeze_their_base_weights_and_all_freezes_everything():
  cfg = finetune(lora=("attention", "experts"), lora_rank=2)
  assert cfg.finetune.frozen_components(cfg.model) == {"attention", "experts"}
  every = finetune(freeze=("all",), lora=("attention",), lora_rank=2)
  assert every.finetune.frozen_components(every.model) >= set(ft_config.COMPONENTS)
  assert every.model.moe.routing.freeze  # 'all' freezes the router through routing.freeze
  assert every.finetune.lora_scale == 1.0
  assert finetune(lora=("attention",), lora_rank=4, lora_alpha=16.0).finetune.lora_scale == 4.0


def _components(model_cfg):
  m = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))  # shapes only
  _, params, _ = nnx.split(m, nnx.Param, ...)
  flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))
  name = lambda k: str(getattr(k, "key", k))
  return {"/".join(name(k) for k in p): ft_config.component([name(k) for k in p])
          for p, _ in flat}


def test_every_parameter_has_a_component():
  moe = tiny().model
  shared = apply_overrides(tiny(), {"model.moe.topology.num_shared_experts": 1,
                                    "model.moe_layout": "every_other", "model.mod_every": 2})
  shared_got = _components(shared.model)
  got = {**_components(moe), **shared_got}
  assert "other" not in got.values()
  assert got["blocks/0/attn/q_proj/kernel"] == "attention"
  assert got["blocks/0/attn_norm/scale"] == "norms"
  assert got["blocks/0/ffn/params/router/w"] == "router"
  assert got["blocks/0/ffn/params/experts/w_gate_up"] == "experts"
  assert got["embed/embedding"] == got["lm_head/kernel"] == "embeddings"
  assert shared_got["blocks/1/block/ffn/params/shared/w_up"] == "dense"
  assert shared_got["blocks/0/ffn/w_up/kernel"] == "dense"
  assert shared_got["blocks/1/router/kernel"] == "mod"
  assert ft_config.component(["blocks", "0", "attn", "q_proj", "lora", "lora_a"]) == "adapters"
