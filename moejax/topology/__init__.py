"""The topology (object) plane: which experts exist, their size and cost.

- :mod:`~moejax.topology.experts`: routed expert FFN params (stacked [E, ...]
  layout, width masks for heterogeneous experts) and shared experts.
- :mod:`~moejax.topology.zero_compute`: MoE++ zero / copy / constant experts.
- :mod:`~moejax.topology.peer`: PEER, product-key retrieval over n^2
  single-neuron experts.
- :mod:`~moejax.topology.segmentation`: fine-grained segmentation and
  DeepSeekMoE shared-expert isolation as config transforms.
- :mod:`~moejax.topology.accounting`: total / active parameters and FLOPs per
  token of any ModelConfig (``budget``, ``budget_table``).
- :mod:`~moejax.topology.presets`: published architectures from
  ``configs/presets/*.py`` (``load_preset``, ``list_presets``).

Submodules are imported explicitly; this package imports nothing, so the
accounting and presets load without JAX.
"""
