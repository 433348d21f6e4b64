"""The body of a format 1 (lists) payload: positions and raw new bit patterns.

One record per segment::

  segment  mode u8 | count u32 | positions | values
           EMPTY: nothing; LIST: per 65536-element chunk of the segment the number of its
           changes (u32), then each change's index within its chunk (u16), then ``count``
           values; BITMAP: ceil(size/8) bytes of little-endian bits then ``count`` values;
           DENSE: ``size`` values.

Values are the rollout bit patterns, little-endian. The receiver needs no pass over its params:
4 bytes per change for 16-bit dtypes, the format for fast links.

>>> import numpy as np, jax.numpy as jnp, jsparse
>>> from jsparse._src.wire.payload import Mode, SegmentPayload
>>> from jsparse._src.wire.reader import Reader
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
>>> body = encode_body(plan, [SegmentPayload(Mode.LIST, np.array([3]), np.array([7], np.uint32))])
>>> decode_body(plan, Reader(body))[0].indices.tolist()
[3]
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from jsparse._src.core.plan import Plan
from jsparse._src.errors import PayloadError
from jsparse._src.wire.payload import CHUNK_BITS, RECORD, Mode, SegmentPayload
from jsparse._src.wire.reader import Reader


def _num_chunks(size: int) -> int:
  return -(-size // (1 << CHUNK_BITS))


def encode_body(plan: Plan, segments: Iterable[SegmentPayload]) -> bytes:
  """The body bytes of format-1 ``segments``."""
  chunks = []
  for seg, part in zip(plan.segments, segments):
    values = np.ascontiguousarray(part.values, seg.bit_dtype.newbyteorder("<"))
    if part.mode == Mode.DENSE:
      chunks += [RECORD.pack(Mode.DENSE, seg.size), values.tobytes()]
      continue
    count = len(part.indices)
    mode = part.mode if count else Mode.EMPTY
    chunks.append(RECORD.pack(mode, count))
    if mode == Mode.LIST:
      per_chunk = np.bincount(part.indices >> CHUNK_BITS, minlength=_num_chunks(seg.size))
      chunks += [per_chunk.astype("<u4").tobytes(), part.indices.astype("<u2").tobytes()]
    elif mode == Mode.BITMAP:
      mask = np.zeros(seg.size, bool)
      mask[part.indices] = True
      chunks.append(np.packbits(mask, bitorder="little").tobytes())
    chunks.append(values.tobytes())
  return b"".join(chunks)


def decode_body(plan: Plan, reader: Reader) -> tuple[SegmentPayload, ...]:
  """Inverse of :func:`encode_body`. Lengths and counts are checked while parsing;
  ``payload.check_records`` checks the rest."""
  return tuple(iter_body(plan, reader))


def iter_body(plan: Plan, reader: Reader) -> Iterator[SegmentPayload]:
  """:func:`decode_body` a segment at a time, as it is asked for."""
  return (_decode_segment(plan, reader, s) for s in range(len(plan.segments)))


def _decode_segment(plan: Plan, reader: Reader, s: int) -> SegmentPayload:
  seg = plan.segments[s]
  where = plan.describe_segment(s)
  mode, count = RECORD.unpack(reader.take(RECORD.size, f"{where} record"))
  if mode == Mode.DENSE:
    if count != seg.size:
      raise PayloadError(f"{where}: dense record of {count} elements, the plan has {seg.size}")
    return SegmentPayload(Mode.DENSE, None, reader.array(seg.bit_dtype, seg.size, where))
  if mode == Mode.EMPTY:
    if count:
      raise PayloadError(f"{where}: empty record with count {count}")
    return SegmentPayload(Mode.EMPTY, np.zeros(0, np.int32), np.zeros(0, seg.bit_dtype))
  if count > seg.sparse_limit:
    raise PayloadError(f"{where}: {count} changes exceed the {seg.sparse_limit} a sparse record "
                       "of it may carry")
  if mode == Mode.LIST:
    per_chunk = reader.array(np.uint32, _num_chunks(seg.size), where)
    if int(per_chunk.sum(dtype=np.int64)) != count:
      raise PayloadError(f"{where}: chunk counts add up to {per_chunk.sum()}, not {count}")
    low = reader.array(np.uint16, count, where).astype(np.int32)
    indices = np.repeat(np.arange(len(per_chunk), dtype=np.int32), per_chunk) << CHUNK_BITS | low
  elif mode == Mode.BITMAP:
    packed = reader.array(np.uint8, (seg.size + 7) // 8, where)
    mask = np.unpackbits(packed, bitorder="little")
    if mask[seg.size:].any():
      raise PayloadError(f"{where}: bitmap has bits set past the segment end")
    indices = np.flatnonzero(mask).astype(np.int32)
    if len(indices) != count:
      raise PayloadError(f"{where}: bitmap has {len(indices)} bits set, the record says {count}")
  else:
    raise PayloadError(f"{where}: unknown mode {mode}")
  return SegmentPayload(Mode(mode), indices, reader.array(seg.bit_dtype, count, where))
