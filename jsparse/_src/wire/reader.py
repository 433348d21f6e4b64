"""Bounded reading of payload bytes: every read says what it reads, and a short payload is a
:class:`~jsparse.PayloadError` naming it, never an ``IndexError`` or a partial array.

>>> r = Reader(b"\\x01\\x00\\x02\\x00")
>>> r.array("<u2", 2, "counts").tolist(), r.remaining
([1, 2], 0)
>>> r.take(1, "segment 0 record")
Traceback (most recent call last):
...
jsparse.errors.PayloadError: payload truncated while reading segment 0 record
"""

from __future__ import annotations

import numpy as np

from jsparse._src.errors import PayloadError


class Reader:
  """Reads ``data`` front to back."""

  def __init__(self, data: bytes):
    self._data, self._pos = data, 0

  def take(self, n: int, what: str) -> bytes:
    """The next ``n`` bytes."""
    if n < 0 or self._pos + n > len(self._data):
      raise PayloadError(f"payload truncated while reading {what}")
    chunk = self._data[self._pos:self._pos + n]
    self._pos += n
    return chunk

  def array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    """The next ``count`` little-endian values of ``dtype``."""
    dtype = np.dtype(dtype).newbyteorder("<")
    return np.frombuffer(self.take(count * dtype.itemsize, what), dtype)

  @property
  def remaining(self) -> int:
    return len(self._data) - self._pos
