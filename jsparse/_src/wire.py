"""The bytes of a sync payload: header, body, checksum.

Two body formats share the header and the checksum. Format 2 (compact, the default of
:class:`~jsparse.Sender`) codes changes as gaps of ranks in an order both sides derive from the
old bits, and values as steps from the old bits, zstd-compressed: about 1 byte per change on an
RL update; it is described in ``compact.py``. Format 1 (lists) is plain and needs no pass over
the receiver's params: 4 bytes per change for 16-bit dtypes.

Layout, little-endian::

  header   magic "JSPS" | format u8 | kind u8 | reserved u16 | plan fingerprint 16B
           | base version u64 | version u64 | base digest 8B | new digest 8B | segments u32
  body     format 2: see ``compact.py``; format 1: one record per segment,
  segment  mode u8 | count u32 | positions | values
           mode EMPTY: nothing; LIST: per 65536-element chunk of the segment the number of its
           changes (u32), then each change's index within its chunk (u16), then ``count``
           values; BITMAP: ceil(size/8) bytes of little-endian bits then ``count`` values;
           DENSE: ``size`` values.
  trailer  crc32 of everything before it, u32

Values are the rollout bit patterns (unsigned ints of the leaf's width). The sender picks the
smaller of LIST and BITMAP per segment; DENSE carries overflowed segments and anchors.
:func:`decode` checks everything (checksum first) before returning, so a payload that decodes
can be applied without further failure.

>>> import numpy as np, jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
>>> seg = SegmentPayload(LIST, np.array([3], np.int32), np.array([7], np.uint32))
>>> p = Payload(DELTA, 0, 1, b'\\0' * 8, b'\\1' * 8, (seg,))
>>> decode(plan, encode(plan, p)).segments[0].indices.tolist()
[3]
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np

from jsparse._src import compact
from jsparse._src.errors import PayloadError
from jsparse._src.plan import Plan

MAGIC = b"JSPS"
LISTS, COMPACT = 1, 2  # body formats
DELTA, ANCHOR = 0, 1
EMPTY, LIST, BITMAP, DENSE = 0, 1, 2, 3
ORDERED, NATURAL = compact.ORDERED, compact.NATURAL
_HEADER = struct.Struct("<4sBBH16sQQ8s8sI")
_RECORD = struct.Struct("<BI")
_CRC = struct.Struct("<I")
_CHUNK_BITS = 16


@dataclasses.dataclass(frozen=True)
class SegmentPayload:
  """One segment's changes: ``indices`` (int32, ascending) and their ``values``, or, in DENSE
  mode, ``values`` holding the whole segment and ``indices`` None.

  Modes LIST and BITMAP (format 1): indices are positions, values new bit patterns. Modes
  ORDERED and NATURAL (format 2): indices are ranks in the exponent-class order or positions,
  values step codes against the old bits."""

  mode: int
  indices: np.ndarray | None
  values: np.ndarray


@dataclasses.dataclass(frozen=True)
class Payload:
  """A decoded payload: what it applies to, what it produces, and the segments' changes."""

  kind: int
  base_version: int
  version: int
  base_digest: bytes
  new_digest: bytes
  segments: tuple[SegmentPayload, ...]
  format: int = LISTS


def encode(plan: Plan, payload: Payload) -> bytes:
  """Serializes ``payload`` (which must match ``plan``) to bytes."""
  header = _HEADER.pack(MAGIC, payload.format, payload.kind, 0, plan.fingerprint,
                        payload.base_version, payload.version, payload.base_digest,
                        payload.new_digest, len(payload.segments))
  if payload.format == COMPACT:
    body = header + compact.encode_body(plan, payload.segments)
  else:
    body = header + _encode_lists(plan, payload.segments)
  return body + _CRC.pack(zlib.crc32(body))


def _encode_lists(plan: Plan, segments: tuple[SegmentPayload, ...]) -> bytes:
  chunks = []
  for seg, part in zip(plan.segments, segments):
    values = np.ascontiguousarray(part.values, seg.bit_dtype)
    if part.mode == DENSE:
      chunks += [_RECORD.pack(DENSE, seg.size), values.tobytes()]
      continue
    count = len(part.indices)
    mode = part.mode if count else EMPTY
    chunks.append(_RECORD.pack(mode, count))
    if mode == LIST:
      per_chunk = np.bincount(part.indices >> _CHUNK_BITS, minlength=_num_chunks(seg.size))
      chunks += [per_chunk.astype("<u4").tobytes(), part.indices.astype("<u2").tobytes()]
    elif mode == BITMAP:
      mask = np.zeros(seg.size, bool)
      mask[part.indices] = True
      chunks.append(np.packbits(mask, bitorder="little").tobytes())
    chunks.append(values.tobytes())
  return b"".join(chunks)


def sparse_mode(size: int, count: int) -> int:
  """The cheaper position coding for ``count`` changes among ``size`` elements."""
  return LIST if 2 * count + 4 * _num_chunks(size) <= (size + 7) // 8 else BITMAP


