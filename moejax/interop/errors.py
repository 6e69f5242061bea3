"""Errors of the interop package: each names what is wrong and how to fix it."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


class InteropError(ValueError):
  """A checkpoint or config cannot be converted; the message says why and the fix."""


class UnsupportedArchitectureError(InteropError):
  """The Hugging Face ``model_type`` has no converter."""

  def __init__(self, model_type: object, supported: Iterable[str]):
    self.model_type = model_type
    self.supported = tuple(sorted(supported))
    close = difflib.get_close_matches(str(model_type), self.supported, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    super().__init__(
        f"model_type={model_type!r} has no MoE converter{hint}. Supported model_type "
        f"values: {', '.join(self.supported)}. Fix: use a checkpoint of a supported "
        "family, or register a Family in moejax.interop.families.")


class MissingTensorError(InteropError, KeyError):
  """A tensor the converter needs is not in the checkpoint.

  Also a KeyError, so ``except KeyError`` around dict-like access still works;
  ``str()`` is the plain message (KeyError would quote it).
  """

  def __init__(self, key: str, available: Iterable[str] = (), where: str = "",
               fix: Optional[str] = None):
    self.key = key
    near = difflib.get_close_matches(key, list(available), n=3, cutoff=0.6)
    msg = f"tensor {key!r} is missing from {where or 'the checkpoint'}"
    if near:
      msg += f"; closest keys present: {', '.join(repr(k) for k in near)}"
    msg += ". Fix: " + (fix or "check the layer index / prefix and that the checkpoint "
                        "belongs to the model_type of its config")
    super().__init__(msg)

  def __str__(self) -> str:
    return self.args[0]


class TensorShapeError(InteropError):
  """A tensor has the wrong shape for the config it is converted with."""

  def __init__(self, key: str, got: tuple, want: tuple, why: str):
    self.key, self.got, self.want = key, tuple(got), tuple(want)
    super().__init__(f"tensor {key!r} has shape {self.got}, expected {self.want} ({why}). "
                     "Fix: pass the config this checkpoint was saved with.")
