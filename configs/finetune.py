"""Fine-tuning defaults for experiments.finetune: the model is the source's.

A full fine-tune (every weight trains, the router too) on the standard
library's comments and docstrings (``data.loss_domains``: only those
targets count in the loss; the code around them stays as context), 200
steps of 16 x 128 tokens at a peak learning rate of 1e-3.

  python -m experiments.finetune --source=/tmp/moejax_default --workdir=/tmp/ft
  python -m experiments.finetune --source=/tmp/moejax_default --workdir=/tmp/ft_lora \\
      --config.finetune.freeze='("all",)' --config.finetune.lora='("experts",)' \\
      --config.finetune.lora_rank=8
"""

from moejax.finetune.files import finetune_config_dict


def get_config():
  return finetune_config_dict(
      data=dict(name="python_stdlib", seq_len=128, batch_size=16, seed=0,
                loss_domains=("comment", "docstring")),
      train=dict(steps=200, learning_rate=1e-3, warmup_steps=10, min_lr_ratio=0.1,
                 weight_decay=0.1, grad_clip=1.0, log_every=25, eval_every=100, eval_batches=20,
                 checkpoint_every=100, keep_checkpoints=2),
      finetune=dict(),
  )
