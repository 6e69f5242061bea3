"""A moejax model's routing after a round trip through Hugging Face transformers.

Legend: B sequences, S tokens per sequence, K experts per token.

The model is exported as a whole Mixtral (:func:`moejax.interop.models.
export_model`, the in-memory ``fused`` layout), loaded into
``transformers.MixtralForCausalLM`` and run in float32 on the same tokens;
a forward hook on each layer's router (``block.gate``) reads the experts
transformers itself chose (``router_indices``, int[B*S, K]). So the flips
count every numerical difference of the other framework: attention, norms,
rotary embedding and the experts of earlier layers.

Needs the ``interop`` extra (torch, transformers) and a model Mixtral
expresses (``configs/default_mixtral.py`` trains one).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from moejax.interop import hf_models
from moejax.interop import models as models_lib
from moejax.interop.convert import to_torch
from moejax.interop.errors import InteropError
from moejax.routing.replay import RoutingReplay

MODEL_TYPE = "mixtral"


def why_not(model) -> str:
  """'' when the round trip runs, else why not (no torch / transformers, not a Mixtral)."""
  try:
    import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    import transformers  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as err:
    return (f"needs the interop extra ({err.name} is not installed). Fix: pip install -e "
            "'.[interop]'")
  try:
    models_lib.hf_config_of(model.cfg, MODEL_TYPE)
  except InteropError as err:
    return str(err)
  return ""


def hf_model(model):
  """``model`` as a ``transformers`` Mixtral in float32, eval mode."""
  import transformers  # pylint: disable=g-import-not-at-top
  _, params, state, _ = nnx.split(model, nnx.Param, nnx.Variable, ...)
  exported = models_lib.export_model(nnx.to_pure_dict(params), nnx.to_pure_dict(state),
                                     model.cfg, MODEL_TYPE, layout="fused")
  hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**exported.hf_config))
  hf.load_state_dict(to_torch(exported.state_dict), strict=True)
  return hf.eval()


def selections(model, tokens) -> dict[str, RoutingReplay]:
  """``{'layer_<i>': RoutingReplay [B, S, K]}``: the experts transformers chose."""
  import torch  # pylint: disable=g-import-not-at-top
  tokens = np.asarray(tokens, np.int64)
  b, s = tokens.shape
  hf = hf_model(model)
  seen, hooks = {}, []
  for i in range(model.cfg.n_layers):
    gate = hf_models.block_module(hf, i).gate
    hooks.append(gate.register_forward_hook(
        lambda _m, _inp, out, i=i: seen.__setitem__(f"layer_{i}", out[2].detach().numpy())))
  try:
    with torch.no_grad():
      hf(input_ids=torch.as_tensor(tokens))
  finally:
    for h in hooks:
      h.remove()
  return {n: RoutingReplay(ids.reshape(b, s, -1).astype(np.int32),
                           np.ones((b, s, ids.shape[-1]), bool)) for n, ids in seen.items()}
