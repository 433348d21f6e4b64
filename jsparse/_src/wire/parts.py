"""The bytes of a payload *part*: what one trainer process of a multi-controller job sends.

The parts of one version together carry the whole update; each is self-describing, so a
rollout process reads every part's index (a few bytes per unit) and then only the unit bodies
that overlap its own blocks. Layout, little-endian::

  header  magic "JSPP" | format u8 | kind u8 | flags u16 (bit 0: ordered segments by rank)
          | plan fingerprint 16B | base version u64 | version u64 | base digest 8B
          | new digest 8B | part u32 | parts u32 | units u32 | table bytes u32
  table   per unit: segment u32 | mode u8 | count u32 | body bytes u32 | body crc32 u32
          | runs u16 | per run of consecutive blocks: first block u32, blocks u32
  crc     crc32 of header and table, u32
  bodies  per unit in table order: its record as a one-segment body of the format
          (``compact.py``'s, or ``packed.py``'s unit body) in the unit's own index
          space (``units.py``)

>>> import numpy as np, jax.numpy as jnp, jsparse
>>> from jsparse._src.wire.payload import Mode, SegmentPayload, Format, Kind
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
>>> record = SegmentPayload(Mode.BY_POSITION, np.array([3], np.int32), np.array([1], np.uint32))
>>> head = PartHeader(Format.COMPACT, Kind.DELTA, False, 0, 1, bytes(8), bytes(8), 0, 1)
>>> data = encode_part(plan, head, [Unit(0)], [record])
>>> index = read_index(plan, data)
>>> read_unit(plan, index, data, 0).indices.tolist(), index.entries[0].count
([3], 1)
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Sequence

import numpy as np

from jsparse._src.core.plan import Plan
from jsparse._src.errors import PayloadError
from jsparse._src.threads import parallel_map
from jsparse._src.core.units import Unit, unit_slots
from jsparse._src.wire import compact, packed
from jsparse._src.wire.payload import (MAX_VERSION, Format, Kind, Mode, Payload, SegmentPayload,
                                       check_records)
from jsparse._src.wire.reader import Reader

MAGIC = b"JSPP"
# Containers this jsparse no longer reads, and what to do with one.
RETIRED = {b"JSPS": "this is a whole payload (container 'JSPS', payload formats 1-3), which "
                    "jsparse 0.1 wrote; this jsparse reads parts (container 'JSPP') only, a "
                    "whole payload being a version of one part: have a sender of this jsparse "
                    "send the version again (or an anchor)"}
HEADER = struct.Struct("<4sBBH16sQQ8s8sIIII")
ENTRY = struct.Struct("<IBIIIH")
RUN = struct.Struct("<II")
_CRC = struct.Struct("<I")
# Part formats this jsparse no longer reads, and what to do with one.
RETIRED_FORMATS = {1: "format 1 (positions and raw bits, coding 'lists'), which jsparse 0.1 "
                      "and the 0.2 development versions wrote; this jsparse reads formats 2 "
                      "('ranked', 'positioned') and 3 ('packed'): have a sender of this "
                      "jsparse send the version again (or an anchor)"}
_RANKED = 1
MAX_PARTS = 1 << 16
MAX_BLOCKS = 1 << 20  # blocks of one leaf (devices of a mesh): bounds what a table can ask for


@dataclasses.dataclass(frozen=True)
class PartHeader:
  """What every part of one version states alike, plus which part it is."""

  format: Format
  kind: Kind
  ranked: bool  # the ordered segments' changes are named by rank
  base_version: int
  version: int
  base_digest: bytes
  new_digest: bytes
  part: int
  parts: int

  def same_version(self) -> tuple:
    """The fields every part of one version must share."""
    return (self.format, self.kind, self.ranked, self.base_version, self.version,
            self.base_digest, self.new_digest, self.parts)


@dataclasses.dataclass(frozen=True)
class UnitEntry:
  """A unit's line in a part's table: where its body lies and what it holds."""

  unit: Unit
  mode: Mode
  count: int  # sparse changes (DENSE: the unit's size)
  start: int  # of the body, in the part's bytes
  length: int
  crc: int


@dataclasses.dataclass(frozen=True)
class PartIndex:
  """A part's header and table, read and checked."""

  header: PartHeader
  entries: tuple[UnitEntry, ...]
  size: int  # bytes of the whole part


