"""The bytes of a sync payload: header, body, checksum. ``encode`` and ``decode`` mirror each
other: ``decode(plan, encode(plan, p))`` equals ``p`` for every payload ``check_records`` accepts.

Layout, little-endian::

  header   magic "JSPS" | format u8 | kind u8 | reserved u16 | plan fingerprint 16B
           | base version u64 | version u64 | base digest 8B | new digest 8B | segments u32
  body     format 1: ``lists.py``; format 2: ``compact.py``; format 3: ``packed.py``
  trailer  crc32 of everything before it, u32

:func:`decode` checks everything (the checksum first, every length before it allocates, then
:func:`~jsparse._src.wire.payload.check_records`) before returning, so a payload that decodes
can be applied without further failure. :func:`decode_lazily` does the same a segment at a
time, for a receiver that moves each record to its devices as it is decoded.

>>> import numpy as np, jax.numpy as jnp, jsparse
>>> from jsparse._src.wire.payload import Format, Kind, Mode, Payload, SegmentPayload
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
>>> seg = SegmentPayload(Mode.LIST, np.array([3], np.int32), np.array([7], np.uint32))
>>> p = Payload(Kind.DELTA, 0, 1, b'\\0' * 8, b'\\1' * 8, (seg,), Format.LISTS)
>>> decode(plan, encode(plan, p)).segments[0].indices.tolist()
[3]
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Iterator, Sequence

from jsparse._src.core.plan import Plan
from jsparse._src.errors import PayloadError
from jsparse._src.wire import compact, lists
from jsparse._src.wire.payload import (Format, Kind, Payload, SegmentPayload, check_modes,
                                       check_record, check_versions)
from jsparse._src.wire.reader import Reader

MAGIC = b"JSPS"
HEADER = struct.Struct("<4sBBH16sQQ8s8sI")
_CRC = struct.Struct("<I")
_BODIES = {Format.LISTS: lists, Format.COMPACT: compact}


def encode(plan: Plan, payload: Payload) -> bytes:
  """Serializes ``payload`` (which must match ``plan``) to bytes. Its segments may be any
  iterable of one record per segment of the plan (a generator: each record is coded as it
  comes)."""
  return frame(plan, payload, encode_records(plan, payload.format, payload.segments))


def encode_records(plan: Plan, fmt: Format, segments) -> bytes:
  """The body of format 1 or 2 of one record per segment of ``plan`` (any iterable)."""
  records = iter(segments)
  body = _BODIES[fmt].encode_body(plan, _exactly(len(plan.segments), records))
  if next(records, None) is not None:
    raise PayloadError(f"payload has more segments than the plan's {len(plan.segments)}")
  return body


def frame(plan: Plan, header: Payload, body: bytes | Sequence) -> bytes:
  """The payload bytes of a body coded elsewhere (format 3's, on the device): ``header``'s
  fields (its segments are not looked at), the body (bytes, or a list of buffers: joined once
  here, with the header and checksum), the checksum."""
  pieces = [body] if isinstance(body, (bytes, bytearray, memoryview)) else list(body)
  head = HEADER.pack(MAGIC, header.format, header.kind, 0, plan.fingerprint,
                     header.base_version, header.version, header.base_digest,
                     header.new_digest, len(plan.segments))
  crc = zlib.crc32(head)
  for piece in pieces:
    crc = zlib.crc32(piece, crc)
  return b"".join((head, *pieces, _CRC.pack(crc)))


def _exactly(count: int, records: Iterator[SegmentPayload]) -> Iterator[SegmentPayload]:
  """The first ``count`` of ``records``; an error if there are fewer."""
  for i in range(count):
    record = next(records, None)
    if record is None:
      raise PayloadError(f"payload has {i} segments, the plan {count}")
    yield record


def decode(plan: Plan, data: bytes) -> Payload:
  """Parses and fully validates ``data`` against ``plan``.

  Raises:
    PayloadError: for anything that is not a well-formed payload of this plan: wrong magic,
      format or plan, bad checksum, truncation, trailing bytes, indices out of range, unsorted
      or duplicated, counts over capacity.
  """
  header, records = decode_lazily(plan, data)
  return dataclasses.replace(header, segments=tuple(records))


def decode_lazily(plan: Plan, data: bytes) -> tuple[Payload, Iterator[SegmentPayload]]:
  """:func:`decode` a segment at a time: the header (a :class:`Payload` without segments), its
  checksum and versions checked, and an iterator of the segments' records, each decoded and
  checked as it is asked for. A caller must iterate to the end before using any record: the
  checks that span the payload (its trailing bytes, ranks mixed with positions) run after
  the last. Only one segment's records need be on the host at a time.

  Raises:
    PayloadError: as :func:`decode`, from this call or while iterating.
  """
  header, reader = read_header(plan, data)
  if header.format == Format.PACKED:
    raise PayloadError("a packed (format 3) payload has no per-segment records: apply it with "
                       "Receiver.receive")
  return header, checked_records(plan, header, reader)


def read_header(plan: Plan, data: bytes) -> tuple[Payload, Reader]:
  """The checked header of payload ``data`` (a :class:`Payload` without segments: checksum,
  magic, format, plan and versions checked) and a reader at the start of its body.

  Raises:
    PayloadError: as :func:`decode`, for the header and the checksum.
  """
  if not isinstance(data, (bytes, bytearray, memoryview)):
    raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
  data = bytes(data)  # immutable (no copy of bytes): decoded arrays may view it
  if len(data) < HEADER.size + _CRC.size:
    raise PayloadError(f"payload truncated: {len(data)} bytes is shorter than a header")
  if data[:4] != MAGIC:
    raise PayloadError("not a jsparse payload (bad magic)")
  # Read through a view: slicing the bytes would copy the payload, and each stream again.
  body, (crc,) = memoryview(data)[:-_CRC.size], _CRC.unpack(data[-_CRC.size:])
  if zlib.crc32(body) != crc:
    raise PayloadError("payload checksum mismatch: corrupted or truncated")
  reader = Reader(body)
  (_, fmt, kind, _, fingerprint, base_version, version, base_digest, new_digest,
   num_segments) = HEADER.unpack(reader.take(HEADER.size, "header"))
  if fmt not in tuple(Format):
    raise PayloadError(f"payload format {fmt} is not supported (this jsparse reads 1 to 3)")
  if kind not in tuple(Kind):
    raise PayloadError(f"unknown payload kind {kind}")
  if fingerprint != plan.fingerprint:
    raise PayloadError("payload was made for another plan (fingerprint differs): make the "
                       "rollout's plan with make_plan from the same tree (or its shapes) and "
                       "the same options as the trainer's")
  if num_segments != len(plan.segments):
    raise PayloadError(f"payload has {num_segments} segments, the plan {len(plan.segments)}")
  header = Payload(Kind(kind), base_version, version, base_digest, new_digest, (), Format(fmt))
  check_versions(header)
  return header, reader


def checked_records(plan: Plan, header: Payload, reader: Reader) -> Iterator[SegmentPayload]:
  """The records of a body of format 1 or 2 after ``read_header``, each checked as it comes;
  then the checks that span the payload."""
  modes = []
  for s, record in enumerate(_BODIES[header.format].iter_body(plan, reader)):
    check_record(plan, header, s, record)
    modes.append(record.mode)
    yield record
  if reader.remaining:
    raise PayloadError(f"{reader.remaining} unexpected bytes after the last segment")
  check_modes(plan, modes)
