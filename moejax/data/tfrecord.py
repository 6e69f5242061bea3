"""Random access to TFRecord files without TensorFlow.

Most TFDS datasets on disk were prepared with TensorFlow in the default
``tfrecord`` format, which ``tfds.data_source`` does not read. The container
is simple: per record, ``uint64 length``, ``uint32 masked_crc32c(length)``,
``length`` bytes of a serialized ``tf.train.Example``, ``uint32
masked_crc32c(data)``. We index the files once (headers only, the length CRC
checked so that a compressed or foreign file fails loudly) and decode records
with ``FeaturesDict.deserialize_example_np``, also TF-free. The data CRC is
not checked: pure-Python CRC over gigabytes would dominate the read.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np


def _crc32c_table() -> list[int]:
  table = []
  for i in range(256):
    crc = i
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    table.append(crc)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), the checksum TFRecord uses."""
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def encode_record(payload: bytes) -> bytes:
  """One TFRecord frame around ``payload`` (used to write test fixtures)."""
  header = struct.pack("<Q", len(payload))
  return (header + struct.pack("<I", masked_crc32c(header)) + payload
          + struct.pack("<I", masked_crc32c(payload)))


class TFRecordSource:
  """``len()`` and ``[i] -> bytes`` over the records of several files, in order."""

  def __init__(self, paths: Sequence[str]):
    self._paths = [str(p) for p in paths]
    files, offsets, lengths = [], [], []
    for f, path in enumerate(self._paths):
      with open(path, "rb") as fh:
        pos = 0
        while True:
          header = fh.read(12)
          if not header:
            break
          length_bytes = header[:8]
          if len(header) < 12 or struct.unpack("<I", header[8:])[0] != masked_crc32c(length_bytes):
            raise ValueError(f"{path}: not an uncompressed TFRecord file (bad header at byte {pos})")
          (length,) = struct.unpack("<Q", length_bytes)
          files.append(f)
          offsets.append(pos + 12)
          lengths.append(length)
          pos += 12 + length + 4
          fh.seek(pos)
    self._file = np.asarray(files, np.int32)
    self._offset = np.asarray(offsets, np.int64)
    self._length = np.asarray(lengths, np.int64)

  def __len__(self) -> int:
    return len(self._offset)

  def __getitem__(self, i: int) -> bytes:
    with open(self._paths[self._file[i]], "rb") as fh:
      fh.seek(int(self._offset[i]))
      return fh.read(int(self._length[i]))
