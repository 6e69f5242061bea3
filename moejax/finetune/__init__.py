"""Fine-tuning: start a run from a trained moejax run or a Hugging Face MoE, freeze parts of
it, train LoRA adapters (attention / dense layers, or per-expert on the routed experts).

- :mod:`moejax.finetune.adapters`: LoRA adapters attached to a built model, and their count;
- :mod:`moejax.finetune.source`: the source run or HF checkpoint, checked and loaded;
- :mod:`moejax.finetune.start`: the trainer's start hook, which opens the source;
- :mod:`moejax.finetune.accounting`: trainable parameters, optimizer and activation memory;
- :mod:`moejax.finetune.export`: a fine-tuned run back to the Hugging Face layout.

The ``finetune`` config section and its rules are :mod:`moejax.config.finetune`,
with the other typed configs: every ExperimentConfig holds one.

Fine-tuning builds on :mod:`moejax.train`, never the other way: the trainer
takes :func:`moejax.finetune.start.finetune_start` as a hook
(:mod:`moejax.train.context`). This package file imports nothing.
See docs/finetune.md.
"""
