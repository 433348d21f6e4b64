"""A receiver's decoded sparse records, staged on its devices as they are decoded.

The host holds the coded bytes and the records of what it is decoding now, never the decoded
version: each record (a segment's, or a part's unit's) goes to the first device that holds its
segment's leaves as soon as it is decoded, in blocks of at most :data:`MAX_BLOCK` changes (only
a record's last block is padded, on the host). When every record is in,
:meth:`StagedRecords.inputs` writes each segment's blocks into its slots (a small jitted
scatter per block, in place; compiled for a (slots, block) shape at its first sight, or ahead)
and replicates the slots over the devices of the segment's leaves: the
:class:`~programs.ReceiverInputs` of the receiver's device stage, on the device already. A
version that is refused is dropped with its staged blocks: nothing was written to the params.

Records may arrive in any order, a segment's in several pieces (the units of a split leaf from
several parts): the programs that take the slots look at each change on its own, so where a
change lies in the slots does not matter.

>>> import numpy as np, jax, jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(1000)}, rollout_dtype=jnp.bfloat16)
>>> staged = StagedRecords(plan, [jnp.zeros(1000, jnp.bfloat16)])
>>> staged.add(0, np.array([3, 9], np.int32), np.array([1, 2], np.uint16))
>>> inputs = staged.inputs(ranked=(False,))
>>> inputs.counts.tolist(), inputs.keys[0][:3].tolist(), inputs.values[0][:3].tolist()
([2], [3, 9, 1000], [1, 2, 0])
"""

from __future__ import annotations

import functools
import threading
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core.placement import replicated_on
from jsparse._src.core.plan import Plan, Segment
from jsparse._src.core.chunks import chunks_of
from jsparse._src.sync import programs
from jsparse._src.sync.programs import ReceiverInputs
from jsparse._src.wire.payload import Kind, Mode, Payload, SegmentPayload

MAX_BLOCK = 1 << 16  # changes per staged block: bounds the host's padding and the scatter


def block_size(seg: Segment) -> int:
  """Changes per staged block of ``seg``: :data:`MAX_BLOCK`, or its capacity if smaller. Few
  blocks, few calls: a record's padding is less than a block (at most 384 KiB)."""
  return max(1, min(MAX_BLOCK, seg.capacity))


def _written(keys: jax.Array, values: jax.Array, block_keys: jax.Array,
             block_values: jax.Array, start: jax.Array, count: jax.Array) -> tuple:
  """``keys``, ``values`` with the first ``count`` entries of a block written at ``start``."""
  i = jnp.arange(block_keys.shape[0], dtype=jnp.int32)
  at = jnp.where(i < count, start + i, keys.shape[0])  # past the slots: dropped
  return keys.at[at].set(block_keys, mode="drop"), values.at[at].set(block_values, mode="drop")


