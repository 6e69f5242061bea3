"""The topology (object) plane: which experts exist, their size and cost.

- :mod:`~moejax.topology.experts`: routed expert FFN params (stacked [E, ...]
  layout, width masks for heterogeneous experts) and shared experts.
- :mod:`~moejax.topology.zero_compute`: MoE++ zero / copy / constant experts.
- :mod:`~moejax.topology.peer`: PEER, product-key retrieval over n^2
  single-neuron experts.
- :mod:`~moejax.topology.accounting`: total / active parameters and FLOPs per
  token of any ModelConfig (``budget``, ``budget_table``).
- :mod:`~moejax.topology.memory`: serving memory (weights and KV cache) of
  any ModelConfig.

Fine-grained segmentation and DeepSeekMoE shared-expert isolation are
config transforms (:mod:`moejax.config.segmentation`); the published
architectures of ``configs/presets/*.py`` load through
:mod:`moejax.config.files` (``load_preset``, ``list_presets``).

Submodules are imported explicitly; this package imports nothing, so the
accounting and the memory model load without JAX.
"""
