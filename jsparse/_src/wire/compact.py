"""The body of a compact (format 2) payload: changes as gap-coded keys and ulp codes, zstd'd.

Each sparse segment names its changes by *keys* in ascending order: ranks in the exponent-class
order (mode BY_RANK, see ``ranks.py``) or flat positions (mode BY_POSITION), and gives each
change as an *ulp code* against the old bits (see ``ulp_codes.py``). The body is::

  segment table   per segment: mode u8 | count u32 (changes; DENSE: the segment size)
  gaps stream     every sparse segment's key gaps (first key, then key - previous key - 1),
                  LEB128 varints
  codes stream    one byte per change: its zigzagged ulp code, 255 meaning "escaped"
  escapes stream  for each escaped change, zigzagged code - 255 as a varint
  dense           the DENSE segments' bit patterns, little-endian, uncompressed

Each stream is ``raw length u32 | packed length u32 | zstd frame`` (nothing when empty).
Decoding checks every length against the plan before decompressing (so a hostile length cannot
allocate or hang), then every count, key and code.

>>> import numpy as np
>>> varint_decode(varint_encode(np.array([0, 127, 128, 2**31 - 1])), 4, 'x', 2**31).tolist()
[0, 127, 128, 2147483647]
"""

from __future__ import annotations

import struct
from typing import Iterable, Iterator

import numpy as np
import zstandard

from jsparse._src.core.plan import Plan, Segment
from jsparse._src.errors import PayloadError
from jsparse._src.device import ulp_codes
from jsparse._src.wire.payload import RECORD, Mode, SegmentPayload
from jsparse._src.wire.reader import Reader

_STREAM = struct.Struct("<II")
_MAX_VARINT_BYTES = 10  # any 64-bit value
_ESCAPE = 255
_ZSTD_LEVEL = 3
_BLOCK = 1 << 16  # changes coded at a time: bounds the host temporaries, whatever the payload


def varint_encode(values: np.ndarray) -> bytes:
  """LEB128 bytes of non-negative integers (any up to 2**64 - 1), coded a block at a time (the
  bytes of a sequence are the bytes of its blocks, joined)."""
  values = np.asarray(values)
  if values.size > _BLOCK:
    return b"".join(varint_encode(values[i:i + _BLOCK]) for i in range(0, values.size, _BLOCK))
  if not values.size:
    return b""
  top = int(values.max())
  if top < 0x80:  # one byte each: the common case of small gaps and codes
    return values.astype(np.uint8).tobytes()
  wide = np.uint32 if top < 2**32 else np.uint64
  values = values.astype(wide)
  long = np.flatnonzero(values >= wide(0x80))
  if 4 * len(long) > len(values):
    return _varint_table(values, _varint_bytes(top))
  # Few long ones: each value's low 7 bits, then the long ones' higher bits inserted after them.
  first = (values & wide(0x7F)).astype(np.uint8)
  first[long] |= np.uint8(0x80)
  tail = np.frombuffer(varint_encode(values[long] >> wide(7)), np.uint8)
  lengths = np.diff(np.flatnonzero(tail < 0x80), prepend=-1)  # each ends at its byte < 0x80
  return np.insert(first, np.repeat(long + 1, lengths), tail).tobytes()


def _varint_table(values: np.ndarray, width: int) -> bytes:
  """LEB128 bytes of unsigned ``values``, none longer than ``width`` bytes: a (value, byte)
  table, the unused bytes masked out."""
  groups = values[:, None] >> (values.dtype.type(7) * np.arange(width, dtype=values.dtype))
  used = groups != 0
  used[:, 0] = True
  table = (groups & values.dtype.type(0x7F)).astype(np.uint8)
  table[:, :-1] |= used[:, 1:].view(np.uint8) << np.uint8(7)
  return table[used].tobytes()


def varint_decode(data: bytes, count: int, what: str, limit: int,
                  dtype: np.dtype = np.uint64) -> np.ndarray:
  """Exactly ``count`` varints filling ``data``, each below ``limit`` (<= 2**64), as ``dtype``
  (wide enough for ``limit - 1``), parsed a window of bytes at a time.

  Raises:
    PayloadError: a different number of varints, one longer than it can be below ``limit``,
      or one at or above ``limit``.
  """
  raw = np.frombuffer(data, np.uint8)
  values, end = _varints(raw, 0, count, what, limit, dtype)
  if end != len(raw):
    raise PayloadError(f"{what}: expected {count} varints in {len(raw)} bytes")
  return values