def _empty(slots: int, dtype: np.dtype, fill: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Slots of skipped changes: keys ``fill`` (out of range), values 0."""
  return jnp.full((slots,), fill, jnp.int32), jnp.zeros((slots,), dtype)


# ``fill`` is traced, so segments of other sizes share the compilations.
empty_slots = jax.jit(_empty, static_argnums=(0, 1))
_write_block = jax.jit(_written, donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnums=0)
def _slots_with_block(slots: int, fill: jax.Array, block_keys: jax.Array,
                      block_values: jax.Array, count: jax.Array) -> tuple:
  """Empty slots with a segment's first block written at the start: one call, not two."""
  return _written(*_empty(slots, block_values.dtype, fill), block_keys, block_values,
                  jnp.int32(0), count)


@jax.jit
def _device_owned(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Host arrays moved to the device, in buffers of the device's own (one call: the transfer
  and a copy). ``jax.device_put`` alone would not do on XLA:CPU, which adopts an aligned host
  array as a device buffer (whatever ``may_alias`` says) and so keeps the decoded host arrays,
  or the whole array a block is a view of, alive."""
  return jnp.copy(keys), jnp.copy(values)


# How a segment's staged blocks come: ``(changes per block, whether the block is committed to
# the staging device)``: blocks the host staged (:meth:`StagedRecords.add`) are not; those
# unpacked on the device (:meth:`StagedRecords.add_device`) are, of their unit's size.
BlockKind = tuple[int, bool]
_COMPILED: set[tuple] = set()  # (slots, dtype, block kind, device) whose programs are compiled


def forget_compiled() -> None:
  """Forgets which slot levels and staging programs are compiled (``programs.SlotLevels`` and
  this module's record of them): call it after ``jax.clear_caches()``, which drops the
  programs, so that they are compiled ahead again rather than in a later sync."""
  programs.SLOT_LEVELS.forget()
  _COMPILED.clear()


def compile_slots(plan: Plan, devices: Sequence, segment: int, slots: int,
                  kinds: Iterable[BlockKind] | None = None) -> None:
  """Compiles the staging's programs for ``slots`` slots of ``segment`` (staged on
  ``devices[segment]``) and blocks of each of ``kinds`` (default: the host's blocks), whether
  the segment has changes or not: at a version's first sight of those slots, or ahead of the
  version that needs them (``programs.SlotLevels``)."""
  seg = plan.segments[segment]
  device, dtype = devices[segment], jax.dtypes.canonicalize_dtype(seg.bit_dtype)
  fill = np.int32(0)
  for block, committed in ((block_size(seg), False),) if kinds is None else kinds:
    key = (slots, seg.bit_dtype, (block, committed), device)
    if key in _COMPILED:
      continue
    on = jax.sharding.make_single_device_sharding(device) if committed else None
    block_keys = jax.ShapeDtypeStruct((block,), jnp.int32, sharding=on)
    block_values = jax.ShapeDtypeStruct((block,), dtype, sharding=on)
    with jax.default_device(device):
      if not committed:
        _device_owned.lower(block_keys, block_values).compile()
      empty_slots.lower(slots, seg.bit_dtype, fill).compile()
      _slots_with_block.lower(slots, fill, block_keys, block_values, fill).compile()
      _write_block.lower(jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=on),
                         jax.ShapeDtypeStruct((slots,), dtype, sharding=on), block_keys,
                         block_values, fill, fill).compile()
    _COMPILED.add(key)


def compile_chunk_slots(plan: Plan, devices: Sequence, kinds: Sequence, chunk: int,
                        slots: Sequence[int]) -> None:
  """:func:`compile_slots` for each segment of ``chunk`` (its index in ``chunks_of``) at its
  ``slots``, for its blocks' ``kinds`` (per segment of the plan): the ``compile_staging`` of
  :class:`~programs.ReceiverInputs`."""
  for s, n in zip(chunks_of(plan)[chunk].segment_ids, slots):
    compile_slots(plan, devices, s, n, kinds[s])


def staging_device(sharding) -> jax.Device:
  """Where a segment's records are staged and its slots filled: the first device of this
  process that ``sharding`` (the segment's replicated one) names."""
  return next(iter(sharding.addressable_devices_indices_map((0,))))


def replicated_copies(arrays: Sequence[jax.Array], shardings: Sequence) -> list[jax.Array]:
  """Each of ``arrays`` (on one device) copied to every device of this process that its
  sharding (a replicated one) names, as one array: no data crosses processes. Arrays where they
  belong already stay; the rest move in one batched call."""
  out = list(arrays)
  moves = [i for i, (x, sharding) in enumerate(zip(arrays, shardings))
           if not x.sharding.is_equivalent_to(sharding, x.ndim)]
  local = [i for i in moves if shardings[i].is_fully_addressable]
  for i, x in zip(local, jax.device_put([arrays[i] for i in local],
                                        [shardings[i] for i in local])):
    out[i] = x
  for i in moves:
    if not shardings[i].is_fully_addressable:
      x, sharding = arrays[i], shardings[i]
      copies = [jax.device_put(x, d) for d in sharding.addressable_devices_indices_map(x.shape)]
      out[i] = jax.make_array_from_single_device_arrays(x.shape, sharding, copies)
  return out


class StagedRecords:
  """One version's sparse records of a receiver, staged on its devices (see the module
  docstring). :meth:`add` may be called from several threads.

  Args:
    plan: the plan.
    flat: the receiver's leaves (where each segment's records go).
  """

  def __init__(self, plan: Plan, flat: Sequence[jax.Array]):
    self.plan = plan
    self._families = [programs.receiver_family(c, flat) for c in chunks_of(plan)]
    self._shardings = [replicated_on(flat[seg.leaf_ids[0]]) for seg in plan.segments]
    # Where a segment's blocks are staged and its slots filled: a device of this process.
    self._devices = [staging_device(sharding) for sharding in self._shardings]
    self._blocks: list[list[tuple]] = [[] for _ in plan.segments]
    self._kinds: list[set[BlockKind]] = [set() for _ in plan.segments]  # of the blocks staged
    self._counts = np.zeros(len(plan.segments), np.int64)
    self._lock = threading.Lock()

  def add(self, segment: int, keys: np.ndarray, values: np.ndarray) -> None:
    """Stages changes of ``segment``: ``keys`` (positions or ranks in the segment's index
    space, any order), ``values`` (new bits or ulp codes)."""
    seg = self.plan.segments[segment]
    size = block_size(seg)
    blocks = []
    for i in range(0, len(keys), size):
      count = min(size, len(keys) - i)
      block_keys = np.asarray(keys[i:i + size], np.int32)
      block_values = np.asarray(values[i:i + size], seg.bit_dtype)
      if count < size:  # the last block: padded on the host (the padding is never written)
        block_keys = np.pad(block_keys, (0, size - count))
        block_values = np.pad(block_values, (0, size - count))
      with jax.default_device(self._devices[segment]):  # one call: transfer and copy
        blocks.append((*_device_owned(block_keys, block_values), count))
    jax.block_until_ready(blocks)  # then the host arrays are free
    with self._lock:
      self._kinds[segment].add((size, False))
      self._blocks[segment] += blocks
      self._counts[segment] += len(keys)

  def device(self, segment: int) -> jax.Device:
    """The device ``segment``'s changes are staged on."""
    return self._devices[segment]

  def add_device(self, segment: int, keys: jax.Array, values: jax.Array, count: int) -> None:
    """Stages the first ``count`` changes of ``segment`` held on :meth:`device` already (e.g.
    unpacked there): keys and values as :meth:`add` takes them."""
    with self._lock:
      self._kinds[segment].add((keys.shape[0], True))
      self._blocks[segment].append((keys, values, count))
      self._counts[segment] += count

  def expect_device(self, segment: int, block: int) -> None:
    """Notes that :meth:`add_device` may stage blocks of ``block`` changes of ``segment`` in a
    later version (one without changes in this one), so that the staging's programs for them
    are compiled ahead with this version's slot levels."""
    with self._lock:
      self._kinds[segment].add((block, True))

  def _block_kinds(self) -> tuple[tuple[BlockKind, ...], ...]:
    """Per segment, the kinds of its blocks (the host's, if none was staged)."""
    return tuple(tuple(sorted(kinds)) or ((block_size(seg), False),)
                 for kinds, seg in zip(self._kinds, self.plan.segments))

  def inputs(self, *, ranked: Sequence[bool], slot_counts=None,
             dense: Sequence[bool] = ()) -> ReceiverInputs:
    """The :class:`~programs.ReceiverInputs` of the staged records, on the devices. Slots are
    sized by ``slot_counts`` (per segment, the changes of the whole version, which a rollout
    process of a multi-process job shares with the others whatever it read), by default by
    the changes staged here, at the slot level :class:`~programs.SlotLevels` chooses (the one
    they need once compiled). ``ranked``: per segment, whether its keys are ranks; ``dense``: per
    segment, whether the delta carried it densely."""
    counts = self._counts.astype(np.int32)
    sizing = counts if slot_counts is None else np.asarray(slot_counts)
    slots, levels = [0] * len(self.plan.segments), []
    for c, family in zip(chunks_of(self.plan), self._families):
      needed = programs.needed_level(self.plan, c.segment_ids, sizing, lowest=programs.MIN_LEVEL)
      levels.append((programs.SLOT_LEVELS.choose(family, needed), needed, True))
      for s, n in zip(c.segment_ids, programs.level_slots(self.plan, c.segment_ids,
                                                          levels[-1][0])):
        slots[s] = n
    keys, values, kinds = [], [], self._block_kinds()
    for s, (seg, n) in enumerate(zip(self.plan.segments, slots)):
      # All of them, the first time: a later version may have changes where this one has none
      # (or more blocks).
      compile_slots(self.plan, self._devices, s, n, kinds[s])
      with jax.default_device(self._devices[s]):  # the staged blocks' device
        fill, blocks = np.int32(seg.size), self._blocks[s]
        if blocks:
          key, value = _slots_with_block(n, fill, blocks[0][0], blocks[0][1],
                                         np.int32(blocks[0][2]))
        else:
          key, value = empty_slots(n, seg.bit_dtype, fill)
        start = blocks[0][2] if blocks else 0
        for block_keys, block_values, count in blocks[1:]:
          key, value = _write_block(key, value, block_keys, block_values, np.int32(start),
                                    np.int32(count))
          start += count
      keys.append(key)
      values.append(value)
    self._blocks = [[] for _ in self.plan.segments]  # the slots hold them now
    # Committed to their devices however they were made (the empty slots of a segment without
    # changes are not; those holding blocks unpacked on the device are): the programs after
    # them see the same arguments whichever segments have changes, and compile once.
    committed = jax.device_put(keys + values, list(self._devices) * 2)
    placed = replicated_copies(committed, self._shardings * 2)
    return ReceiverInputs(tuple(placed[:len(keys)]), tuple(placed[len(keys):]), counts,
                          tuple(ranked), tuple(levels),
                          functools.partial(compile_chunk_slots, self.plan,
                                            tuple(self._devices), kinds),
                          "units" if any(c for k in kinds for _, c in k) else "records",
                          tuple(dense))


def stage_records(plan: Plan, flat: Sequence[jax.Array], records: Iterable[SegmentPayload]
                  ) -> tuple[StagedRecords, dict[int, np.ndarray], tuple[Mode, ...]]:
  """A decoded payload's records (one per segment) for a receiver holding ``flat``, taken one
  at a time: the sparse ones staged, the dense ones returned by segment, and every record's
  mode."""
  staged = StagedRecords(plan, flat)
  dense, modes = {}, []
  for s, record in enumerate(records):
    modes.append(record.mode)
    if record.mode == Mode.DENSE:
      dense[s] = record.values
    elif record.mode != Mode.EMPTY and record.count:
      staged.add(s, record.indices, record.values)
  return staged, dense, tuple(modes)


def dense_in_delta(header: Payload, modes: Sequence[Mode]) -> tuple[bool, ...]:
  """Per segment, whether a delta ``header`` carried it densely (its sender may widen next:
  ``programs.widens``); none for an anchor."""
  return tuple(header.kind == Kind.DELTA and mode == Mode.DENSE for mode in modes)
