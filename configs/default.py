"""The default small MoE on the embedded standard-library corpus.

A 3.5M-parameter decoder (d=128, 4 layers, 4 heads) whose every FFN is an
MoE of 16 experts (f=128), top-2 (1/8 of the expert parameters active per
token), routed DeepSeek-V3 style: sigmoid scores, gates normalised over the
selection, aux-loss-free balancing (a selection bias moved by the sign
controller after each step) plus a tiny sequence-wise balance loss. Byte
level, sequences of 128, batches of 16, 600 steps with AdamW and warmup +
cosine. On 2 CPU cores it takes a few minutes; docs/training.md has the
measured losses.

    python -m experiments.train --config=configs/default.py --workdir=/tmp/moejax_default
"""

from moejax.train.config import experiment_config_dict


def model():
  """The model section, shared with configs/dense.py."""
  return dict(
      vocab_size=256, d_model=128, n_layers=4, n_heads=4,
      moe=dict(
          topology=dict(num_experts=16, expert_width=128, activation="swiglu"),
          # The execution plane's fast portable path: only the chosen experts
          # compute (the reference backend runs all 16 on every token).
          execution=dict(backend="blocked"),
          routing=dict(kind="topk", top_k=2, score_fn="sigmoid", gating="normalized",
                       use_bias=True),
          # DeepSeek-V3 moves the bias by 1e-3 per step over 14.8T tokens;
          # this run has 600 steps, and at 1e-3 the load stays skewed (MaxVio
          # ~4) for ~400 of them. 1e-2 balances in ~100 steps at no loss cost.
          balance=dict(bias_update="sign", bias_rate=1e-2, aux_loss_coef=1e-4,
                       aux_loss_scope="sequence", aux_loss_convention="topk")))


def get_config():
  return experiment_config_dict(
      model=model(),
      data=dict(name="python_stdlib", seq_len=128, batch_size=16, seed=0),
      train=dict(steps=600, learning_rate=3e-3, warmup_steps=30, min_lr_ratio=0.1,
                 weight_decay=0.1, grad_clip=1.0, log_every=25, eval_every=200,
                 eval_batches=20, checkpoint_every=200, keep_checkpoints=2),
  )