def encode_part(plan: Plan, header: PartHeader, units: Sequence[Unit],
                records: Sequence, threads: int | None = None) -> bytes:
  """The bytes of one part: ``records[i]`` is unit ``units[i]``'s record in its index space,
  or a function that makes it, called when the unit is coded (so that only the units being
  coded hold their records on the host). Units are coded on ``threads`` threads (default
  ``JSPARSE_THREADS``)."""
  def body_of(unit_record: tuple) -> tuple[Mode, int, bytes]:
    unit, record = unit_record
    record = record() if callable(record) else record
    mode = record.mode if record.mode == Mode.DENSE or record.count else Mode.EMPTY
    count = len(record.values) if mode == Mode.DENSE else record.count
    if mode == Mode.EMPTY:
      return mode, count, b""
    if header.format == Format.PACKED:
      return mode, count, packed.encode_unit(record)
    return mode, count, compact.encode_body(unit_slots(plan, unit), [record])

  coded = parallel_map(body_of, zip(units, records), threads)  # zstd, NumPy release the GIL
  bodies = [body for _, _, body in coded]
  table = []
  for unit, (mode, count, body) in zip(units, coded):
    runs = _runs(unit.blocks)
    table.append(ENTRY.pack(unit.segment, mode, count, len(body), zlib.crc32(body), len(runs))
                 + b"".join(RUN.pack(*run) for run in runs))
  table_bytes = b"".join(table)
  head = HEADER.pack(MAGIC, header.format, header.kind, _RANKED if header.ranked else 0,
                     plan.fingerprint, header.base_version, header.version, header.base_digest,
                     header.new_digest, header.part, header.parts, len(units), len(table_bytes))
  return head + table_bytes + _CRC.pack(zlib.crc32(head + table_bytes)) + b"".join(bodies)


def _runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
  """Sorted ``blocks`` as runs of consecutive ids: (first, length)."""
  runs: list[list[int]] = []
  for b in blocks:
    if runs and runs[-1][0] + runs[-1][1] == b:
      runs[-1][1] += 1
    else:
      runs.append([b, 1])
  return [tuple(r) for r in runs]


def _slice(data, start: int, stop: int, what: str) -> bytes:
  if stop > len(data):
    raise PayloadError(f"part truncated while reading {what}")
  return bytes(data[start:stop])


def _head_and_table(data, start: int) -> tuple[bytes, bytes]:
  """The header and unit table of the part at ``start`` of ``data``, their checksum checked."""
  head = _slice(data, start, start + HEADER.size, "the header")
  if head[:len(MAGIC)] != MAGIC:
    raise PayloadError("not a jsparse payload part (bad magic)")
  table_end = start + HEADER.size + HEADER.unpack(head)[-1]
  table = _slice(data, start + HEADER.size, table_end, "the unit table")
  (crc,) = _CRC.unpack(_slice(data, table_end, table_end + _CRC.size, "the table checksum"))
  if zlib.crc32(head + table) != crc:
    raise PayloadError("part header checksum mismatch: corrupted or truncated")
  return head, table


def _part_length(data, start: int) -> int:
  """Bytes of the part that begins at ``start`` of ``data``, from its header and unit table:
  at most what is left of ``data`` (a truncated part is then named by :func:`read_index`)."""
  if start and bytes(data[start:start + len(MAGIC)]) != MAGIC:
    raise PayloadError(f"the {len(data) - start} bytes after byte {start} are not a part: a "
                       "payload is one part or several joined, nothing else")
  head, table = _head_and_table(data, start)
  reader, bodies = Reader(table), 0
  for _ in range(HEADER.unpack(head)[-2]):
    *_, length, _, num_runs = ENTRY.unpack(reader.take(ENTRY.size, "a unit entry"))
    reader.take(RUN.size * num_runs, "a unit's blocks")
    bodies += length
  return min(HEADER.size + len(table) + _CRC.size + bodies, len(data) - start)


