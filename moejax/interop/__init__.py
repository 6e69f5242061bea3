"""Interop with public MoE checkpoints (Hugging Face transformers).

Import a MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 into
moejax (params, RouterState, MoEConfig), export a moejax layer back, and
analyse the routing of imported layers. Whole Mixtral, Qwen3-MoE and
DeepSeek-V3 models convert both ways through :mod:`moejax.interop.models`. torch / transformers are needed only
to read torch state dicts or run HF models (``pip install -e '.[interop]'``);
safetensors files and numpy dicts convert with safetensors alone. See
docs/interop.md.
"""

from moejax.interop.convert import (LAYOUTS, ExportedBlock, ImportedBlock,
                                    export_moe_block, import_moe_block,
                                    import_moe_layers, load_hf_config, to_torch)
from moejax.interop.errors import (InteropError, MissingTensorError,
                                   TensorShapeError, UnsupportedArchitectureError)
from moejax.interop.families import (FAMILIES, Family, block_gaps, expressing_families,
                                     get_family, hf_fields_from_moe, moe_config_from_hf,
                                     moe_layers, register_family)
from moejax.interop.tensors import dequantize_blocks, open_source, save_safetensors
# The whole-model families register themselves (moejax.interop.models.WHOLE_MODELS).
from moejax.interop import deepseek_v3, qwen3_moe  # noqa: F401,E402

__all__ = [
    "FAMILIES", "LAYOUTS", "ExportedBlock", "Family", "ImportedBlock", "InteropError",
    "MissingTensorError", "TensorShapeError", "UnsupportedArchitectureError", "block_gaps",
    "dequantize_blocks", "export_moe_block", "expressing_families", "get_family", "hf_fields_from_moe",
    "import_moe_block", "import_moe_layers", "load_hf_config", "moe_config_from_hf",
    "moe_layers", "open_source", "register_family", "save_safetensors", "to_torch",
]