def _varints(raw: np.ndarray, start: int, count: int, what: str, limit: int,
             dtype: np.dtype) -> tuple[np.ndarray, int]:
  """The ``count`` varints that start at byte ``start`` of ``raw`` (see :func:`varint_decode`),
  and where the next one starts."""
  max_bytes = _varint_bytes(limit - 1)
  values = np.zeros(count, dtype)
  done = 0  # varints decoded; ``start``: where the next one starts
  for window in range(start, len(raw), _BLOCK):
    if done == count:
      break
    ends = np.flatnonzero(raw[window:window + _BLOCK] < 0x80)[:count - done] + window
    if not len(ends):
      continue
    starts = np.concatenate([[start], ends[:-1] + 1])
    lengths = ends - starts + 1
    if lengths.max() > max_bytes:
      raise PayloadError(f"{what}: a varint longer than {max_bytes} bytes")
    block = (raw[starts] & np.uint8(0x7F)).astype(np.uint64)
    high = False  # bits past 64 (only a hostile 10-byte varint has them)
    longer = np.flatnonzero(lengths > 1)  # few: the rest are done
    for k in range(1, max_bytes):
      longer = longer[lengths[longer] > k]
      if not len(longer):
        break
      part = raw[starts[longer] + k].astype(np.uint64) & np.uint64(0x7F)
      if 7 * k + 7 > 64:
        high = high or bool(np.any((part >> np.uint64(64 - 7 * k)) != 0))
      block[longer] |= part << np.uint64(7 * k)
    if high or int(block.max()) >= limit:
      raise PayloadError(f"{what}: a value at or above {limit}")
    values[done:done + len(ends)] = block
    done, start = done + len(ends), int(ends[-1]) + 1
  if done != count:
    raise PayloadError(f"{what}: expected {count} varints in {len(raw)} bytes")
  return values, start


