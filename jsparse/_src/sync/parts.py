"""The host stages of a multi-process sync: a trainer process's part, a rollout process's read.

Trainer side (:func:`part_records`): the records of the units this process owns, taken from the
addressable shards of the jitted diff's outputs, never from another process's data. Rollout
side (:func:`read_parts`): every part's index, checked as one version (all parts, once each,
covering every segment exactly once), then only the unit bodies that overlap this process's
blocks, staged on the devices as they are decoded (``staging.py``); :func:`write_dense_units`
writes the dense ones.

>>> import jax.numpy as jnp, jsparse
>>> params = {'w': jnp.zeros(1000)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> part = jsparse.Sender(plan, params).send({'w': params['w'].at[3].set(1.0)})
>>> read = read_parts(plan, [part], jax.tree.leaves(plan.cast(params)))
>>> read.stats.units_read, read.header.version
(1, 1)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.plan import Plan
from jsparse._src.core.units import (Unit, block_box, local_value, needs_unit, owned_block_data,
                                     owned_slots, process_boxes, to_segment_positions,
                                     to_unit_positions, unit_counts, unit_slot, write_regions)
from jsparse._src.errors import ArgumentError, JsparseError, PayloadError
from jsparse._src.sync import packed_units
from jsparse._src.sync.programs import DeviceChanges, ReceiverInputs
from jsparse._src.sync.staging import StagedRecords
from jsparse._src.threads import parallel_map
from jsparse._src.wire.packed import PackedRecord
from jsparse._src.wire.parts import PartHeader, PartIndex, read_index, read_unit
from jsparse._src.wire.payload import (Coding, Format, Kind, Mode, SegmentPayload,
                                       segment_host_bits, sparse_record)


def part_records(plan: Plan, coding: Coding, units: Sequence[Unit], changes: DeviceChanges,
                 snapshot: Sequence[jax.Array], full: bool) -> list:
  """The records of ``units`` (owned by this process), from a diff's device outputs and the new
  ``snapshot``: dense for an anchor or an overflowed block, else sparse in the unit's space
  (for a packed ``coding``, packed on the device: ``packed_units.py``). A host-coded record is
  given as the function that makes it (``wire.parts.encode_part`` calls it as it codes the
  unit): the host holds the changes of the units being coded, not every change."""
  if full:
    return dense_records(plan, units, snapshot)
  counts = changes_of_units(plan, units, changes)
  if coding.format == Format.PACKED:
    return packed_units.unit_records(plan, coding.ranked, units, counts, changes,
                                     lambda unit: _dense_record(plan, unit, snapshot))
  return [functools.partial(_dense_record, plan, unit, snapshot) if unit_count is None
          else functools.partial(_sparse_record, plan, unit, changes, unit_count)
          for unit, unit_count in zip(units, counts)]


def _sparse_record(plan: Plan, unit: Unit, changes: DeviceChanges,
                   unit_count: np.ndarray) -> SegmentPayload:
  """The sparse record of ``unit``, its changes (``unit_count`` per block) moved to the host."""
  s, delta = unit.segment, changes.delta
  seg = plan.segments[s]
  if seg.blocks == 1:
    n = int(unit_count[0])
    ranks = None if changes.ranks is None or changes.ranks[s] is None else \
        local_value(changes.ranks[s])[:n]
    return sparse_record(seg, local_value(delta.indices[s])[:n],
                         local_value(delta.values[s])[:n], local_value(changes.old_values[s])[:n],
                         ranks)
  per_block = delta.indices[s].shape[0] // seg.blocks  # (widened with the diff)
  positions = owned_slots(delta.indices[s], per_block, unit.blocks)
  used = positions < seg.size  # each block's changes ascend; blocks come in unit order
  return sparse_record(
      unit_slot(plan, unit), to_unit_positions(plan, unit, positions[used]).astype(
          np.int32), owned_slots(delta.values[s], per_block, unit.blocks)[used],
      owned_slots(changes.old_values[s], per_block, unit.blocks)[used], None)


def changes_of_units(plan: Plan, units: Sequence[Unit], changes: DeviceChanges
                     ) -> list[np.ndarray | None]:
  """Per unit of ``units``, its changes per block in a diff's ``changes`` (None: it
  overflowed, carried densely); see :func:`~jsparse._src.core.units.unit_counts`."""
  delta = changes.delta
  return unit_counts(plan, units, delta.counts, delta.overflow, changes.block_counts,
                     [x.shape[0] for x in delta.indices])


def dense_records(plan: Plan, units: Sequence[Unit], snapshot: Sequence[jax.Array]) -> list:
  """Every unit of ``units`` carried densely from ``snapshot`` (an anchor's records), each as
  the function that makes it when its unit is coded (see :func:`part_records`)."""
  return [functools.partial(_dense_record, plan, unit, snapshot) for unit in units]


def _dense_record(plan: Plan, unit: Unit, snapshot: Sequence[jax.Array]) -> SegmentPayload:
  """``unit`` carried densely from ``snapshot``."""
  seg = plan.segments[unit.segment]
  if seg.blocks == 1:
    values = segment_host_bits(plan, unit.segment, snapshot)
  else:
    leaf_id = seg.leaf_ids[0]
    values = bits_lib.np_to_bits(
        owned_block_data(plan.leaves[leaf_id].layout, snapshot[leaf_id], unit.blocks))
  return SegmentPayload(Mode.DENSE, None, values)


@dataclasses.dataclass(frozen=True)
class ReadStats:
  """What a rollout process read of one version's parts.

  Attributes:
    parts: how many parts the version has.
    units: units in all parts; ``units_read``: those this process needed.
    bytes_total: bytes of all parts; ``bytes_read``: bytes this process read (every index,
      and the bodies of the units it needed).
  """

  parts: int
  units: int
  units_read: int
  bytes_total: int
  bytes_read: int


@dataclasses.dataclass(frozen=True)
class PartsRead:
  """One version's parts as a rollout process read them.

  Attributes:
    header: what all the parts state alike (versions, digests, format).
    dense: the dense units this process needs, with their records.
    staged: the sparse records this process needs, on its devices.
    sparse_counts: per segment, the sparse changes in all parts (what every process sizes its
      programs by, whatever it read).
    any_sparse: whether any part carries a sparse record.
    stats: a :class:`ReadStats`.
  """

  header: PartHeader
  dense: tuple[tuple[Unit, SegmentPayload], ...]
  staged: StagedRecords
  sparse_counts: np.ndarray
  any_sparse: bool
  stats: ReadStats


def sparse_inputs(plan: Plan, read: PartsRead) -> ReceiverInputs | None:
  """The device inputs of the sparse records of a version ``read`` (None: it has none), for
  ``programs.apply_inputs``."""
  if not read.any_sparse:
    return None
  return read.staged.inputs(
      ranked=tuple(seg.ordered and read.header.ranked for seg in plan.segments),
      slot_counts=read.sparse_counts, dense=dense_segments(plan, read))


def dense_segments(plan: Plan, read: PartsRead) -> tuple[bool, ...]:
  """Per segment, whether a delta's parts carried a unit of it that this process read densely
  (its sender may widen next: ``programs.widens``); none for an anchor."""
  if read.header.kind != Kind.DELTA:
    return ()
  dense = {unit.segment for unit, _ in read.dense}
  return tuple(s in dense for s in range(len(plan.segments)))


class PartsReader:
  """Reads one version's parts as they arrive (:meth:`add`), then checks them as one version
  (:meth:`finish`). Each part's index is checked and the unit bodies this process needs are
  decoded on arrival, so host decoding overlaps the transfer of the next parts; their sparse
  records go to the devices as they are decoded (the host keeps only the dense ones).

  Args:
    plan: the plan.
    held: this process's rollout leaves (which blocks it holds decides what it decodes).
  """

  def __init__(self, plan: Plan, held: Sequence[jax.Array]):
    self.plan = plan
    self._boxes = process_boxes(held)
    self._indexes: list[PartIndex] = []
    self._dense: list[tuple[Unit, SegmentPayload]] = []
    self._staged = StagedRecords(plan, held)
    self._coverage = _Coverage(plan)
    self._units_read = 0
    self._bytes_read = 0
    self._checks: list[jax.Array] = []  # per packed unit staged: its device's check

  def add(self, data, index: PartIndex | None = None) -> PartIndex:
    """Checks part ``data`` (bytes, or anything with ``len`` and slicing) against the plan and
    the parts before it, and decodes the units this process needs (``index``: its index, if
    already read).

    Raises:
      PayloadError: a corrupt or foreign part, one of another version than the first, or one
        whose units cover blocks that this part or an earlier one covers already (refused
        before any of its bodies is decoded: what a version stages is bounded by the plan).
    """
    check_part(data)
    index = read_index(self.plan, data) if index is None else index
    _check_one_version(self._indexes + [index], complete=False)
    self._coverage.add(index)
    wanted = [i for i, entry in enumerate(index.entries)
              if needs_unit(self.plan, entry.unit, self._boxes)]
    records = parallel_map(  # zstd and NumPy release the GIL: units decode in parallel
        lambda i: self._read(index, data, i), wanted)
    self._indexes.append(index)
    self._dense += [r for r in records if r is not None]
    self._units_read += len(wanted)
    self._bytes_read += (index.entries[0].start if index.entries else index.size) + sum(
        index.entries[i].length for i in wanted)
    return index

  def _read(self, index: PartIndex, data, i: int) -> tuple[Unit, SegmentPayload] | None:
    """Decodes unit ``i``: a dense record is returned, a sparse one staged."""
    unit, record = index.entries[i].unit, read_unit(self.plan, index, data, i)
    if index.header.format == Format.PACKED and index.header.kind == Kind.DELTA \
        and not isinstance(record, PackedRecord):  # none to unpack in this version
      packed_units.expect_unit(self.plan, unit, self._staged)
    if record.mode == Mode.DENSE:
      return unit, record
    if isinstance(record, PackedRecord):
      self._checks.append(packed_units.stage_unit(self.plan, unit, record, self._staged))
      return None
    if record.count:
      keys = record.indices if record.mode == Mode.BY_RANK else \
          to_segment_positions(self.plan, unit, record.indices)
      self._staged.add(unit.segment, keys, record.values)
    return None

  def finish(self) -> PartsRead:
    """The version read, once every part was added once.

    Raises:
      PayloadError: no part, a missing or repeated part, or parts that do not cover every
        segment exactly once.
    """
    if not self._indexes:
      raise PayloadError("no parts given: add every part of the version before finishing")
    _check_one_version(self._indexes, complete=True)
    counts = self._coverage.complete()
    if not all(bool(ok) for ok in self._checks):
      raise PayloadError("a packed part names a change out of its unit or out of order, or "
                         "codes a value wider than its dtype: nothing was applied")
    indexes = self._indexes
    stats = ReadStats(len(indexes), sum(len(i.entries) for i in indexes), self._units_read,
                      sum(i.size for i in indexes), self._bytes_read)
    any_sparse = any(e.mode not in (Mode.DENSE, Mode.EMPTY) for i in indexes for e in i.entries)
    return PartsRead(indexes[0].header, tuple(self._dense), self._staged, counts, any_sparse,
                     stats)


def read_parts(plan: Plan, parts: Sequence, held: Sequence[jax.Array]) -> PartsRead:
  """Reads one version's ``parts`` (bytes, or anything with ``len`` and slicing, such as an
  ``mmap``) for a process holding the shards of this process in ``held`` (rollout leaves).

  Raises:
    PayloadError: a corrupt, foreign, missing, repeated or mismatched part, or parts that do
      not cover every segment exactly once.
  """
  check_parts(parts)
  indexes = [read_index(plan, p) for p in parts]  # every index checked before any body
  _check_one_version(indexes, complete=True)
  coverage = _Coverage(plan)
  for index in indexes:
    coverage.add(index)
  coverage.complete()
  reader = PartsReader(plan, held)
  for data, index in zip(parts, indexes):
    reader.add(data, index)
  return reader.finish()


def _check_one_version(indexes: Sequence[PartIndex], complete: bool) -> None:
  """Raises unless the parts are of one version, none repeated (and, if ``complete``, none
  missing)."""
  first = indexes[0].header
  for index in indexes[1:]:
    if index.header.same_version() != first.same_version():
      raise PayloadError(f"part {index.header.part} belongs to another version or sender than "
                         f"part {first.part} (version {index.header.version} from "
                         f"{index.header.base_version}, against {first.version} from "
                         f"{first.base_version}): nothing was applied; give the parts of one "
                         "version only")
  numbers = sorted(i.header.part for i in indexes)
  if not complete and len(set(numbers)) == len(numbers):
    return
  if numbers != list(range(first.parts)):
    missing = sorted(set(range(first.parts)) - set(numbers))
    repeated = sorted({n for n in numbers if numbers.count(n) > 1})
    raise PayloadError(f"version {first.version} has {first.parts} parts; missing "
                       f"{missing[:8]}, repeated {repeated[:8]}: nothing was applied; give "
                       "every part of the version once (all that the trainer's processes sent)")


class _Coverage:
  """Which blocks of each segment the parts read so far cover, and their sparse changes."""

  def __init__(self, plan: Plan):
    self.plan = plan
    self.hits = [np.zeros(seg.blocks, np.int64) for seg in plan.segments]
    self.counts = np.zeros(len(plan.segments), np.int64)

  def add(self, index: PartIndex) -> None:
    """Counts ``index``'s units; raises (counting nothing) if one covers a block twice."""
    new = {}
    for entry in index.entries:
      s = entry.unit.segment
      hits = new.setdefault(s, self.hits[s].copy())
      hits[list(entry.unit.blocks)] += 1
      if np.any(hits > 1):
        raise PayloadError(f"part {index.header.part}: {self.plan.describe_segment(s)} is "
                           "covered twice (by this part or an earlier one): nothing was "
                           "applied; give each part of the version once, all from one sender")
    for s, hits in new.items():
      self.hits[s] = hits
    for entry in index.entries:
      if entry.mode != Mode.DENSE:
        self.counts[entry.unit.segment] += entry.count

  def complete(self) -> np.ndarray:
    """Per segment the sparse changes; raises unless the units cover every block once."""
    for s, hits in enumerate(self.hits):
      if np.any(hits != 1):
        raise PayloadError(f"{self.plan.describe_segment(s)}: the parts cover its blocks "
                           f"{hits.tolist()[:8]} times, not once each: nothing was applied; "
                           "give every part of the version once")
    return self.counts


