"""The packed coding in parts and streams: each unit of a part packed on the trainer's device,
unpacked on the rollout's device; the hosts only move its words.

A unit (``core/units.py``) is coded as a one-segment packed body in its own index space
(``wire/packed.py``: :func:`~jsparse._src.wire.packed.encode_unit`): a whole segment by rank or
position; the listed blocks of a leaf the trainer splits by their
positions in the unit, which ascend through the unit (blocks in order, each block's changes in
order), so they are one run of gaps. Sender (:func:`unit_records`): every sparse unit's
program is dispatched before the first is copied, so the device packs unit ``k + 1`` while the
host copies unit ``k``; a split unit's blocks, on several devices of this process, meet on the
first of them; the host copies only the used prefix of a unit's words (:func:`used_streams`).
Receiver (:func:`stage_unit`): the unit's streams go to the device its segment
is staged on, are unpacked and checked there (one flag per unit, read before anything is
applied), and their positions mapped back to the segment's on the device.

>>> import jax.numpy as jnp, jsparse
>>> params = {'w': jnp.zeros(1000)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> sender = jsparse.Sender(plan, params, coding="packed")
>>> receiver = jsparse.Receiver(plan, plan.cast(params))
>>> part = sender.send({'w': params['w'].at[3].set(1.0)})
>>> float(receiver.receive(part)['w'][3]), receiver.last_read.units_read
(1.0, 1)
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core import bitpack
from jsparse._src.core.chunks import chunks_of, sub_plan
from jsparse._src.core.plan import Plan
from jsparse._src.errors import PayloadError
from jsparse._src.core.units import (Unit, block_coords, block_slots, leaf_positions,
                                     split_geometry, unit_slot)
from jsparse._src.sync import programs
from jsparse._src.sync.programs import DeviceChanges
from jsparse._src.sync.staging import StagedRecords
from jsparse._src.device import packing as device_codes
from jsparse._src.wire.packed import PackedRecord
from jsparse._src.wire.payload import Mode, SegmentPayload


def copy_size(n: int) -> int:
  """The size a prefix of ``n`` elements is copied at: a power of two (at least 256), so that
  few copy programs compile (one per doubling), at most twice the bytes.

  >>> [copy_size(n) for n in (0, 5, 300, 1000, 1025)]
  [256, 256, 512, 1024, 2048]
  """
  return max(256, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, static_argnums=1)
def _prefix(x: jax.Array, size: int) -> jax.Array:
  return x[:size]


def in_host_memory(x: jax.Array) -> bool:
  """Whether ``x`` is in the host's memory (on CPU devices), where the host reads it in place:
  there a copy of a prefix on the device would only add a copy."""
  return all(d.platform == "cpu" for d in x.devices())


def used_streams(outputs: tuple, keys: int, codes: int) -> tuple[np.ndarray, ...]:
  """The used words of a ``pack_program``'s two streams, as four arrays on the host (key
  widths, key words, code widths, code words); ``keys`` and ``codes``: how many it packed."""
  return copied_streams([(outputs, keys, codes)])[0]


def _streams_in(words: np.ndarray, at: tuple, keys: int, codes: int) -> tuple[np.ndarray, ...]:
  """The four arrays of a chunk's streams, as views of its words (``at``:
  ``device_codes.stream_offsets``; widths are bytes, least significant first in a word)."""
  words = words.astype("<u4", copy=False)
  widths = lambda start, n: words[start:].view(np.uint8)[:bitpack.num_blocks(n)]
  return (widths(at[0], keys), words[at[1]:at[2]], widths(at[2], codes), words[at[3]:at[4]])


def _used_prefix(words: jax.Array, used: int) -> jax.Array:
  """The first :func:`copy_size` words of ``words`` holding its ``used`` ones, to copy: sliced
  on the device at the smallest size compiled that holds them, else the whole buffer, while
  the size they need compiles in the background (``programs.SlotLevels``): no sync compiles a
  copy. On CPU devices, and at sizes past the buffer, the whole buffer (read in place)."""
  size = copy_size(used)
  if size >= words.shape[0] or in_host_memory(words):
    return words
  if jax.process_count() > 1:  # every process runs the same programs: compiled when needed
    return _prefix(words, size)
  family = ("prefix", programs.like(words))
  compiled = [n for n in programs.SLOT_LEVELS.ready(family) if n >= size]
  abstract = programs.like(words)
  programs.SLOT_LEVELS.request(family, size, lambda: _prefix.lower(abstract, size).compile())
  return _prefix(words, min(compiled)) if compiled else words


def copied_streams(packed: Sequence[tuple]) -> list[tuple[np.ndarray, ...]]:
  """:func:`used_streams` of several ``(outputs, keys, codes)`` at once: their used word
  counts in one copy, then each buffer's used prefix (:func:`_used_prefix`) in one
  ``device_get``, the copies in flight together; the four arrays are views of those words."""
  used = jax.device_get([outputs[1] for outputs, _, _ in packed])
  offsets, prefixes = [], []
  for ((words, _), keys, codes), (key_words, code_words) in zip(packed, used):
    at = device_codes.stream_offsets(keys, codes, int(key_words), int(code_words))
    offsets.append((at, keys, codes))
    prefixes.append(_used_prefix(words, at[-1]))
  return [_streams_in(np.asarray(host), *where)
          for host, where in zip(jax.device_get(prefixes), offsets)]


def stream_words(streams: tuple) -> int:
  """The words a chunk's (or unit's) streams fill, each array from a word."""
  return sum(-(-np.asarray(a).nbytes // 4) for a in streams)


def check_fits(streams: tuple, words: int, what: str) -> None:
  """Raises :class:`PayloadError` unless ``streams`` fit in ``words`` words (what the
  streams of the changes they state fill at most)."""
  if stream_words(streams) > words:
    raise PayloadError(f"{what} of a packed payload: streams longer than its {words} words")


def chunk_words(plan: Plan, slots: Sequence[int]) -> int:
  """The words of a chunk's streams buffer on a receiver (``plan``: the chunk's): what the
  streams of any changes in ``slots`` fill, so that its shape follows the slot level only."""
  return device_codes.packed_words(
      sum(slots), sum(n * device_codes.values_per_change(seg)
                      for n, seg in zip(slots, plan.segments)))


@functools.lru_cache(maxsize=256)
def unit_plan(plan: Plan, unit: Unit) -> Plan:
  """The unit as a structural one-segment plan (what the device programs take): a whole
  segment's sub-plan, or for blocks of a split leaf an unsplit segment of the unit's size and
  capacity. Units of one structure share it, and so their compiled programs."""
  if plan.segments[unit.segment].blocks == 1:
    return sub_plan(plan, (unit.segment,))
  return Plan(jax.tree.structure([]), (), (unit_slot(plan, unit),), plan.bucket_size)


def _single_device(x: jax.Array) -> jax.Array:
  """A replicated array's value on one device of this process (no data crosses processes)."""
  return x if len(x.devices()) == 1 else x.addressable_shards[0].data