def _varint_bytes(value: int) -> int:
  """Bytes of the LEB128 coding of ``value``."""
  return max(1, -(-value.bit_length() // 7))


def _pack_stream(raw: bytes) -> bytes:
  packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw) if raw else b""
  return _STREAM.pack(len(raw), len(packed)) + packed


def _sparse_streams(keys: np.ndarray, values: np.ndarray, dtype: np.dtype):
  """The raw bytes of one segment's changes in the three streams (gaps, codes, escapes), a
  block of changes at a time: the temporaries are a block's, not the segment's."""
  for i in range(0, len(keys), _BLOCK):
    block = np.asarray(keys[i:i + _BLOCK], np.int64)
    gaps = np.diff(block, prepend=block.dtype.type(keys[i - 1] if i else -1)) - 1
    zigzags = ulp_codes.zigzag(np.asarray(values[i:i + _BLOCK], dtype))
    escaped = zigzags[zigzags >= _ESCAPE].astype(np.uint64) - np.uint64(_ESCAPE)
    yield (varint_encode(gaps), np.minimum(zigzags, _ESCAPE).astype(np.uint8).tobytes(),
           varint_encode(escaped))


def encode_body(plan: Plan, segments: Iterable[SegmentPayload]) -> bytes:
  """The body bytes of format-2 ``segments``."""
  table, streams, dense = [], ([], [], []), []
  for seg, part in zip(plan.segments, segments):
    if part.mode == Mode.DENSE:
      table.append(RECORD.pack(Mode.DENSE, seg.size))
      dense.append(np.ascontiguousarray(part.values, seg.bit_dtype.newbyteorder("<")).tobytes())
      continue
    table.append(RECORD.pack(part.mode if len(part.indices) else Mode.EMPTY, len(part.indices)))
    for pieces in _sparse_streams(part.indices, part.values, seg.bit_dtype):
      for stream, raw in zip(streams, pieces):
        stream.append(raw)
  packed = []
  for raw in streams:  # each stream's pieces dropped once joined: one stream is held twice
    joined = b"".join(raw)
    raw.clear()
    packed.append(_pack_stream(joined))
    del joined
  return b"".join(table + packed + dense)


def _unpack_stream(reader: Reader, what: str, max_raw: int) -> bytes:
  raw_len, packed_len = _STREAM.unpack(reader.take(_STREAM.size, f"{what} lengths"))
  if raw_len > max_raw:
    raise PayloadError(f"{what}: {raw_len} bytes announced, at most {max_raw} possible")
  packed = reader.take(packed_len, what)
  if not raw_len:
    if packed_len:
      raise PayloadError(f"{what}: {packed_len} packed bytes for an empty stream")
    return b""
  try:
    # A frame that states its size is decoded into a buffer of that size: a corrupt one
    # must not make it allocate more than the stream announces.
    stated = zstandard.get_frame_parameters(packed).content_size
    if stated not in (zstandard.CONTENTSIZE_UNKNOWN, raw_len):
      raise PayloadError(f"{what}: its zstd frame states {stated} bytes, {raw_len} announced")
    raw = zstandard.ZstdDecompressor().decompress(packed, max_output_size=raw_len)
  except zstandard.ZstdError as e:
    raise PayloadError(f"{what}: zstd cannot decode it ({e})") from e
  if len(raw) != raw_len:
    raise PayloadError(f"{what}: {len(raw)} bytes decoded, {raw_len} announced")
  return raw


def _segment_table(plan: Plan, reader: Reader) -> list[tuple[Mode, int]]:
  """Each segment's (mode, count), the counts checked against the plan before any stream is
  read (they bound every allocation that follows)."""
  table = []
  for s, seg in enumerate(plan.segments):
    where = plan.describe_segment(s)
    mode, count = RECORD.unpack(reader.take(RECORD.size, f"{where} record"))
    if mode not in (Mode.EMPTY, Mode.DENSE, Mode.BY_RANK, Mode.BY_POSITION):
      raise PayloadError(f"{where}: unknown mode {mode}")
    expected = {Mode.DENSE: count == seg.size, Mode.EMPTY: count == 0}.get(
        Mode(mode), 0 < count <= seg.sparse_limit)
    if not expected:
      raise PayloadError(f"{where}: a {Mode(mode).name} record of {count} elements (segment "
                         f"size {seg.size}, capacity {seg.capacity})")
    table.append((Mode(mode), count))
  return table


def decode_body(plan: Plan, reader: Reader) -> tuple[SegmentPayload, ...]:
  """Inverse of :func:`encode_body`. Lengths, counts and code widths are checked while parsing;
  ``payload.check_records`` checks the rest."""
  return tuple(iter_body(plan, reader))


def iter_body(plan: Plan, reader: Reader) -> Iterator[SegmentPayload]:
  """:func:`decode_body` a segment at a time: the streams are decompressed first, then each
  segment's changes are parsed as it is asked for, so only one segment's records are
  decoded at once (the streams are checked to the end after the last)."""
  table = _segment_table(plan, reader)
  total = sum(count for mode, count in table if mode not in (Mode.EMPTY, Mode.DENSE))
  gaps = np.frombuffer(_unpack_stream(reader, "gaps stream", _varint_bytes(2**31) * total),
                       np.uint8)
  code_bytes = np.frombuffer(_unpack_stream(reader, "codes stream", total), np.uint8)
  if len(code_bytes) != total:
    raise PayloadError(f"codes stream: {len(code_bytes)} codes for {total} changes")
  num_escaped = int(np.count_nonzero(code_bytes == _ESCAPE))
  escapes = np.frombuffer(
      _unpack_stream(reader, "escapes stream", _MAX_VARINT_BYTES * num_escaped), np.uint8)
  at, gaps_at, escapes_at = 0, 0, 0  # changes, gap bytes and escape bytes read
  for s, (seg, (mode, count)) in enumerate(zip(plan.segments, table)):
    where = plan.describe_segment(s)
    if mode == Mode.DENSE:
      raw = reader.take(count * seg.bit_dtype.itemsize, where)
      dense = np.frombuffer(raw, seg.bit_dtype.newbyteorder("<")).astype(seg.bit_dtype)
      yield SegmentPayload(Mode.DENSE, None, dense)
      continue
    if mode == Mode.EMPTY:
      yield SegmentPayload(Mode.EMPTY, np.zeros(0, np.int32), np.zeros(0, seg.bit_dtype))
      continue
    segment_gaps, gaps_at = _varints(gaps, gaps_at, count, "gaps stream", 2**31, np.uint32)
    codes = code_bytes[at:at + count]
    segment_escapes, escapes_at = _varints(escapes, escapes_at,
                                           int(np.count_nonzero(codes == _ESCAPE)),
                                           "escapes stream", 2**64 - _ESCAPE, np.uint64)
    yield _segment_changes(seg, where, mode, segment_gaps, codes, segment_escapes)
    at += count
  for what, stream, read in (("gaps stream", gaps, gaps_at),
                             ("escapes stream", escapes, escapes_at)):
    if read != len(stream):
      raise PayloadError(f"{what}: {len(stream) - read} bytes past its last varint")


def _segment_changes(seg: Segment, where: str, mode: Mode, gaps: np.ndarray,
                     code_bytes: np.ndarray, escapes: np.ndarray) -> SegmentPayload:
  """One segment's record from its gaps, code bytes and escapes."""
  count = len(gaps)
  keys = gaps.view(np.int32)  # each block of gaps becomes its keys in place (< 2**31)
  values = np.empty(count, seg.bit_dtype)
  last, escaped_before = -1, 0
  for i in range(0, count, _BLOCK):  # a block of changes at a time: bounded temporaries
    block = np.cumsum(gaps[i:i + _BLOCK].astype(np.int64) + 1) + last
    if block[-1] >= seg.size:
      raise PayloadError(f"{where}: key {block[-1]} out of range (size {seg.size})")
    keys[i:i + _BLOCK], last = block, int(block[-1])
    codes = code_bytes[i:i + _BLOCK].astype(np.uint64)
    escaped = codes == _ESCAPE
    num = int(np.count_nonzero(escaped))
    codes[escaped] += escapes[escaped_before:escaped_before + num]
    escaped_before += num
    if int(codes.max()) > np.iinfo(seg.bit_dtype).max:
      raise PayloadError(f"{where}: an ulp code wider than {seg.bit_dtype}")
    values[i:i + _BLOCK] = ulp_codes.unzigzag(codes.astype(seg.bit_dtype))
  return SegmentPayload(mode, keys, values)