def check_parts(parts) -> None:
  """Raises unless ``parts`` is a non-empty sequence of parts (see :func:`check_part`)."""
  if isinstance(parts, (bytes, bytearray, memoryview, str)) or not hasattr(parts, "__len__") \
      or not hasattr(parts, "__getitem__"):
    raise ArgumentError(f"jsparse: expected a list of payload parts (e.g. [part]), got "
                        f"{type(parts).__name__}")
  if not len(parts):
    raise PayloadError("no parts given: pass every part of one version (a list of bytes)")
  for k, part in enumerate(parts):
    check_part(part, k)


def check_part(part, k: int | None = None) -> None:
  """Raises unless ``part`` is one part's bytes: ``bytes``, or anything with ``len`` and
  slicing to bytes (an ``mmap``, a NumPy ``uint8`` array, a feed's part)."""
  if isinstance(part, (str, list, tuple, dict)) or not hasattr(part, "__len__") \
      or not hasattr(part, "__getitem__"):
    where = "" if k is None else f" {k}"
    raise ArgumentError(f"jsparse: part{where} must be bytes (or support len() and slicing), "
                        f"got {type(part).__name__}")


def write_dense_units(plan: Plan, flat: list, read: PartsRead) -> list:
  """``flat`` with the dense records read written into this process's shards (the other
  leaves untouched)."""
  regions: dict[int, list] = {}
  for unit, record in read.dense:
    seg = plan.segments[unit.segment]
    if seg.blocks == 1:
      for leaf_id, offset in zip(seg.leaf_ids, seg.offsets):
        leaf = plan.leaves[leaf_id]
        whole = tuple((0, n) for n in leaf.shape)
        regions.setdefault(leaf_id, []).append(
            (whole, record.values[offset:offset + leaf.size].reshape(leaf.shape)))
      continue
    leaf_id = seg.leaf_ids[0]
    leaf = plan.leaves[leaf_id]
    block_shape = leaf.layout.block_shape(leaf.shape)
    size = seg.size // seg.blocks
    for j, b in enumerate(unit.blocks):
      regions.setdefault(leaf_id, []).append(
          (block_box(leaf.layout, leaf.shape, b),
           record.values[j * size:(j + 1) * size].reshape(block_shape)))
  out = list(flat)
  for leaf_id, leaf_regions in regions.items():
    out[leaf_id] = _rewritten(plan.leaves[leaf_id], flat[leaf_id], leaf_regions)
  return out


