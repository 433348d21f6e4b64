"""The body of a unit of a packed (format 3) part: its changes bit-packed on the device.

The device (``device/packing.py``) codes every change; the host only frames the words it gets
back, and a receiver's host only checks the framing and hands the words to its devices. A
sparse unit's body is two streams, the key gaps and the value codes, each a run of fixed-width
blocks of 32 values (``core/bitpack.py``)::

  stream   blocks u32 | widths u8[blocks] | words u32[...]: the values of each block at its
           width, end to end (the last block's only), in whole words

keys first, then codes; a dense unit's body is its bit patterns, little-endian. Decoding
checks each stream's block count against the changes the unit's table entry states
(``wire/parts.py``), every width (at most 32) and the word count against the widths, before
anything reaches a device; the keys and codes are checked on the device (``unpack_program``).

>>> import numpy as np
>>> stream = encode_stream(np.array([5], np.uint8), np.arange(4, dtype=np.uint32))
>>> r = Reader(stream); read_stream(r, 20, 'keys')[0].tolist(), r.remaining  # 20 5-bit values
([5], 0)
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from jsparse._src.core import bitpack
from jsparse._src.core.plan import Segment
from jsparse._src.errors import PayloadError
from jsparse._src.device.packing import values_per_change
from jsparse._src.wire.payload import Mode, SegmentPayload
from jsparse._src.wire.reader import Reader

_U32 = struct.Struct("<I")


@dataclasses.dataclass(frozen=True)
class PackedRecord:
  """A sparse unit's record in a packed part (``wire/parts.py``): ``count`` changes of
  ``mode`` (``BY_RANK``, ``BY_POSITION``; ``EMPTY``: none, ``streams`` None), their
  ``streams``: ``(key widths, key words, code widths, code words)`` as numpy arrays."""

  mode: Mode
  count: int
  streams: tuple | None


def encode_unit(record) -> bytes:
  """A unit's body in a packed part: a :class:`PackedRecord`'s streams, or a dense record's
  bits (little-endian)."""
  if record.mode == Mode.DENSE:
    return np.ascontiguousarray(record.values, record.values.dtype.newbyteorder("<")).tobytes()
  return streams_bytes(record.streams)


def streams_bytes(streams: tuple) -> bytes:
  """A chunk's (or unit's) key stream then code stream, as the body holds them."""
  return b"".join(stream_pieces(streams))


def stream_pieces(streams: tuple) -> list:
  """:func:`streams_bytes` as a list of buffers (nothing copied), to join once with others."""
  return [*_pieces(*streams[:2]), *_pieces(*streams[2:])]


def _pieces(widths: np.ndarray, words: np.ndarray) -> list:
  return [_U32.pack(len(widths)), np.ascontiguousarray(widths, np.uint8).data,
          np.ascontiguousarray(words, "<u4").data]


def decode_unit(slot: Segment, mode: Mode, count: int, reader: Reader, where: str):
  """Inverse of :func:`encode_unit` for a unit of ``slot`` whose table entry states ``mode``
  and ``count``: a dense ``SegmentPayload``, or a :class:`PackedRecord` whose streams are
  checked as far as the host can (their keys and codes are checked on the device)."""
  if mode == Mode.DENSE:
    return SegmentPayload(Mode.DENSE, None, reader.array(slot.bit_dtype, slot.size,
                                                         f"{where} dense"))
  keys = read_stream(reader, count, f"{where} keys")
  codes = read_stream(reader, count * values_per_change(slot), f"{where} codes")
  return PackedRecord(Mode(mode), count, (*keys, *codes))


def encode_stream(widths: np.ndarray, words: np.ndarray) -> bytes:
  """One packed stream's bytes: its block count, widths and words."""
  return b"".join(_pieces(widths, words))


def read_stream(reader: Reader, values: int, what: str) -> tuple[np.ndarray, np.ndarray]:
  """The widths and words of a stream that must hold ``values`` values, checked."""
  (blocks,) = _U32.unpack(reader.take(_U32.size, f"{what} block count"))
  if blocks != bitpack.num_blocks(values):
    raise PayloadError(f"{what}: {blocks} blocks for {values} values")
  widths = reader.array(np.uint8, blocks, f"{what} widths")
  if blocks and int(widths.max()) > 32:
    raise PayloadError(f"{what}: a block of width {int(widths.max())} (at most 32)")
  words = reader.array(np.uint32, bitpack.num_words(widths, values), f"{what} words")
  return widths, words
