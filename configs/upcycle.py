"""Sparse upcycling with experiments.finetune: a dense run made an 8-expert top-2 MoE.

The source is a dense moejax run (configs/dense.py, any ``model.dense_twin``)
or a Hugging Face Mistral / Llama; the model is the source's with MoE FFNs
in every layer (``model.moe_layout``: ``all``, ``every_other``, or
``first_dense`` with ``first_dense_layers``), each expert starting as a
copy of its layer's dense FFN and the router freshly initialised
(moejax.finetune.upcycle; the options are ``finetune.upcycle.*``, see
docs/finetune.md). The expert width must be the dense width / split: 256
for configs/dense.py (the default model's dense twin, F = 2 x 128).

  python -m experiments.train --config=configs/dense.py --workdir=/tmp/moejax_dense
  python -m experiments.finetune --config=configs/upcycle.py --source=/tmp/moejax_dense \\
      --workdir=/tmp/upcycled
  python -m experiments.finetune --config=configs/upcycle.py --source=/tmp/moejax_dense \\
      --workdir=/tmp/drop_upcycled --config.finetune.upcycle.drop=0.5
"""

from moejax.finetune.files import finetune_config_dict


def get_config():
  return finetune_config_dict(
      model=dict(moe=dict(topology=dict(num_experts=8, expert_width=256, activation="swiglu"),
                          routing=dict(kind="topk", top_k=2, score_fn="softmax",
                                       gating="normalized"),
                          balance=dict(aux_loss_coef=1e-2, aux_loss_scope="batch"),
                          execution=dict(backend="blocked")),
                 moe_layout="all"),
      data=dict(name="python_stdlib", seq_len=128, batch_size=16, seed=0),
      train=dict(steps=200, learning_rate=1e-3, warmup_steps=10, min_lr_ratio=0.1,
                 weight_decay=0.1, grad_clip=1.0, log_every=25, eval_every=100, eval_batches=20,
                 checkpoint_every=100, keep_checkpoints=2),
      finetune=dict(source_format="upcycle"),
  )