def _rewritten(leaf, x: jax.Array, regions: list) -> jax.Array:
  shards = []
  for shard in x.addressable_shards:
    host = bits_lib.np_to_bits(np.asarray(shard.data)).copy()
    box = tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape))
    for region, values in regions:
      write_regions(host, box, region, values)
    shards.append(jax.device_put(bits_lib.np_from_bits(host, leaf.rollout_dtype), shard.device))
  return jax.make_array_from_single_device_arrays(leaf.shape, x.sharding, shards)


def processes_with(flag: bool, flat: Sequence[jax.Array]) -> list[int]:
  """The processes whose ``flag`` is set, among those of a job whose arrays ``flat`` span
  several processes (one small all-gather); in a single process, ``[0]`` or ``[]``."""
  if not spans_processes(flat):
    return [jax.process_index()] if flag else []
  flags = np.asarray(multihost_utils.process_allgather(np.array([flag], np.int32)))
  return np.flatnonzero(flags.reshape(-1)).tolist()


def spans_processes(flat: Sequence[jax.Array]) -> bool:
  """Whether the arrays ``flat`` span devices of several processes."""
  return not all(x.is_fully_addressable for x in flat)


def first_process_value(value: int, flat: Sequence[jax.Array]) -> int:
  """Process 0's ``value`` on every process of a job whose arrays ``flat`` span several
  processes (one small all-gather), so that all of them decide alike; else ``value``."""
  if not spans_processes(flat):
    return int(value)
  return int(np.asarray(multihost_utils.process_allgather(
      np.array([value], np.int64))).reshape(-1)[0])