def _block_shards(x: jax.Array, per_block: int, blocks: Sequence[int], device=None) -> list:
  """The slots of each listed block (:func:`~jsparse._src.core.units.block_slots`), each on
  ``device`` (default: the first block's)."""
  shards = block_slots(x, per_block, blocks)
  return jax.device_put(shards, device or next(iter(shards[0].devices())))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _unit_changes(leaf_shape: tuple, block_shape: tuple, positions: list, new: list,
                  old: list, counts: jax.Array) -> tuple:
  """A split leaf's unit's changes, from its blocks' slots: ``(unit positions, new, old)``,
  the first ``sum(counts)`` entries in ascending order (blocks in unit order)."""
  positions, new, old = jnp.stack(positions), jnp.stack(new), jnp.stack(old)
  rows, per_block = positions.shape
  _, inner = block_coords(positions, leaf_shape, block_shape)
  unit_positions = jnp.arange(rows, dtype=jnp.int32)[:, None] * math.prod(block_shape) + inner
  slot = jnp.arange(per_block, dtype=jnp.int32)[None, :]
  start = (jnp.cumsum(counts) - counts)[:, None]
  at = jnp.where(slot < counts[:, None], start + slot, rows * per_block).reshape(-1)

  def compact(x):
    return jnp.zeros((rows * per_block,), x.dtype).at[at].set(x.reshape(-1), mode="drop")

  return compact(unit_positions), compact(new), compact(old)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _segment_positions(leaf_shape: tuple, block_shape: tuple, parts: tuple,
                       positions: jax.Array, blocks: jax.Array) -> jax.Array:
  """Inverse of :func:`_unit_changes`' positions: unit positions (any, clamped into the unit)
  as the leaf's flat positions; ``blocks``: the unit's blocks."""
  size = math.prod(block_shape)
  positions = jnp.clip(positions, 0, blocks.shape[0] * size - 1)
  return leaf_positions(blocks[positions // size], positions % size, leaf_shape, block_shape,
                        parts)


class _Launched:
  """A unit's pack program in flight: its outputs and how many keys and codes it packs."""

  def __init__(self, mode: Mode, count: int, codes: int, outputs: tuple):
    self.mode, self.count, self.codes, self.outputs = mode, count, codes, outputs

  def record(self) -> PackedRecord:
    """The unit's record: the used words of its streams, copied to the host."""
    return PackedRecord(self.mode, self.count, used_streams(self.outputs, self.count, self.codes))


def _by_rank(plan: Plan, unit: Unit, ranked: bool) -> bool:
  """Whether ``unit`` is coded by rank (else by position)."""
  return ranked and plan.segments[unit.segment].ordered


def _launch(plan: Plan, unit: Unit, changes: DeviceChanges, ranked: bool,
            counts: np.ndarray) -> _Launched | None:
  """Dispatches ``unit``'s pack program (None: the unit has no change); ``counts``: its changes
  per block (:func:`~jsparse._src.core.units.unit_counts`)."""
  s, seg = unit.segment, plan.segments[unit.segment]
  count = int(counts.sum())
  if not count:
    return None
  delta = changes.delta
  by_rank = _by_rank(plan, unit, ranked)
  if seg.blocks == 1:
    keys = changes.ranks[s] if by_rank else delta.indices[s]
    inputs = [_single_device(x) for x in (keys, delta.values[s], changes.old_values[s])]
    inputs = jax.device_put(inputs, next(iter(inputs[0].devices())))
  else:
    per_block = delta.indices[s].shape[0] // seg.blocks  # (widened with the diff)
    positions = _block_shards(delta.indices[s], per_block, unit.blocks)
    device = next(iter(positions[0].devices()))
    columns = [positions] + [_block_shards(x, per_block, unit.blocks, device)
                             for x in (delta.values[s], changes.old_values[s])]
    leaf_shape, block_shape, _ = split_geometry(plan, unit)
    inputs = _unit_changes(leaf_shape, block_shape, *columns,
                           jax.device_put(counts.astype(np.int32), device))
  mode = Mode.BY_RANK if by_rank else Mode.BY_POSITION
  codes = count * device_codes.values_per_change(seg)
  outputs = device_codes.pack_program(unit_plan(plan, unit), by_rank, *((x,) for x in inputs),
                                      np.array([count], np.int32), (None,))
  return _Launched(mode, count, codes, outputs)


def _pack_job(plan: Plan, unit: Unit, changes: DeviceChanges, ranked: bool, level: int,
              diff_level: int) -> Callable[[], None]:
  """What compiles what :func:`_launch` runs for ``unit`` when the changes' slots are at slot
  ``level`` (``programs.SlotLevels``) and the diff's at ``diff_level``, with the shardings of
  ``changes`` (taken now: the job holds no array). A split leaf's unit keeps all the diff's
  slots of its blocks at every level."""
  s, seg = unit.segment, plan.segments[unit.segment]
  delta, by_rank = changes.delta, _by_rank(plan, unit, ranked)
  columns = (changes.ranks[s] if by_rank else delta.indices[s], delta.values[s],
             changes.old_values[s])
  if seg.blocks == 1:
    device = next(iter(_single_device(columns[0]).devices()))
    shape = (programs.level_slots(plan, (s,), level)[0],)
  else:
    shards = [block_slots(x, x.shape[0] // seg.blocks, unit.blocks) for x in columns]
    device = next(iter(shards[0][0].devices()))
    per_block = programs.level_slots(plan, (s,), diff_level)[0] // seg.blocks
    shape = (per_block * len(unit.blocks),)
  on = jax.sharding.make_single_device_sharding(device)
  placed = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on)
  inputs = [placed(shape, x.dtype) for x in columns]
  gather = None if seg.blocks == 1 else (
      [[placed((per_block,), b.dtype) for b in column] for column in shards],
      placed((len(unit.blocks),), jnp.int32))

  def job() -> None:
    if gather is not None:
      _unit_changes.lower(*split_geometry(plan, unit)[:2], *gather[0], gather[1]).compile()
    device_codes.pack_program.lower(unit_plan(plan, unit), by_rank, *((x,) for x in inputs),
                                    jax.ShapeDtypeStruct((1,), jnp.int32), (None,)).compile()
  return job


@functools.lru_cache(maxsize=64)
def _chunk_of(plan: Plan) -> dict[int, int]:
  """Each segment's chunk (its index in ``chunks_of``)."""
  return {s: k for k, c in enumerate(chunks_of(plan)) for s in c.segment_ids}


def _pack_requests(plan: Plan, unit: Unit, changes: DeviceChanges, ranked: bool,
                   launched: bool) -> list:
  """The slot levels of ``unit``'s pack programs to compile in the background
  (``programs.SlotLevels``): those its chunk needs and its fallback (the diff's width), the
  one it ran at if it had no change (so none was compiled), and the one its diff moves to. Its programs are a config of the chunk's family: a
  level serves once they are compiled for it too."""
  if not changes.levels:
    return []
  family, level, needed, ahead = changes.levels[_chunk_of(plan)[unit.segment]]
  config, base = ("pack-unit", ranked, unit), family[2]
  if launched:
    programs.SLOT_LEVELS.ran(family, level, config)
  requests = [(family, wanted, _pack_job(plan, unit, changes, ranked, wanted, base), config,
               base)
              for wanted in sorted({needed, base, level} - ({level} if launched else set()))
              if programs.SLOT_LEVELS.wanted(family, wanted, config)]
  if ahead is not None and programs.SLOT_LEVELS.wanted(*ahead, config):
    requests.append((*ahead, _pack_job(plan, unit, changes, ranked, ahead[1], ahead[1]), config,
                     None))
  return requests


def launch(plan: Plan, ranked: bool, units: Sequence[Unit], counts: Sequence[np.ndarray | None],
           changes: DeviceChanges) -> list:
  """Dispatches the pack program of every unit of ``units`` with changes (``counts``, as
  :func:`unit_records` takes them); per unit, what it packs (None: no change, or dense)."""
  return [None if c is None else _launch(plan, unit, changes, ranked, c)
          for unit, c in zip(units, counts)]


def unit_records(plan: Plan, ranked: bool, units: Sequence[Unit],
                 counts: Sequence[np.ndarray | None], changes: DeviceChanges,
                 dense: Callable[[Unit], SegmentPayload]) -> list:
  """The packed records of ``units`` (owned by this process) of a delta's ``changes``, with
  their ``counts`` (:func:`~jsparse._src.core.units.unit_counts`): a :class:`PackedRecord` per
  unit with changes, ``dense(unit)`` for a unit that overflowed, an empty record for a unit
  without changes. ``ranked``: ordered segments by rank. The levels of the units' programs
  that a later step may run are compiled in the background (:func:`_pack_requests`)."""
  launched = launch(plan, ranked, units, counts, changes)
  requests = [request for unit, c, out in zip(units, counts, launched) if c is not None
              for request in _pack_requests(plan, unit, changes, ranked, out is not None)]
  for request in requests:  # once this call's programs are dispatched
    programs.SLOT_LEVELS.request(*request)
  records = []
  for unit, c, out in zip(units, counts, launched):
    if c is None:
      records.append(dense(unit))
    elif out is not None:
      records.append(out.record())
    else:
      records.append(PackedRecord(Mode.EMPTY, 0, None))
  return records


def _unpack_family(plan: Plan, unit: Unit, device) -> tuple:
  """The key in ``programs.SLOT_LEVELS`` of a unit's unpacking on ``device``: its structure
  (its levels size the buffer its streams come in)."""
  return ("unpack-unit", unit_plan(plan, unit), split_geometry(plan, unit), device)


def _unit_words(plan: Plan, unit: Unit, level: int) -> int:
  """The words of a unit's streams buffer on a receiver at slot ``level``: what the streams
  of any changes in those slots fill (its shape follows the level only)."""
  uplan = unit_plan(plan, unit)
  return chunk_words(uplan, programs.level_slots(uplan, (0,), level))


def _key_slots(uplan: Plan, level: int) -> int:
  """The slots a unit's keys are unpacked into at slot ``level``: its capacity, or at a level
  wider than it (a sender widened the diff) those of the widest level a receiver expects
  (:func:`~programs.receiver_widest`), or of ``level`` if wider still. Two sizes, whatever the
  level: the programs that stage them compile for each size ahead."""
  if level >= 0:
    return uplan.segments[0].capacity
  return programs.level_slots(uplan, (0,), min(level, programs.receiver_widest(uplan)))[0]


def _unpacked(plan: Plan, unit: Unit, data: jax.Array, offsets: Sequence[int], count: int,
              level: int = 0) -> tuple:
  """``unit``'s keys (the segment's positions, in :func:`_key_slots` slots), ulp codes and
  flag, unpacked from its streams ``data`` at word ``offsets`` on ``data``'s device."""
  uplan = unit_plan(plan, unit)
  (keys,), (values,), ok = device_codes.unpack_program(
      uplan, (_key_slots(uplan, level),), data, np.asarray(offsets, np.int32),
      np.array([count], np.int32), (None,))
  if plan.segments[unit.segment].blocks > 1:
    keys = _segment_positions(*split_geometry(plan, unit), keys,
                              np.asarray(unit.blocks, np.int32))
  return keys, values, ok


def _unpack_job(plan: Plan, unit: Unit, device, level: int) -> Callable[[], None]:
  """What compiles :func:`_unpacked` for ``unit`` on ``device`` with its streams in a buffer
  of slot ``level``."""
  uplan = unit_plan(plan, unit)
  slots, on = _key_slots(uplan, level), jax.sharding.make_single_device_sharding(device)
  words = jax.ShapeDtypeStruct((_unit_words(plan, unit, level),), jnp.uint32, sharding=on)
  int32 = lambda n, sharding=None: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding)

  def job() -> None:
    with jax.default_device(device):
      device_codes.unpack_program.lower(uplan, (slots,), words, int32(4), int32(1),
                                        (None,)).compile()
      if plan.segments[unit.segment].blocks > 1:
        _segment_positions.lower(*split_geometry(plan, unit), int32(slots, on),
                                 int32(len(unit.blocks))).compile()
  return job


def request_unpacking(plan: Plan, unit: Unit, device, levels: Sequence[int]) -> None:
  """Compiles the unpacking of ``unit`` on ``device`` at those of ``levels`` neither compiled
  nor compiling, in the background (``programs.SlotLevels``): for a unit without changes in
  this version, the fallback level 0."""
  family = _unpack_family(plan, unit, device)
  for level in sorted(set(levels)):
    programs.SLOT_LEVELS.request(family, level, _unpack_job(plan, unit, device, level))


def expect_unit(plan: Plan, unit: Unit, staged: StagedRecords) -> None:
  """For a sparse unit without changes in a delta (empty, or dense): what unpacks and stages
  its changes in a later version is compiled ahead, in the background (its fallback level)."""
  _expect_levels(plan, unit, staged, [0, programs.receiver_widest(unit_plan(plan, unit))])


def _expect_levels(plan: Plan, unit: Unit, staged: StagedRecords, levels: Sequence[int]
                   ) -> None:
  """Compiles ahead, in the background, what unpacks ``unit``'s changes at each of ``levels``
  and stages their blocks (their keys come in :func:`_key_slots` of the level)."""
  uplan = unit_plan(plan, unit)
  for level in set(levels):
    staged.expect_device(unit.segment, _key_slots(uplan, level))
  request_unpacking(plan, unit, staged.device(unit.segment), levels)


def stage_unit(plan: Plan, unit: Unit, record: PackedRecord, staged: StagedRecords
               ) -> jax.Array:
  """Unpacks a sparse unit's record on the device ``staged`` holds its segment on and stages
  its changes there; returns the device's flag that every key and code is well formed (read it
  before applying anything). Its streams go to the device in a buffer sized by the slot level
  of its changes (``programs.SlotLevels``: no version after the first compiles), not by their
  bytes.

  Raises:
    PayloadError: streams longer than its changes fill.
  """
  uplan = unit_plan(plan, unit)
  device = staged.device(unit.segment)
  family = _unpack_family(plan, unit, device)
  needed = programs.needed_level(uplan, (0,), [record.count], lowest=programs.MIN_LEVEL)
  level = programs.SLOT_LEVELS.choose(family, needed)
  words = _unit_words(plan, unit, level)
  check_fits(record.streams, words, f"{plan.describe_segment(unit.segment)}'s unit")
  data, (offsets,) = device_codes.aligned_streams([record.streams], words)
  with jax.default_device(device):
    keys, values, ok = _unpacked(plan, unit, jax.device_put(data, device), offsets,
                                 record.count, level)
  programs.SLOT_LEVELS.ran(family, level)
  _expect_levels(plan, unit, staged, [needed, 0, programs.receiver_widest(uplan)])
  staged.add_device(unit.segment, keys, values, record.count)
  return ok
