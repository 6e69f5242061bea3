"""Reading and writing checkpoint tensors as numpy arrays.

A *source* is a mapping from names to tensors (a torch ``state_dict()``, a
dict of numpy or jax arrays) or a path: one ``.safetensors`` file, or a
directory holding ``model.safetensors``, a sharded
``model.safetensors.index.json`` or any ``*.safetensors`` files. Paths are
read lazily: only the tensors asked for are loaded (a 671B checkpoint's one
layer costs one layer of memory).

torch is imported only when a torch tensor is met, so a safetensors file or
a numpy dict converts without the ``interop`` extra's torch.

Block-quantised FP8 weights (DeepSeek-V3's released checkpoints store
``W`` as float8_e4m3fn next to ``W_scale_inv`` with one float32 scale per
128 x 128 block) are dequantised by :func:`dequantize_blocks`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import stat
import threading
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from moejax.interop.errors import InteropError, MissingTensorError

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def to_numpy(t: Any) -> np.ndarray:
  """A torch / jax / numpy tensor as a numpy array, exactly.

  torch bfloat16 and float8 have no numpy view through ``.numpy()``; they are
  upcast to float32, which is exact for both.
  """
  if type(t).__module__.startswith("torch"):
    import torch  # only when the caller already handed us torch tensors

    t = t.detach().cpu()
    if t.dtype.is_floating_point and t.dtype not in (torch.float16, torch.float32,
                                                     torch.float64):
      t = t.float()
    return t.numpy()
  return np.asarray(t)


class TensorStore:
  """Read-only, lazily loaded named tensors. Subclasses implement ``_load``."""

  description = "the checkpoint"

  def keys(self) -> list[str]:
    raise NotImplementedError

  def _load(self, key: str) -> np.ndarray:
    raise NotImplementedError

  def __contains__(self, key: str) -> bool:
    return key in self._key_set()

  def _key_set(self) -> frozenset:
    if not hasattr(self, "_keys_cache"):
      self._keys_cache = frozenset(self.keys())
    return self._keys_cache

  def get(self, key: str, fix: Optional[str] = None) -> np.ndarray:
    """The tensor ``key``; MissingTensorError names it (and near misses) if absent."""
    if key not in self:
      raise MissingTensorError(key, self.keys(), self.description, fix)
    return self._load(key)


class DictStore(TensorStore):
  """A mapping name -> tensor (torch state dict, numpy or jax arrays)."""

  def __init__(self, tensors: Mapping[str, Any]):
    self._tensors = tensors
    self.description = f"the state dict ({len(tensors)} tensors)"

  def keys(self) -> list[str]:
    return list(self._tensors.keys())

  def _load(self, key: str) -> np.ndarray:
    return to_numpy(self._tensors[key])


class SafetensorsStore(TensorStore):
  """One or more safetensors files, read lazily by key."""

  def __init__(self, path: str | os.PathLike):
    path = pathlib.Path(path)
    self.path = path
    self.description = f"safetensors checkpoint {str(path)!r}"
    if path.is_dir():
      if (path / _INDEX).exists():
        weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
        self._file_of = {k: path / v for k, v in weight_map.items()}
      else:
        files = [path / _SINGLE] if (path / _SINGLE).exists() else sorted(
            path.glob("*.safetensors"))
        if not files:
          raise InteropError(f"{str(path)!r} holds no {_INDEX}, {_SINGLE} or *.safetensors "
                             "file. Fix: point at a Hugging Face checkpoint directory or "
                             "a .safetensors file")
        self._file_of = {k: f for f in files for k in _header_keys(f)}
    elif path.is_file():
      self._file_of = {k: path for k in _header_keys(path)}
    else:
      raise InteropError(f"checkpoint path {str(path)!r} does not exist. Fix: pass an "
                         "existing .safetensors file or checkpoint directory")

  def keys(self) -> list[str]:
    return list(self._file_of)

  def _load(self, key: str) -> np.ndarray:
    from safetensors import safe_open

    file = str(self._file_of[key])
    try:
      with safe_open(file, framework="np") as f:
        return f.get_tensor(key)
    except AttributeError:
      # safetensors' readers look float8 dtypes up on numpy itself, which
      # lacks them (ml_dtypes has them): read those tensors' bytes directly.
      return _read_raw(file, key)


_RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "BF16": "bfloat16"}


def _read_raw(file: str, key: str) -> np.ndarray:
  """One tensor read from the safetensors layout: u64 header size, JSON header, data."""
  import ml_dtypes

  with open(file, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    info = json.loads(f.read(n))[key]
    if info["dtype"] not in _RAW_DTYPES:
      raise InteropError(f"tensor {key!r} in {file!r} has dtype {info['dtype']}, which "
                         "cannot be read. Fix: convert the checkpoint to float32/bfloat16")
    begin, end = info["data_offsets"]
    f.seek(8 + n + begin)
    raw = f.read(end - begin)
  dtype = np.dtype(getattr(ml_dtypes, _RAW_DTYPES[info["dtype"]]))
  return np.frombuffer(raw, dtype).reshape(info["shape"]).copy()


def _header_keys(path: pathlib.Path) -> Iterable[str]:
  from safetensors import safe_open

  with safe_open(str(path), framework="np") as f:
    return list(f.keys())


def open_source(source: Any) -> TensorStore:
  """A TensorStore over a mapping, a safetensors path or an existing store."""
  if isinstance(source, TensorStore):
    return source
  if isinstance(source, (str, os.PathLike)):
    return SafetensorsStore(source)
  if isinstance(source, Mapping):
    return DictStore(source)
  raise InteropError(f"cannot read tensors from a {type(source).__name__}. Fix: pass a "
                     "state dict (mapping name -> tensor), a .safetensors file or a "
                     "checkpoint directory")


def dequantize_blocks(w: np.ndarray, scale_inv: np.ndarray,
                      block: tuple[int, int] = (128, 128)) -> np.ndarray:
  """float32 W from a block-quantised W[r, c] and its scale_inv[ceil(r/br), ceil(c/bc)].

  Each (br x bc) block of W is multiplied by its one scale (DeepSeek-V3's
  ``weight_scale_inv`` is already the inverse quantisation scale).
  """
  r, c = w.shape
  br, bc = block
  want = (math.ceil(r / br), math.ceil(c / bc))
  if scale_inv.shape != want:
    raise InteropError(f"scale_inv has shape {scale_inv.shape}, expected {want} for a "
                       f"{w.shape} weight in {block} blocks. Fix: pass the checkpoint's "
                       "quantization_config.weight_block_size")
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=0), bc, axis=1)[:r, :c]
  return w.astype(np.float32) * s


def save_safetensors(state_dict: Mapping[str, Any], path: str | os.PathLike,
                     metadata: Optional[dict] = None) -> None:
  """Writes numpy/torch/jax tensors to one safetensors file.

  ``{'format': 'pt'}`` metadata is what transformers' loader expects of a
  PyTorch checkpoint.
  """
  from safetensors.numpy import save_file

  arrays = {k: np.ascontiguousarray(to_numpy(v)) for k, v in state_dict.items()}
  save_file(arrays, str(path), metadata={"format": "pt", **(metadata or {})})
  # safetensors writes a private temporary file (mode 0600) and renames it into place; the
  # file gets the mode of any new file here instead (0666 less the umask: 0644 usually).
  os.chmod(path, _new_file_mode(os.path.dirname(os.path.abspath(path))))


def _new_file_mode(directory: str) -> int:
  """The permission bits a file created in ``directory`` gets (the umask applied to 0666).

  Found by creating one: reading the umask means setting it, for every thread at once.
  """
  probe = os.path.join(directory, f".moejax-mode-probe-{os.getpid()}-{threading.get_ident()}")
  fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
  try:
    return stat.S_IMODE(os.fstat(fd).st_mode)
  finally:
    os.close(fd)
    os.remove(probe)