def split_parts(data) -> list:
  """The parts in ``data``: one part, or several parts joined (:meth:`jsparse.Version.join`, in
  any order), as zero-copy slices where ``data`` has a buffer (``bytes``, an ``mmap``). Each
  part's bytes are found from its header and unit table; :func:`read_index` checks each.

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'a': jnp.zeros(70000), 'b': jnp.zeros(70000)})
  >>> version = jsparse.Sender(plan, {'a': jnp.zeros(70000), 'b': jnp.zeros(70000)}).send_stream(
  ...     {'a': jnp.ones(70000), 'b': jnp.ones(70000)}, chunk_bytes=300_000)
  >>> parts = list(version)
  >>> [len(p) for p in split_parts(b"".join(parts))] == [len(p) for p in parts]
  True
  """
  if bytes(data[:len(MAGIC)]) != MAGIC:
    return [data]  # not a part: read_index names what it is
  try:
    view = memoryview(data)
  except TypeError:
    view = data
  parts, start = [], 0
  while start < len(view):
    end = start + _part_length(view, start)
    if start == 0 and end == len(view):
      return [data]  # one part: as it came
    parts.append(view[start:end])
    start = end
  return parts


def read_index(plan: Plan, data) -> PartIndex:
  """Reads and checks a part's header and table from ``data`` (bytes, or anything with
  ``len`` and slicing, e.g. an ``mmap``: only the header and table are read).

  Raises:
    PayloadError: bad magic, plan, checksum, versions or table (units out of the plan).
  """
  if bytes(data[:len(MAGIC)]) in RETIRED:
    raise PayloadError(RETIRED[bytes(data[:len(MAGIC)])])
  head, table = _head_and_table(data, 0)
  (magic, fmt, kind, flags, fingerprint, base_version, version, base_digest, new_digest, part,
   parts, num_units, table_len) = HEADER.unpack(head)
  table_end = HEADER.size + table_len
  if fingerprint != plan.fingerprint:
    raise PayloadError("part was made for another plan (fingerprint differs): make the "
                       "rollout's plan with make_plan from the same tree (or its shapes) and "
                       "the same options as the trainer's")
  if fmt in RETIRED_FORMATS:
    raise PayloadError(f"part of {RETIRED_FORMATS[fmt]}")
  if fmt not in tuple(Format) or kind not in tuple(Kind) or flags & ~_RANKED:
    raise PayloadError(f"part format {fmt}, kind {kind} or flags {flags} not supported")
  if not 0 <= part < parts <= MAX_PARTS:
    raise PayloadError(f"part {part} of {parts}: not a valid part number")
  if not 0 <= base_version < version < MAX_VERSION:
    raise PayloadError(f"part turns version {base_version} into {version}: versions must "
                       "increase and stay below 2**63")
  header = PartHeader(Format(fmt), Kind(kind), bool(flags & _RANKED), base_version, version,
                      base_digest, new_digest, part, parts)
  reader, entries = Reader(table), []
  start = table_end + _CRC.size
  for _ in range(num_units):
    segment, mode, count, length, body_crc, num_runs = ENTRY.unpack(
        reader.take(ENTRY.size, "a unit entry"))
    runs = reader.array(np.uint32, 2 * num_runs, "a unit's blocks").reshape(-1, 2)
    if np.any(runs[:, 1] == 0) or runs[:, 1].sum(dtype=np.int64) > MAX_BLOCKS:
      raise PayloadError(f"unit of segment {segment}: block runs {runs.tolist()[:4]} are empty "
                         "or too long")
    blocks = tuple(int(b) for first, n in runs.astype(np.int64) for b in range(first, first + n))
    unit = _check_unit(plan, header, Unit(segment, blocks), mode, count, length)
    entries.append(UnitEntry(unit, Mode(mode), count, start, length, body_crc))
    start += length
  if reader.remaining:
    raise PayloadError(f"{reader.remaining} unexpected bytes in the unit table")
  if start != len(data):
    raise PayloadError(f"part truncated or extended: it is {len(data)} bytes, its table accounts "
                       f"for {start}")
  return PartIndex(header, tuple(entries), len(data))


