"""What each parameter is to an optimizer, declared by the component that owns it.

A matrix optimizer (Muon) updates a weight as a matrix: it orthogonalises the
update of W in y = x W. It must know which axes of a tensor are that
matrix's input (reduction) and output axes; every other axis is a batch
axis, along which each slice is a matrix of its own. A stacked expert
tensor [E, d, f] is E matrices [d, f], never one [E d, f] matrix: taken as
one, the orthogonalisation would couple the experts (the bug of marin
#8621, maxtext PR #4843 and KellerJordan/Muon #65).

Everything that is not a hidden matrix (embeddings, the LM head, norm
scales, biases, routers and gates, Soft MoE's and PEER's expert vectors,
LoRA adapters) is an element-wise parameter: Muon leaves it to AdamW, as
Jordan et al. (2024) and Liu et al. (2025, arXiv 2502.16982) do.

The components declare roles for their own parameters
(``param_roles()`` of an NNX module, :meth:`moejax.layer.LayerKind.param_roles`
for a MoE layer's params dict, the functions next to each initialiser in
this plane); :func:`moejax.model.param_roles` gathers them for a model. A
parameter nobody declared is element-wise, so a plugin that declares
nothing is never orthogonalised.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class ParamRole:
  """One parameter's role.

  Attributes:
    component: what the parameter is, for listings ('attention', 'experts',
      'router', 'norm', ...); no optimizer reads it.
    reduction / output: for a hidden matrix, the input and output axes of
      y = x W (every other axis is a batch axis); both empty for an
      element-wise parameter.
    output_blocks: n > 1 when the output axis holds n independent matrices
      side by side (a gated expert's [W_gate | W_up]): an optimizer that
      treats W as a matrix treats each of the n blocks as its own matrix.
  """

  component: str
  reduction: tuple[int, ...] = ()
  output: tuple[int, ...] = ()
  output_blocks: int = 1

  @property
  def matrix(self) -> bool:
    """Whether a matrix optimizer may update this parameter as (a stack of) matrices."""
    return bool(self.reduction)


def matrix(component: str) -> ParamRole:
  """A [in, out] weight of y = x W."""
  return ParamRole(component, (0,), (1,))


def stack(component: str, output_blocks: int = 1) -> ParamRole:
  """A [B, in, out] stack of B independent matrices (experts [E, d, f], heads [H, d, D]);
  ``output_blocks`` n: each of them is n matrices [in, out / n] side by side."""
  return ParamRole(component, (1,), (2,), output_blocks)


def elementwise(component: str) -> ParamRole:
  """A parameter that is not a hidden matrix (vectors, embeddings, routers, gates)."""
  return ParamRole(component)


def roles_like(params: Mapping[str, Any], declared: Mapping[str, ParamRole],
               default: ParamRole) -> dict:
  """``params``' top-level keys mapped to their declared role (``default`` when undeclared).

  A role stands for the whole subtree under its key.
  """
  return {k: declared.get(k, default) for k in params}
