"""Fine-tuning: start a run from a trained moejax run or a Hugging Face MoE, freeze parts of
it, train LoRA adapters (attention / dense layers, or per-expert on the routed experts).

- :mod:`moejax.finetune.config`: the ``finetune`` config section and its rules;
- :mod:`moejax.finetune.adapters`: LoRA adapters attached to a built model;
- :mod:`moejax.finetune.source`: the source run or HF checkpoint, checked and loaded;
- :mod:`moejax.finetune.accounting`: trainable parameters, optimizer and activation memory;
- :mod:`moejax.finetune.export`: a fine-tuned run back to the Hugging Face layout.

This package file imports nothing (the train config imports the config module).
See docs/finetune.md.
"""
