"""Fine-tuning an MoE: router frozen or not, in-domain or new domain; generic LoRA vs expert LoRA.

The seeds' practitioner claims (see docs/finetune.md): freezing the router
keeps the learned expert specialisation for in-distribution fine-tuning,
unfreezing it pays off for a genuinely new domain; generic LoRA tooling
adapts attention and dense layers and "will not touch the experts", and
MoE-specific LoRA (per-expert adapters) is not standard tooling yet.

Source (``suite.source``, trained first, once per seed): the small suite
model with DeepSeek-V3 routing (sigmoid scores, the aux-loss-free bias and
its sign controller), pre-trained 300 steps with only *code and string*
targets in the loss (``data.loss_domains``); comments and docstrings stay in
its input as context but it never learns to predict them. Every arm then
fine-tunes the source of its seed for 100 steps at a peak learning rate of
1e-3 (same tokens, same steps, same optimizer):

- ``full_new`` / ``frozen_new``: every weight trains / the router (and its
  bias) frozen, on the *new* domain: comment and docstring targets;
- ``full_in`` / ``frozen_in``: the same on the *in-distribution* domain:
  code targets;
- ``lora_attn_new``: generic LoRA (rank 8 on the attention projections:
  the small model has no dense FFN layer), everything else frozen;
- ``lora_experts_new``: per-expert LoRA (rank 8 on every expert's three
  matrices, merged before the grouped matmul), everything else frozen.

Compared (``compare_to``): frozen vs full within each domain, generic LoRA
vs full, expert LoRA vs generic LoRA. Reported per arm: the target-domain
loss (val loss: only the target domains are scored), the gain on it over
the source, forgetting (loss on the pre-training domains, after - before),
MaxVio and the change in expert-domain specialisation (MI/H after - before),
with 95% intervals over 3 seeds. The budget check holds tokens and the
optimizer equal; trainable parameters are the axis (printed).
Size: 3 source runs + 6 arms x 3 seeds x 100 steps x 16 x 64 tokens, about
30-40 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/finetune.py --workdir=/tmp/abl/finetune
"""

import copy

from moejax.ablation.bases import small_experiment, small_moe, suite_config

PRETRAIN = ("code", "string")
NEW, IN = ("comment", "docstring"), ("code",)

_MOE = small_moe(routing=dict(score_fn="sigmoid", gating="normalized", use_bias=True),
                 balance=dict(aux_loss_coef=0.0, bias_update="sign", bias_rate=1e-2))


def _arm(domains, **finetune):
  return dict(data=dict(loss_domains=domains), finetune=finetune)


def get_config():
  source = small_experiment(copy.deepcopy(_MOE), steps=300)
  source["data"]["loss_domains"] = PRETRAIN
  base = small_experiment(copy.deepcopy(_MOE), steps=100)
  base["train"].update(learning_rate=1e-3, warmup_steps=10, eval_every=50,
                       checkpoint_every=50)
  base["finetune"] = dict(source="suite:source")
  lora = dict(freeze=("all",), lora_rank=8)
  return suite_config(
      name="finetune",
      description=__doc__,
      source=source,
      base=base,
      arms={
          "full_new": _arm(NEW),
          "frozen_new": _arm(NEW, freeze=("router",)),
          "full_in": _arm(IN),
          "frozen_in": _arm(IN, freeze=("router",)),
          "lora_attn_new": _arm(NEW, lora=("attention",), **lora),
          "lora_experts_new": _arm(NEW, lora=("experts",), **lora),
      },
      fixed=dict(tokens=0.0, optimizer=0.0),
      seeds=(0, 1, 2),
      baseline="full_new",
      compare_to=dict(frozen_in="full_in", full_in="-", lora_experts_new="lora_attn_new"),
      analysis=dict(comm_devices=8, latency=False),
  )