def slowest(seconds: float, flat: Sequence[jax.Array]) -> float:
  """The most ``seconds`` of any process of a job whose arrays ``flat`` span several processes
  (what a step of all of them takes); else ``seconds``."""
  if not spans_processes(flat):
    return float(seconds)
  return float(np.asarray(multihost_utils.process_allgather(
      np.array([seconds], np.float64))).max())


def every_part(part: bytes, flat: Sequence[jax.Array]) -> list[bytes]:
  """Every process's ``part``, in process order, on every process of a job whose arrays
  ``flat`` span several processes (two all-gathers); else ``[part]``."""
  if not spans_processes(flat):
    return [bytes(part)]
  lengths = np.asarray(multihost_utils.process_allgather(
      np.array([len(part)], np.int64))).reshape(-1)
  row = np.zeros(int(lengths.max()), np.uint8)
  row[:len(part)] = np.frombuffer(part, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(row)).reshape(len(lengths), -1)
  return [rows[k, :int(n)].tobytes() for k, n in enumerate(lengths)]


def agree(error: JsparseError | None, flat: Sequence[jax.Array]) -> None:
  """Raises ``error`` on this process, or a :class:`PayloadError` if another process of a
  rollout whose arrays span several processes failed: all of them apply a version, or none."""
  failed = processes_with(error is not None, flat)
  if error is not None:
    raise error
  if failed:
    raise PayloadError(f"rollout process(es) {failed} refused this version's parts: nothing "
                       "was applied (their errors say why); read the version again, or take an "
                       "anchor")
