"""Shared helpers of the interop tests: random HF MoE blocks and ties-free inputs.

Legend: T tokens, d model width, E routed experts, K experts per token, G groups.

Import this only after ``pytest.importorskip("torch")`` (the interop extra).
"""

from __future__ import annotations

import torch

from moejax.interop import parity

torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float32)

# The random blocks, ties-free inputs and the moejax layer's apply are the library's
# (moejax.interop.parity), so the tests check exactly what the interop bench records.
BLOCKS, apply_layer, block_class = parity.BLOCKS, parity.apply_layer, parity.block_class
make_block, hf_forward, hf_routing = parity.make_block, parity.hf_forward, parity.hf_routing
selection, ties_free_inputs = parity.selection, parity.ties_free_inputs