def _check_unit(plan: Plan, header: PartHeader, unit: Unit, mode: int, count: int,
                length: int) -> Unit:
  if unit.segment >= len(plan.segments):
    raise PayloadError(f"unit of segment {unit.segment}: the plan has {len(plan.segments)}")
  seg = plan.segments[unit.segment]
  blocks = np.asarray(unit.blocks)
  if (not len(blocks) or np.any(np.diff(blocks) <= 0) or blocks[-1] >= seg.blocks
      or (seg.blocks == 1 and unit.blocks != (0,))):
    raise PayloadError(f"{plan.describe_segment(unit.segment)}: blocks {unit.blocks[:8]} are "
                       f"not sorted distinct blocks of {seg.blocks}")
  slots = unit_slots(plan, unit)
  slot = slots.segments[0]
  if mode not in tuple(Mode):
    raise PayloadError(f"{slots.name}: mode {mode} is not one of {[m.name for m in Mode]}")
  # (A sparse unit holds at most its size: a sender's slots widen past the capacity.)
  expected = {Mode.DENSE: count == slot.size, Mode.EMPTY: count == 0 and length == 0}.get(
      Mode(mode), 0 < count <= slot.size)
  if not expected:
    raise PayloadError(f"{slots.name}: a {Mode(mode).name} unit of {count} elements (size "
                       f"{slot.size}, capacity {slot.capacity})")
  if header.kind == Kind.ANCHOR and mode != Mode.DENSE:
    raise PayloadError(f"{slots.name}: an anchor part must carry every unit densely")
  if seg.ordered and (mode == Mode.BY_RANK) != header.ranked and mode in (Mode.BY_RANK,
                                                                          Mode.BY_POSITION):
    raise PayloadError(f"{slots.name}: mode {Mode(mode).name} in a part whose ordered "
                       f"segments are named by {'rank' if header.ranked else 'position'}")
  return unit


def read_unit(plan: Plan, index: PartIndex, data, i: int) -> SegmentPayload | packed.PackedRecord:
  """Reads, checks and decodes unit ``i`` of a part whose index is ``index``: only its bytes
  (a sparse unit of a packed part stays packed: a :class:`~packed.PackedRecord`).

  Raises:
    PayloadError: a body that fails its checksum or does not decode to the table's record.
  """
  entry = index.entries[i]
  slots = unit_slots(plan, entry.unit)
  slot = slots.segments[0]
  if entry.mode == Mode.EMPTY:
    return SegmentPayload(Mode.EMPTY, np.zeros(0, np.int32), np.zeros(0, slot.bit_dtype))
  body = _slice(data, entry.start, entry.start + entry.length, f"{slots.name}'s body")
  if zlib.crc32(body) != entry.crc:
    raise PayloadError(f"{slots.name}: body checksum mismatch, corrupted")
  reader = Reader(body)
  if index.header.format == Format.PACKED:
    record = packed.decode_unit(slot, entry.mode, entry.count, reader, slots.name)
  else:
    (record,) = compact.decode_body(slots, reader)
  if reader.remaining:
    raise PayloadError(f"{slots.name}: {reader.remaining} unexpected bytes after its record")
  if isinstance(record, packed.PackedRecord):
    return record  # its keys and codes are checked on the device (``sync/packed_units.py``)
  if record.mode != entry.mode or (record.count if record.mode != Mode.DENSE
                                   else len(record.values)) != entry.count:
    raise PayloadError(f"{slots.name}: body holds a {record.mode.name} record of other size "
                       "than its table entry")
  check_records(slots, Payload(index.header.kind, index.header.base_version,
                               index.header.version, b"", b"", (record,)))
  return record
