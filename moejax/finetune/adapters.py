"""LoRA adapters of a fine-tuning run: where they go and how many parameters they add.

Legend: d model width, E routed experts, f expert width, F dense width, r rank.

:func:`attach`, :data:`ATTENTION` and :func:`lora_param_count` are defined in
:mod:`moejax.nn.adapters`,
next to the building blocks they adapt, because the train step builds every
state's model with its adapters and must not import this package; they are
re-exported here as part of the fine-tuning API.

:func:`lora_param_count` is the documented count: r (i + o) per adapted
matrix, times E per expert stack.
"""

from __future__ import annotations

from moejax.nn.adapters import ATTENTION, attach, lora_param_count

__all__ = ["ATTENTION", "attach", "lora_param_count"]