def _num_chunks(size: int) -> int:
  return -(-size // (1 << _CHUNK_BITS))


class _Reader:
  def __init__(self, data: bytes):
    self._data, self._pos = data, 0

  def take(self, n: int, what: str) -> bytes:
    if n < 0 or self._pos + n > len(self._data):
      raise PayloadError(f"payload truncated while reading {what}")
    chunk = self._data[self._pos:self._pos + n]
    self._pos += n
    return chunk

  def array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    dtype = np.dtype(dtype).newbyteorder("<")
    return np.frombuffer(self.take(count * dtype.itemsize, what), dtype)

  @property
  def remaining(self) -> int:
    return len(self._data) - self._pos


def decode(plan: Plan, data: bytes) -> Payload:
  """Parses and fully validates ``data`` against ``plan``.

  Raises:
    PayloadError: for anything that is not a well-formed payload of this plan: wrong magic,
      format or plan, bad checksum, truncation, trailing bytes, indices out of range, unsorted
      or duplicated, counts over capacity.
  """
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
  data = bytes(data)
  if len(data) < _HEADER.size + _CRC.size:
    raise PayloadError(f"payload truncated: {len(data)} bytes is shorter than a header")
  if data[:4] != MAGIC:
    raise PayloadError("not a jsparse payload (bad magic)")
  body, (crc,) = data[:-_CRC.size], _CRC.unpack(data[-_CRC.size:])
  if zlib.crc32(body) != crc:
    raise PayloadError("payload checksum mismatch: corrupted or truncated")
  reader = _Reader(body)
  (_, fmt, kind, _, fingerprint, base_version, version, base_digest, new_digest,
   num_segments) = _HEADER.unpack(reader.take(_HEADER.size, "header"))
  if fmt not in (LISTS, COMPACT):
    raise PayloadError(f"payload format {fmt} is not supported (this jsparse reads 1 and 2)")
  if kind not in (DELTA, ANCHOR):
    raise PayloadError(f"unknown payload kind {kind}")
  if fingerprint != plan.fingerprint:
    raise PayloadError("payload was made for another plan (fingerprint differs)")
  if num_segments != len(plan.segments):
    raise PayloadError(f"payload has {num_segments} segments, the plan {len(plan.segments)}")
  if fmt == COMPACT:
    segments = compact.decode_body(plan, reader, SegmentPayload)
  else:
    segments = tuple(_decode_segment(reader, plan, s) for s in range(num_segments))
  if reader.remaining:
    raise PayloadError(f"{reader.remaining} unexpected bytes after the last segment")
  if kind == ANCHOR and any(s.mode != DENSE for s in segments):
    raise PayloadError("an anchor payload must carry every segment densely")
  return Payload(kind, base_version, version, base_digest, new_digest, segments, fmt)


def _decode_segment(reader: _Reader, plan: Plan, s: int) -> SegmentPayload:
  seg = plan.segments[s]
  where = plan.describe_segment(s)
  mode, count = _RECORD.unpack(reader.take(_RECORD.size, f"{where} record"))
  if mode == DENSE:
    if count != seg.size:
      raise PayloadError(f"{where}: dense record of {count} elements, the plan has {seg.size}")
    return SegmentPayload(DENSE, None, reader.array(seg.bit_dtype, seg.size, where))
  if mode == EMPTY:
    if count:
      raise PayloadError(f"{where}: empty record with count {count}")
    return SegmentPayload(EMPTY, np.zeros(0, np.int32), np.zeros(0, seg.bit_dtype))
  if count > seg.capacity:
    raise PayloadError(f"{where}: {count} changes exceed the capacity {seg.capacity}")
  if mode == LIST:
    per_chunk = reader.array(np.uint32, _num_chunks(seg.size), where)
    if int(per_chunk.sum(dtype=np.int64)) != count:
      raise PayloadError(f"{where}: chunk counts add up to {per_chunk.sum()}, not {count}")
    low = reader.array(np.uint16, count, where).astype(np.int32)
    indices = np.repeat(np.arange(len(per_chunk), dtype=np.int32), per_chunk) << _CHUNK_BITS | low
    if count and (indices[-1] >= seg.size or np.any(np.diff(indices) <= 0)):
      raise PayloadError(f"{where}: indices out of range, unsorted or repeated")
  elif mode == BITMAP:
    packed = reader.array(np.uint8, (seg.size + 7) // 8, where)
    mask = np.unpackbits(packed, bitorder="little")
    if mask[seg.size:].any():
      raise PayloadError(f"{where}: bitmap has bits set past the segment end")
    indices = np.flatnonzero(mask).astype(np.int32)
    if len(indices) != count:
      raise PayloadError(f"{where}: bitmap has {len(indices)} bits set, the record says {count}")
  else:
    raise PayloadError(f"{where}: unknown mode {mode}")
  return SegmentPayload(mode, indices, reader.array(seg.bit_dtype, count, where))
