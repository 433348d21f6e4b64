"""The jitted device programs of :class:`~jsparse.Sender` and :class:`~jsparse.Receiver`, and
the host arrays they take.

Every program runs per chunk (``core/chunks.py``: a few segments of one structure), with the
chunk's structural sub-plan (and the receiver's block layouts) static: chunks of the same
structure share one compilation, so compile time follows the distinct leaf shapes, not the leaf
count. The sender's diff program and the digest compile once per chunk structure; the
per-change programs (ranks, positions, the receiver's apply) take slots sized to the payload's
changes, at most 7 variants each (:func:`slots_needed`), compiled on a background thread when
first needed while a compiled variant serves (:class:`SlotLevels`): no sync after the first
compiles. The chunks' results are put back in plan order (per leaf, per segment), so
everything after the device stages sees the whole tree.

- Sender: :func:`sender_changes` diffs, takes the next snapshot and digests it (one program),
  then ranks the changes of the ordered segments (a second, on slots sized to the changes).
- Receiver: ``staging.py`` writes a decoded payload's records into those slots on the device;
  :func:`apply_inputs` turns ranks into positions and applies bits or ulp codes (two
  programs: fused into one, XLA:CPU ran them 2x slower), in place when donated, and digests.

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(1000)}, capacity=0.1, bucket_size=1000)
>>> slots_needed(plan, [3]), slots_needed(plan, [60]), slots_needed(plan, [100])
((13,), (71,), (100,))
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import os
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

from jsparse._src.core.chunks import (Chunk, chunks_of, place_leaves, place_segments,
                                      sub_plan, sum_digests, unchunked_leaves)
from jsparse._src.core.bits import gather_bits
from jsparse._src.core.delta import (Delta, apply_flat, change_counts, diff_flat_with_old,
                                     segment_bits)
from jsparse._src.core.placement import diff_targets
from jsparse._src.core.digest import bits_digest, change_digest
from jsparse._src.core.layout import no_context_mesh
from jsparse._src.core.plan import Plan, Segment
from jsparse._src.core.units import local_value
from jsparse._src.device import block_ranks
from jsparse._src.device import ranks as ranks_lib
from jsparse._src.device import ulp_codes
from jsparse._src.sync.compile_side_by_side import compile_distinct
from jsparse._src.wire.payload import Coding


class DeviceChanges(NamedTuple):
  """A sender's diff, on device.

  Attributes:
    delta: the :class:`~jsparse.Delta` (new bits at the changed positions); for a delta (not an
      anchor) the segments not split into blocks hold ``slots_needed`` slots, not the capacity.
    old_values: per segment, the old bits at the delta's positions (for ulp codes).
    ranks: per segment, the ranks of its first changes in the exponent-class order (None for
      segments named by position); None when no segment is ranked.
    block_counts: per segment, ``int32[blocks]`` changes per trainer block of a split leaf
      (None for the others).
    levels: per chunk, ``(its family in SLOT_LEVELS, the slot level of its slots, the level its
      changes need, ahead)`` (see :class:`SlotLevels`); empty for an anchor. ``ahead``: None,
      or ``(key, level)`` when the chunk's diff is widening or narrowing to slot ``level``
      (:class:`DiffWidths`): what codes its changes at that level is compiled under ``key``
      before the diff moves there.
  """

  delta: Delta
  old_values: tuple
  ranks: tuple | None
  block_counts: tuple = ()
  levels: tuple = ()


class ReceiverInputs(NamedTuple):
  """A decoded payload's sparse records in :func:`slots_needed` slots (from ``staging.py``).

  Attributes:
    keys: per segment, positions or ranks (the segment size in unused slots).
    values: per segment, ulp codes (0 in unused slots).
    counts: ``int32[segments]``: used slots (0 for dense records, written separately).
    ranked: per segment, whether its keys are ranks (static).
    levels: per chunk, ``(the slot level of its slots, the level its changes need, whether
      the staging compiled its programs for those slots)`` (see :class:`SlotLevels`); empty:
      none is compiled ahead.
    compile_staging: ``(chunk, slots) -> None`` compiles the programs that stage the slots of
      chunk ``chunk`` (its index in ``chunks_of``) for its segments' ``slots`` (run on the
      background thread of :class:`SlotLevels`), or None.
    staging: which stage made them (``"records"``: ``staging.py`` from the host; ``"units"``:
      ``staging.py`` from the units of packed parts, unpacked on the device): their programs
      are compiled for each.
    dense: per segment, whether the delta carried it densely (its sender may widen next);
      empty: none, or unknown.
  """

  keys: tuple
  values: tuple
  counts: np.ndarray
  ranked: tuple[bool, ...]
  levels: tuple = ()
  compile_staging: Callable[[int, tuple[int, ...]], None] | None = None
  staging: str = "records"
  dense: tuple = ()


def cast_flat(plan: Plan, flat: list) -> list[jax.Array]:
  return [jnp.asarray(x).astype(leaf.rollout_dtype) for x, leaf in zip(flat, plan.leaves)]


def _trainer_layouts(plan: Plan) -> tuple:
  return tuple(leaf.layout for leaf in plan.leaves)


@functools.partial(jax.jit, static_argnums=0)
def snapshot_program(plan: Plan, flat: list, leaf_ids: jax.Array
                     ) -> tuple[list[jax.Array], jax.Array]:
  """A chunk's rollout-dtype snapshot of trainer leaves, and its digest."""
  snapshot = cast_flat(plan, flat)
  return snapshot, bits_digest(snapshot, _trainer_layouts(plan), leaf_ids)


def _cast_unchunked(plan: Plan, flat: list) -> list:
  """``flat`` with the leaves in no chunk (zero-size) cast to their rollout dtypes."""
  out = list(flat)
  for i in unchunked_leaves(plan):
    out[i] = jnp.asarray(flat[i]).astype(plan.leaves[i].rollout_dtype)
  return out


def snapshot_and_digest(plan: Plan, flat: list) -> tuple[list[jax.Array], jax.Array]:
  """The rollout-dtype snapshot of trainer leaves, and its digest."""
  chunks = chunks_of(plan)
  calls = [(("snapshot", c.plan, tuple(getattr(x, "sharding", None) for x in c.leaves(flat))),
            snapshot_program, (c.plan, c.leaves(flat), c.leaf_id_array), {}) for c in chunks]
  compile_distinct(calls)
  outs = [fn(*args) for _, fn, args, _ in calls]
  return (place_leaves(plan, chunks, [o[0] for o in outs], _cast_unchunked(plan, flat)),
          sum_digests([o[1] for o in outs]))


def _tables(plan: Plan, seg: Segment, flat: list) -> ranks_lib.ClassTables:
  return ranks_lib.class_tables(segment_bits(plan, seg, flat), seg.dtype)


# Per segment, inside a chunk's programs: jitted on the segment's own structural plan (a
# ``sub_plan``, which names no paths), so that a chunk's segments of one structure share one
# trace and one lowering.
@functools.partial(jax.jit, static_argnums=0)
def _segment_tables(single: Plan, flat: list) -> ranks_lib.ClassTables:
  return _tables(single, single.segments[0], flat)


@functools.partial(jax.jit, static_argnums=0)
def _segment_gain(single: Plan, positions: jax.Array, new: jax.Array, old: jax.Array,
                  leaf_ids: jax.Array) -> jax.Array:
  seg = single.segments[0]
  within, ids = _slot_leaves(seg, jnp.minimum(positions, seg.size - 1), leaf_ids)
  return change_digest(new, old, within, ids, positions < seg.size)


def _placed(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Inside a program: ``x`` laid out as ``sharding`` (on its mesh: explicit axes resharded,
  automatic ones constrained)."""
  if any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _relaid_new(plan: Plan, new: list, relaid: tuple | None) -> list:
  """Inside a program: ``new`` with each leaf ``relaid`` names cast and laid out as named."""
  if relaid is None:
    return new
  return [x if target is None else _placed(x.astype(leaf.rollout_dtype), target)
          for x, target, leaf in zip(new, relaid, plan.leaves)]


@functools.partial(jax.jit, static_argnums=0, static_argnames="relaid")
def counts_program(plan: Plan, snapshot: list, new: list, *, relaid: tuple | None = None
                   ) -> jax.Array:
  """A chunk's changes per segment as its slots must hold them (:func:`slot_counts`), the
  snapshot not donated: what a sender's first delta sizes its diff's slots by
  (:class:`DiffWidths`)."""
  counts, block_counts = change_counts(plan, snapshot, _relaid_new(plan, new, relaid))
  return slot_counts(plan, counts, block_counts)


def slot_counts(plan: Plan, counts: jax.Array, block_counts: Sequence) -> jax.Array:
  """Inside a program: ``int32[segments]``, per segment the changes its slots must hold:
  ``counts[s]``, or for a segment split into blocks (each block holds an equal share of its
  slots) its fullest block's times its blocks (``block_counts[s]``: per block). Reduced on
  the device, so that every process of a multi-host job reads the same (its blocks are split
  across the processes)."""
  if not plan.segments:
    return jnp.zeros((0,), jnp.int32)
  return jnp.stack([counts[s] if b is None or seg.blocks == 1 else jnp.max(b) * seg.blocks
                    for s, (seg, b) in enumerate(zip(plan.segments, block_counts))])


def _slot_leaves(seg: Segment, positions: jax.Array, leaf_ids: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
  """Each of a segment's slots' position inside its leaf, and that leaf's id (``leaf_ids``:
  the chunk's, per leaf of its plan)."""
  if not seg.pooled:
    return positions, leaf_ids[seg.leaf_ids[0]]
  starts = np.asarray(seg.offsets[1:], np.int32)
  member = jnp.sum(positions[:, None] >= starts[None, :], axis=1, dtype=jnp.int32)
  return (positions - jnp.asarray(np.asarray(seg.offsets, np.int32))[member],
          leaf_ids[jnp.asarray(np.asarray(seg.leaf_ids, np.int32))][member])


def _digest_gain(plan: Plan, delta: Delta, old_values: tuple, leaf_ids: jax.Array
                 ) -> jax.Array:
  """``uint32[2]``: what the digest of a chunk's snapshot gains from the delta's slots (old and
  new bits at each changed position): its whole gain if no segment overflowed its slots."""
  gain = jnp.zeros((2,), jnp.uint32)
  for s, (seg, positions, new, old) in enumerate(zip(plan.segments, delta.indices, delta.values,
                                                     old_values)):
    gain = gain + _segment_gain(sub_plan(plan, (s,)), positions, new, old,
                                leaf_ids[np.asarray(seg.leaf_ids, np.int32)])
  return gain


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames="relaid",
                   donate_argnums=2)
def diff_program(plan: Plan, ranked: bool, snapshot: list, new: list, leaf_ids: jax.Array, *,
                 relaid: tuple | None = None):
  """A chunk's (delta, old bits at its positions, per-block counts, class tables of the ordered
  segments (if ``ranked``; for :func:`sparse_program`), the next snapshot, what its digest
  gains over the snapshot's if no segment overflowed, its :func:`slot_counts`). The snapshot
  is donated. ``relaid``: per leaf, the snapshot's sharding where ``new`` is laid out otherwise
  (a leaf the plan holds whole, as a train step may split it), else None: such a leaf is cast
  and gathered here, so the next snapshot keeps the snapshot's layout."""
  new = _relaid_new(plan, new, relaid)
  delta, old_values, block_counts = diff_flat_with_old(plan, snapshot, new)
  tables = tuple(_segment_tables(sub_plan(plan, (s,)), [snapshot[i] for i in seg.leaf_ids])
                 if ranked and seg.ordered else None for s, seg in enumerate(plan.segments))
  gain = _digest_gain(plan, delta, old_values, leaf_ids)
  # Every read of the snapshot comes before the next snapshot is cast into its (donated)
  # buffers: XLA would otherwise copy the snapshot first (two more passes, and a temporary of
  # its size).
  read = (delta, old_values, block_counts, tables, gain,
          slot_counts(plan, delta.counts, block_counts))
  new, read = jax.lax.optimization_barrier((new, read))
  return (*read[:4], cast_flat(plan, new), *read[4:])


@jax.jit
def _in_plan_order(chunk_arrays: list[jax.Array], order: jax.Array) -> jax.Array:
  return jnp.concatenate(chunk_arrays)[order]


@functools.lru_cache(maxsize=64)
def _plan_order(plan: Plan) -> np.ndarray:
  """Where each segment's entry is in the chunks' concatenated per-segment arrays."""
  position = np.empty(len(plan.segments), np.int32)
  position[[s for c in chunks_of(plan) for s in c.segment_ids]] = np.arange(len(plan.segments))
  return position


def _segment_array(plan: Plan, chunk_arrays: list[jax.Array], empty: jax.Array) -> jax.Array:
  return _in_plan_order(chunk_arrays, _plan_order(plan)) if chunk_arrays else empty


@functools.partial(jax.jit, static_argnums=(0, 1))
def sparse_program(plan: Plan, slots: tuple[int, ...], tables: tuple, positions: tuple,
                   values: tuple, old_values: tuple) -> tuple:
  """Per segment, a delta's changes in ``slots[s]`` slots instead of the capacity, so that only
  those leave the device: ``(positions, new bits, old bits, ranks)``, the ranks where the
  segment has class ``tables`` (else None). A segment split into blocks keeps all its slots
  (each block's changes lie in that block's slots)."""
  out = []
  for seg, n, table, pos, new, old in zip(plan.segments, slots, tables, positions, values,
                                          old_values):
    ranks = None
    if table is not None:
      classes = ulp_codes.exponent_class(old[:n], seg.dtype, jnp)
      ranks = ranks_lib.ranks_of(table, jnp.minimum(pos[:n], seg.size - 1), classes)
    if seg.blocks == 1:
      pos, new, old = pos[:n], new[:n], old[:n]
    out.append((pos, new, old, ranks))
  return tuple(out)


def _relaid(targets: list) -> tuple | None:
  return None if all(t is None for t in targets) else tuple(targets)


def _trimmed(chunk: Chunk, counts: np.ndarray, requests: list, width: int, coding: Coding,
             *args: tuple) -> tuple:
  """:func:`sparse_program` of a chunk at the highest compiled slot level that holds its
  ``counts`` (see :class:`SlotLevels`), and ``(its family, that level, the level they
  need)``; the level they need, if another, is added to ``requests``. ``width``: the slot
  level its diff ran at (0: the capacity; below, widened), the widest it may need; ``args``:
  the chunk's tables, positions, new and old bits."""
  ids = range(len(chunk.segment_ids))
  within = np.minimum(counts[list(chunk.segment_ids)],
                      level_slots(chunk.plan, ids, width))  # overflowed ones: dense
  needed = needed_level(chunk.plan, ids, within, lowest=width)
  # Per coding: what runs after it (the packed coding's packing) compiles with its levels.
  family = ("send", chunk.plan, width, coding, tuple(t is None for t in args[0]),
            args[1][0].sharding)
  level = SLOT_LEVELS.choose(family, needed, base=width)
  SLOT_LEVELS.ran(family, level)
  if level != needed and SLOT_LEVELS.wanted(family, needed):
    slots, abstract = level_slots(chunk.plan, ids, needed), jax.tree.map(like, args)
    requests.append((family, needed, lambda: sparse_program.lower(chunk.plan, slots,
                                                                  *abstract).compile(),
                     None, width))
  return (sparse_program(chunk.plan, level_slots(chunk.plan, ids, level), *args),
          (family, level, needed))


# How far a segment's slots widen by default: 80% of it. Past that, the sparse records of the
# packed coding near or pass the dense one (measured at 100% changed: +3%), and dense needs
# no slots.
DEFAULT_MAX_CAPACITY = 0.8
WIDEN_HEADROOM = 1.5  # a diff widens when its changes come within this of its slots


def sender_changes(plan: Plan, coding: Coding, snapshot: list, new: list, *,
                   base_digest: Any, ranks: bool = True, widths: "DiffWidths | None" = None
                   ) -> tuple[DeviceChanges, list[jax.Array], jax.Array]:
  """The sender's device stage: (its changes, the next snapshot, its digest). ``snapshot`` is
  donated; ``base_digest`` (``uint32[2]``) is its digest, which the changes update: the
  digest is a sum over elements, so only the changed ones are read (all of them, only when a
  segment overflowed its slots). ``ranks=False`` skips ranking (an anchor needs none).
  ``widths``: the sender's :class:`DiffWidths` (each chunk's diff at its slot level; None: at
  the capacity)."""
  chunks = chunks_of(plan)
  targets = diff_targets(new, snapshot)
  families = [("diff", c.plan, coding.ranked, _relaid(c.leaves(targets)),
               tuple(getattr(x, "sharding", None) for x in c.leaves(snapshot))) for c in chunks]
  abstract = [(jax.tree.map(like, c.leaves(snapshot)), jax.tree.map(like, c.leaves(new)))
              for c in chunks] if widths is not None else None
  requests = []
  jobs = [functools.partial(_diff_job, c, coding.ranked, snap, fresh, family[3])
          for c, family, (snap, fresh) in zip(chunks, families, abstract)] if abstract else ()
  counts_calls = [(("counts", f), counts_program, (c.plan, c.leaves(snapshot), c.leaves(new)),
                   {"relaid": f[3]}) for c, f in zip(chunks, families)]
  if jobs:
    compile_distinct(call for call, f in zip(counts_calls, families)
                     if widths.counts((f, coding), ranks))
  diff_levels = [widths.start((f, coding), c.plan, ranks,
                              lambda call=call: local_value(call[1](*call[2], **call[3])))
                 for c, f, call in zip(chunks, families, counts_calls)
                 ] if jobs else [0] * len(chunks)
  diff_calls = [(("diff", f, w, tuple(getattr(x, "sharding", None) for x in c.leaves(new))),
                 diff_program, (widened(c.plan, w), coding.ranked, c.leaves(snapshot),
                                c.leaves(new), c.leaf_id_array), {"relaid": f[3]})
                for c, f, w in zip(chunks, families, diff_levels)]
  compile_distinct(diff_calls)
  outs = [fn(*args, **kwargs) for _, fn, args, kwargs in diff_calls]
  deltas = [o[0] for o in outs]
  delta = Delta(place_segments(plan, chunks, [d.indices for d in deltas]),
                place_segments(plan, chunks, [d.values for d in deltas]),
                _segment_array(plan, [d.counts for d in deltas], jnp.zeros((0,), jnp.int32)),
                _segment_array(plan, [d.overflow for d in deltas], jnp.zeros((0,), bool)))
  old_values, block_counts, tables = (place_segments(plan, chunks, [o[k] for o in outs])
                                      for k in (1, 2, 3))
  next_snapshot = place_leaves(plan, chunks, [o[4] for o in outs], _cast_unchunked(plan, new))
  layouts = _trainer_layouts(plan)
  if widths is not None:  # what a version that overflows runs: compiled ahead
    requests += [r for r in (_digest_request(c, next_snapshot, layouts) for c in chunks) if r]
  if local_value(delta.overflow).any():  # the slots miss some changes: digest it all
    digest = leaves_digest(plan, next_snapshot, layouts)
  else:
    digest = np.asarray(base_digest, np.uint32) + np.asarray(sum_digests([o[5] for o in outs]))
  ranks_out, levels = None, ()
  if ranks:  # a delta: its changes (and ranks) need only as many slots as this step's changes
    counts = local_value(delta.counts)
    trimmed = [_trimmed(c, counts, requests, w, coding, c.segments(tables),
                        c.segments(delta.indices),
                        c.segments(delta.values), c.segments(old_values))
               for c, w in zip(chunks, diff_levels)]
    held = local_value(_segment_array(plan, [o[6] for o in outs], jnp.zeros((0,), jnp.int32)))
    aheads = [widths.follow((family, coding), c.plan, held[list(c.segment_ids)], requests,
                            job)
              for c, family, job in zip(chunks, families, jobs)] if jobs else [None] * len(chunks)
    levels = tuple((*level, ahead) for (_, level), ahead in zip(trimmed, aheads))
    indices, values, old_values, ranks_out = (
        place_segments(plan, chunks, [[seg[k] for seg in out] for out, _ in trimmed])
        for k in range(4))
    delta = delta._replace(indices=indices, values=values)
    ranks_out = ranks_out if coding.ranked else None
  for request in requests:  # once this call's programs are compiled
    SLOT_LEVELS.request(*request)
  return (DeviceChanges(delta, old_values, ranks_out, block_counts, levels), next_snapshot,
          digest)


def _digest_request(chunk: Chunk, snapshot: list, layouts: tuple) -> tuple | None:
  """A :meth:`SlotLevels.request` of the program that digests a chunk's next ``snapshot``
  whole (laid out as ``snapshot``, split as ``layouts``: :func:`leaves_digest`), or None once
  it is compiled or compiling."""
  leaves = chunk.leaves(snapshot)
  family = ("digest", chunk.plan, tuple(x.sharding for x in leaves))
  if not SLOT_LEVELS.wanted(family, 0):
    return None
  abstract, chunk_layouts = [like(x) for x in leaves], tuple(chunk.leaves(layouts))
  return (family, 0, lambda: digest_program.lower(abstract, chunk_layouts,
                                                  chunk.leaf_id_array).compile(), None, None)


def _diff_job(chunk: Chunk, ranked: bool, snapshot: list, new: list, relaid, level: int
              ) -> Callable[[], None]:
  """What compiles a chunk's :func:`diff_program` widened to ``level`` (abstract arrays), and
  the :func:`sparse_program` its first call trims with (at that level: it holds any count)."""
  def job() -> None:
    compiled = diff_program.lower(widened(chunk.plan, level), ranked, snapshot, new,
                                  chunk.leaf_id_array, relaid=relaid).compile()
    out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                       compiled.out_info)
    delta, old_values, _, tables = out[:4]
    slots = level_slots(chunk.plan, range(len(chunk.segment_ids)), level)
    sparse_program.lower(chunk.plan, slots, tuple(tables), tuple(delta.indices),
                         tuple(delta.values), tuple(old_values)).compile()
  return job


class DiffWidths:
  """How wide a sender's diff runs, chunk by chunk: ``capacity`` is where it starts, not a
  ceiling. A chunk's first delta counts its changes first and runs at the slot level that
  holds them with twice the headroom (the first sync compiles in any case; a run's first
  steps change the most).
  After each delta, a chunk whose changes come within ``headroom`` of its slots (or overflow
  them) has its diff widened for the next versions to twice that headroom, by slot levels
  below 0 (:func:`level_slots`), up to ``max_share`` of each segment (:func:`widest_level`);
  one whose changes fall two levels below narrows again, down to the capacity (level 0). A
  level is compiled in the background (:class:`SlotLevels`), with what codes the changes at
  it, and used from the second sync after it is compiled (a receiver asks for its own
  programs of that level when it applies the version that made the sender ask: it gets a step
  to compile them): a diff never waits for a compilation after the first. Until then the level it runs at serves; changes over its slots (a density that
  jumps past twice the headroom in one step) are carried densely, exactly, once. Past
  ``max_share`` a segment is sent densely. With compiling ahead turned off
  (:class:`SlotLevels`), a wider level runs from the next sync, compiled there, and a diff
  never narrows.

  Memory: a widened diff's outputs hold, per slot, an int32 position and the new and old bits
  (8 bytes per slot for a bf16 rollout: at most ``4 * max_share`` times the rollout bytes of
  the widened chunks, while a sync's device stage runs), and its compaction's temporaries
  grow with the slots too. Compiled (``memory_analysis``), the diff of one 131,072-element
  bf16 segment takes 1.0 MB (temporaries and outputs) at the default 5% capacity, 2.6 MB
  widened to 14%, 2.9 MB to 40% and 3.0 MB to the whole segment: 3.9x to 11.6x its 262 KB
  of rollout bytes. ``Sender(max_capacity=)`` caps the share. Jobs of several processes keep
  the capacity (every process must run the same shapes).
  """

  def __init__(self, max_share: float = DEFAULT_MAX_CAPACITY, headroom: float = WIDEN_HEADROOM):
    self.max_share, self.headroom = max_share, headroom
    self._levels: dict[Any, int] = {}
    self._wanted: dict[Any, int] = {}  # a level asked for, used once compiled
    self._armed: dict[Any, int] = {}  # a level compiled by the last sync: used from this one
    self._first_coding: Any = None  # the coding of the sender's first delta

  def start(self, key: tuple, chunk_plan: Plan, delta: bool,
            counts: Callable[[], np.ndarray]) -> int:
    """The slot level a chunk's diff runs at in this sync (:meth:`level`); ``key``: the
    diff's family in :data:`SLOT_LEVELS` and the step's coding. A sender's first delta runs
    at the level its changes need, ``counts()`` per segment, with twice the headroom (a
    counting pass first: the first sync compiles in any case); a coding's first delta after
    that (``"auto"`` chose another) at the capacity, compiled ahead by the choice's
    calibration; an anchor at the capacity."""
    if jax.process_count() > 1 or not delta:
      return 0
    if key not in self._levels:  # every chunk of the first delta counts its changes
      self._levels[key] = self._level_for(chunk_plan, counts(), 2 * self.headroom) \
          if self.counts(key, delta) else 0
      if self._first_coding is None:
        self._first_coding = key[1]
    armed = self._armed.pop(key, None)
    if armed is not None:  # compiled by the last sync
      self._levels[key] = armed
      if self._wanted.get(key) == armed:
        del self._wanted[key]
    wanted = self._wanted.get(key)
    if wanted is not None and not SLOT_LEVELS.compiles_ahead():  # none compiles ahead: a
      # wider level compiles in this call, a narrower one is not worth a compilation
      if wanted < self.level(key):
        self._levels[key] = wanted
      del self._wanted[key]
    elif (wanted is not None and wanted in SLOT_LEVELS.ready(key[0])
        and not SLOT_LEVELS.compiling(ahead_key(key), wanted)):
      # Compiled: it moves at the next sync, so that a receiver, which asked for its own
      # programs of that level a little later, has had a step to compile them too.
      self._armed[key] = wanted
    return self.level(key)

  def counts(self, key: tuple, delta: bool) -> bool:
    """Whether :meth:`start` of ``key`` counts the chunk's changes first (a first delta)."""
    return (jax.process_count() == 1 and delta and key not in self._levels
            and self._first_coding in (None, key[1]))

  def level(self, key: tuple) -> int:
    """The slot level a chunk's diff runs at now (0: its capacity)."""
    return self._levels.get(key, 0)

  def follow(self, key: tuple, chunk_plan: Plan, counts: np.ndarray, requests: list,
             job: Callable[[int], Callable[[], None]]) -> tuple | None:
    """Moves the chunk's diff to the level its ``counts`` (times the headroom) need: asks for
    it in ``requests`` (``job(level)`` compiles it), to run from the next sync once compiled.
    Returns None, or ``(ahead key, level)`` while the diff is moving to another level: what
    codes the changes at that level compiles under that key (``ahead`` in
    :class:`DeviceChanges`) before the diff moves."""
    if jax.process_count() > 1:
      return None
    family, now = key[0], self.level(key)
    if now == 0 and widest_level(chunk_plan, range(len(chunk_plan.segments)),
                                 self.max_share) == 0:
      return None
    SLOT_LEVELS.ran(family, now)
    # Near its slots (within the headroom) or over them: widen, with twice the headroom (a
    # density that still rises stays sparse); far below them (two levels): narrow.
    target = self._level_for(chunk_plan, counts, 2 * self.headroom)
    armed = self._armed.get(key)
    if self._level_for(chunk_plan, counts, self.headroom) >= now and target <= now + 1:
      self._wanted.pop(key, None)
      self._armed.pop(key, None)
      return None
    if armed is not None and not min(now, target) <= armed <= max(now, target):
      del self._armed[key]  # a move the other way now: not made
    self._wanted[key] = target
    if SLOT_LEVELS.wanted(family, target):
      requests.append((family, target, job(target), None, None))  # (never urgent: ``now``
      # holds every change the next steps may have until it is compiled)
    return ahead_key(key), target

  def _level_for(self, chunk_plan: Plan, counts: np.ndarray, headroom: float) -> int:
    """The level (at most 0, at least the widest) whose slots hold ``counts`` times
    ``headroom`` in every segment (for a segment split into blocks, ``counts`` is its fullest
    block's times its blocks: :func:`slot_counts`)."""
    ids = range(len(chunk_plan.segments))
    want = np.ceil(np.asarray(counts, np.float64) * headroom)
    return min(0, needed_level(chunk_plan, ids, want,
                               lowest=widest_level(chunk_plan, ids, self.max_share)))


def ahead_key(key: tuple) -> tuple:
  """The key in :data:`SLOT_LEVELS` under which what codes a chunk's changes (a packed
  coding's packing) compiles at the level its diff moves to, before it moves (``key``: the
  diff's family and the coding, as :class:`DiffWidths` names them)."""
  return ("ahead", key)


# Slot levels: level k holds a segment's capacity times 2**(-k/2), down to an eighth. Steps of a
# square root of 2 rather than halvings: above the last level, a chunk's slots exceed its
# fullest segment's changes by at most 1.42x, not 2x (on the benchmark's 21M step, 1.65x its
# changes in all rather than 2.22x), for at most 7 compiled variants instead of 4, compiled in
# the background.
#
# Levels below 0 are *wider* than the capacity (its slots times 2**(-level/2), at most the
# segment's size): a sender widens the diff of a chunk whose changes outgrow its capacity
# (:class:`DiffWidths`), so that a dense step (a high learning rate, the first steps of a run)
# is still coded sparsely; receivers size their slots the same way. A segment the trainer
# splits into blocks widens block by block: each block's slots, at most the block's size.
NUM_LEVELS = 7
MIN_LEVEL = -40  # wider than any segment needs (2**20 times the capacity)
_ROOT_HALF = (181, 256)  # 1/sqrt(2) to 8 bits, in integers: every process sizes alike
_ROOT_TWO = (362, 256)  # sqrt(2), likewise


def level_slots(plan: Plan, segment_ids: Sequence[int], level: int) -> tuple[int, ...]:
  """The slots of ``segment_ids`` at slot level ``level``: their capacities times
  ``2**(-level/2)`` (rounded up, in integers; at a level below 0, at most the segment's size,
  and for a segment split into blocks, each block's slots so widened, at most its size).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(1000)}, capacity=0.1, bucket_size=1000)
  >>> [level_slots(plan, [0], level)[0] for level in range(-7, NUM_LEVELS)]
  [1000, 800, 566, 400, 283, 200, 142, 100, 71, 50, 36, 25, 18, 13]
  """
  out = []
  for s in segment_ids:
    seg = plan.segments[s]
    if level >= 0:
      halvings, odd = divmod(level, 2)
      num, den = _ROOT_HALF if odd else (1, 1)
      out.append(-(-seg.capacity * num // (den << halvings)))
    else:
      doublings, odd = divmod(-level, 2)
      num, den = _ROOT_TWO if odd else (1, 1)
      blocks = seg.blocks
      per_block = seg.capacity // blocks
      out.append(blocks * min(seg.size // blocks, -(-(per_block << doublings) * num // den)))
  return tuple(out)


def needed_level(plan: Plan, segment_ids: Sequence[int], counts, lowest: int = 0) -> int:
  """The highest slot level (at most ``NUM_LEVELS - 1``, at least ``lowest``) at which every
  one of ``segment_ids`` holds its ``counts[s]`` changes (``lowest`` if none does)."""
  for level in range(NUM_LEVELS - 1, lowest, -1):
    if all(int(counts[s]) <= n for s, n in zip(segment_ids, level_slots(plan, segment_ids,
                                                                        level))):
      return level
  return lowest


def widest_level(plan: Plan, segment_ids: Sequence[int], max_share: float) -> int:
  """The widest level (at most 0) whose slots stay within ``max_share`` of some widenable
  segment of ``segment_ids`` (0 when none widens): beyond it a segment is sent densely. A
  smaller segment of a mixed chunk may reach a larger share there (at most its size): the
  chunk's largest segments set how far it widens.

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(1000)}, capacity=0.1, bucket_size=1000)
  >>> widest_level(plan, [0], 0.5), level_slots(plan, [0], widest_level(plan, [0], 0.5))
  (-4, (400,))
  """
  level = 0
  while level > MIN_LEVEL:
    wider = level_slots(plan, segment_ids, level - 1)
    now = level_slots(plan, segment_ids, level)
    growing = [(s, n) for s, n, m in zip(segment_ids, wider, now) if n > m]
    if not growing or all(n > max_share * plan.segments[s].size for s, n in growing):
      return level
    level -= 1
  return level


@functools.lru_cache(maxsize=256)
def widened(plan: Plan, level: int) -> Plan:
  """``plan`` with the capacity of each segment at slot ``level`` (``plan`` itself at level 0
  or above): what a widened diff runs on."""
  if level >= 0:
    return plan
  slots = level_slots(plan, range(len(plan.segments)), level)
  return dataclasses.replace(plan, segments=tuple(
      dataclasses.replace(seg, capacity=n) for seg, n in zip(plan.segments, slots)))


def slots_needed(plan: Plan, counts) -> tuple[int, ...]:
  """Per segment, how many slots a payload with ``counts`` changes needs: the capacity scaled
  down by steps of ``sqrt(2)``, to an eighth at most, while every segment of its chunk still
  fits (its chunk's :func:`needed_level`). A chunk's compiled shapes stay few (7 levels), and
  the per-change work of a sparse payload follows each chunk's density rather than its
  capacity: a pool of small leaves (all its elements as capacity) is not padded to its
  capacity because the matrices of another chunk need theirs. The programs run at these slots
  once the level is compiled (:class:`SlotLevels`)."""
  slots = [seg.capacity for seg in plan.segments]
  for chunk in chunks_of(plan):
    ids = chunk.segment_ids
    for s, n in zip(ids, level_slots(plan, ids, needed_level(plan, ids, counts))):
      slots[s] = n
  return tuple(slots)


@dataclasses.dataclass
class _Family:
  """The slot levels of one chunk's per-change programs (one chunk structure, placed one way)
  that are compiled, and those compiling, per configuration of the programs."""

  ready: dict[Any, set[int]] = dataclasses.field(default_factory=dict)
  pending: dict[Any, set[int]] = dataclasses.field(default_factory=dict)


class SlotLevels:
  """Which slot levels of the per-change programs are compiled, and a background thread that
  compiles the others, so that no sync after the first compiles.

  A chunk's per-change programs (the sender's :func:`sparse_program` and packing; the
  receiver's staging or unpacking, positions and apply) take slots sized to the step's
  changes: its capacities scaled down by 0 to 6 steps of ``sqrt(2)`` (the *level*:
  :func:`level_slots`), each level a compilation. A
  training run's density drifts across those boundaries (AdamW: 2.2% to 0.85% over its first
  steps), and compiling a level when a step first needs it stalls that step for seconds.
  Instead, the first call of a chunk's programs runs (and compiles) level 0, the capacity,
  which holds any step's changes; a level that a later step needs is compiled on a
  background thread, ahead of time (``lower`` and
  ``compile`` with the shapes and shardings the call will have), and until it is ready the
  highest compiled level that holds the changes serves: more slots, the same result. Levels
  never needed are never compiled. In a job of several processes every process must run the
  same shapes, whatever it has compiled: there each call runs at the level it needs, compiled
  when first needed.

  Compiling ahead can be turned off (``JSPARSE_COMPILE_AHEAD=0`` in the environment, or
  :func:`compile_ahead`): then nothing compiles in the background; a call runs at a compiled
  level that holds its changes (more slots than it needs, the same result), and compiles one
  only where none does (a sender's diff widens at once). No compile time goes to levels a run
  never uses (a short job, a test suite, a host whose cores are busy), at the price of more
  slots than needed, and a compilation in the sync that first needs a wider level.

  Which level runs changes only how many slots the device programs take, never a payload's
  bytes nor the result. A compilation in the background that fails, or that does not match
  the call after all, costs the call its own compilation, as before, nothing else.

  A *family* (a hashable key) is a chunk's programs placed one way; a *config*, what else they
  are compiled for (a receiver's coding, donation): a level serves once it is compiled for
  every config the family ran with.

  >>> levels = SlotLevels()
  >>> levels.choose('family', needed=3)  # a first call: level 0, compiled by the call
  0
  >>> levels.ran('family', 0)
  >>> compiled = threading.Event()  # stands for a compilation that takes a while
  >>> levels.request('family', 3, compiled.wait)  # level 3, compiled in the background
  >>> levels.choose('family', needed=3)  # meanwhile
  0
  >>> compiled.set()
  >>> levels.wait(), levels.choose('family', needed=3), levels.choose('family', needed=1)
  (True, 3, 0)
  """

  def __init__(self, ahead: bool = True):
    self.ahead = ahead
    self._families: dict[Any, _Family] = {}
    self._jobs: collections.deque = collections.deque()
    self._unfinished = 0
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()
    self._idle = threading.Condition(self._lock)

  def compiles_ahead(self) -> bool:
    """Whether levels compile ahead, in the background: in a job of one process, unless
    :attr:`ahead` is turned off."""
    return self.ahead and jax.process_count() == 1

  def choose(self, family: Any, needed: int, base: int = 0) -> int:
    """The level a call of ``family`` runs at when its changes need level ``needed``:
    ``needed`` if compiled, else the highest compiled level below it; at a family's first
    call, ``base`` (the widest it may need: level 0, the capacity, unless widened), or
    ``needed`` if wider still."""
    if jax.process_count() > 1:
      return needed
    with self._lock:
      known = self._families.get(family)
      if known is None or not known.ready:
        return min(base, needed)
    return max((level for level in self.ready(family) if level <= needed), default=needed)

  def ready(self, family: Any) -> set[int]:
    """The levels of ``family`` compiled for every config it ran with."""
    with self._lock:
      known = self._families.get(family)
      return set.intersection(*known.ready.values()) if known and known.ready else set()

  def ran(self, family: Any, level: int, config: Any = None) -> None:
    """Records that a call of ``family`` ran (so compiled) ``level`` for ``config``."""
    if jax.process_count() > 1:
      return
    with self._lock:
      known = self._families.setdefault(family, _Family())
      known.ready.setdefault(config, set()).add(level)

  def wanted(self, family: Any, level: int, config: Any = None) -> bool:
    """Whether ``level`` of ``family`` for ``config`` is neither compiled nor compiling (never
    where nothing compiles ahead)."""
    if not self.compiles_ahead():
      return False
    with self._lock:
      known = self._families.get(family)
      return known is None or (level not in known.ready.get(config, ())
                               and level not in known.pending.get(config, ()))

  def request(self, family: Any, level: int, job: Callable[[], None],
              config: Any = None, base: int | None = 0) -> None:
    """Compiles ``level`` of ``family`` for ``config`` in the background with ``job()``, unless
    it is compiled or compiling. The fallback level ``base`` (the capacity, 0, unless the
    family's slots are widened) of a config that ran at other levels only (its first call came
    when the family had those compiled for other configs) is compiled now, in this thread: the
    next call may need it at once, before the background thread came to it. ``base=None``: no
    level is urgent (the family's calls never fall back)."""
    if not self.wanted(family, level, config):
      return
    context = (jax.config.jax_default_device, jax.config.jax_enable_x64)  # this thread's
    with self._lock:
      known = self._families.setdefault(family, _Family())
      pending = known.pending.setdefault(config, set())
      if level in pending:
        return
      pending.add(level)
      self._unfinished += 1
      now = level == base and bool(known.ready.get(config))
      if not now:
        self._jobs.append((family, config, level, job, context))
        if self._thread is None or not self._thread.is_alive():  # (not alive: after a fork)
          self._thread = threading.Thread(target=self._run, name="jsparse-slot-levels")
          self._thread.start()
    if now:
      self._compile(family, config, level, job, context)

  def compiling(self, family: Any, level: int) -> bool:
    """Whether ``level`` of ``family`` is compiling in the background, for any config."""
    with self._lock:
      known = self._families.get(family)
      return known is not None and any(level in p for p in known.pending.values())

  def forget(self) -> None:
    """Forgets every compiled level: after ``jax.clear_caches()``, which drops the programs
    themselves (each family's next call runs at its base level again, compiling it, as at its
    first call). The levels requested and not started are dropped (they would compile programs
    nothing knows of); the one compiling is waited for."""
    with self._lock:
      self._drop_queued()
    self.wait()
    with self._lock:
      self._families.clear()

  def wait(self, timeout: float | None = None) -> bool:
    """Waits until every requested level is compiled (or ``timeout`` seconds); whether it is."""
    with self._idle:
      return self._idle.wait_for(lambda: self._unfinished == 0, timeout)

  def cancel(self) -> int:
    """Drops the requested levels not started (the one compiling finishes), which become wanted
    again; how many were dropped. For a process done with the plans it requested them for
    (a test suite between tests): they would compile programs nothing will call."""
    with self._lock:
      dropped = len(self._jobs)
      self._drop_queued()
    return dropped

  def _drop_queued(self) -> None:
    """Drops the requested levels not started (the lock held): none of them is compiled."""
    for family, config, level, _, _ in self._jobs:
      self._families[family].pending[config].discard(level)
    self._unfinished -= len(self._jobs)
    self._jobs.clear()
    self._idle.notify_all()

  def _run(self) -> None:
    """The background thread: compiles the requested levels one at a time; stops when there
    are none left, or when the main thread has ended (the interpreter is exiting)."""
    while True:
      with self._lock:
        if not self._jobs or not threading.main_thread().is_alive():
          self._drop_queued()
          self._thread = None
          return
        job = self._jobs.popleft()
      self._compile(*job)

  def _compile(self, family: Any, config: Any, level: int, job: Callable[[], None],
               context: tuple) -> None:
    """Runs a requested ``job`` and records its level as compiled."""
    default_device, x64 = context
    try:  # in the context of the call (what jit's caches key on), not this thread's
      with no_context_mesh(), jax.default_device(default_device), jax.enable_x64(x64):
        job()
    except Exception as e:  # noqa: BLE001 (the call compiles it then, as it would have)
      logging.getLogger("jsparse").debug("jsparse: slot level %d not compiled ahead: %r",
                                         level, e)
    with self._lock:
      known = self._families[family]
      known.pending[config].discard(level)
      known.ready.setdefault(config, set()).add(level)
      self._unfinished -= 1
      self._idle.notify_all()


SLOT_LEVELS = SlotLevels(ahead=os.environ.get("JSPARSE_COMPILE_AHEAD", "1") != "0")


def compile_ahead(enabled: bool) -> bool:
  """Turns compiling slot levels ahead, in the background, on or off (see :class:`SlotLevels`);
  returns the previous setting. Off, the levels already requested and not started are dropped.

  >>> previous = compile_ahead(False)
  >>> compile_ahead(previous)
  False
  """
  previous, SLOT_LEVELS.ahead = SLOT_LEVELS.ahead, bool(enabled)
  if not enabled:
    SLOT_LEVELS.cancel()
  return previous


def cancel_slot_levels() -> int:
  """Drops the slot levels requested and not started (see :meth:`SlotLevels.cancel`)."""
  return SLOT_LEVELS.cancel()


def wait_for_slot_levels(timeout: float | None = None) -> bool:
  """Waits until the slot levels requested so far are compiled (see :class:`SlotLevels`):
  for benchmarks of the steady state, and tests."""
  return SLOT_LEVELS.wait(timeout)


def like(x: jax.Array, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
  """What a call with ``x`` (or an array like it of ``shape``) compiles for: its shape, dtype
  and sharding (None when uncommitted, which is how ``jit`` sees it)."""
  return jax.ShapeDtypeStruct(x.shape if shape is None else shape, x.dtype,
                              sharding=x.sharding if getattr(x, "committed", True) else None)


def _positions(plan: Plan, layouts: tuple, ranked: tuple[bool, ...], flat: list, keys: tuple,
               counts: jax.Array) -> tuple:
  """The positions of the changes: ``keys`` are ranks (where ``ranked``) or positions; slots
  past ``counts`` get the segment size (skipped). Ranks in a segment this receiver splits into
  blocks are resolved block by block (``block_ranks.py``), never by gathering a leaf."""
  indices = []
  for s, (seg, key) in enumerate(zip(plan.segments, keys)):
    used = jnp.arange(key.shape[0]) < counts[s]
    if ranked[s]:
      key = jnp.where(used, key, 0)
      split = [layouts[i] for i in seg.leaf_ids]
      if any(split):
        key = block_ranks.positions_of_ranks(
            [flat[i] for i in seg.leaf_ids], split,
            [plan.leaves[i].shape for i in seg.leaf_ids], seg.dtype, key)
      else:
        key = ranks_lib.positions_of(_tables(plan, seg, flat), key)
    indices.append(jnp.where(used, key, seg.size))
  return tuple(indices)


def _ulp_decoder(seg: Segment):
  return ulp_codes.decoder(seg.dtype)


def _slot_bits(plan: Plan, seg: Segment, flat: list, positions: jax.Array) -> jax.Array:
  """The bits of a segment's (unsplit) leaves ``flat`` at flat ``positions`` (in range)."""
  if not seg.pooled:
    leaf_id = seg.leaf_ids[0]
    return gather_bits(jnp.asarray(flat[leaf_id]).reshape(-1), positions)
  return segment_bits(plan, seg, flat)[positions]


def _apply(plan: Plan, layouts: tuple, flat: list, indices: tuple, values: tuple,
           leaf_ids: jax.Array):
  """A chunk's leaves with its changes written, and what their digest gains: read from the
  leaves at the changed positions, before and after (leaves split into blocks: their whole
  digest instead, each device digesting its own blocks)."""
  if any(layouts):
    out = apply_flat(plan, layouts, flat, indices, values, decoders=_ulp_decoder)
    return out, bits_digest(out, layouts, leaf_ids)
  safe = [jnp.minimum(idx, seg.size - 1) for seg, idx in zip(plan.segments, indices)]
  old = [_slot_bits(plan, seg, flat, p) for seg, p in zip(plan.segments, safe)]
  # Every read of the old leaves before they are written in place (donated): XLA would copy
  # them first otherwise.
  flat, old = jax.lax.optimization_barrier((flat, old))
  out = apply_flat(plan, layouts, flat, indices, values, decoders=_ulp_decoder)
  gain = jnp.zeros((2,), jnp.uint32)
  for seg, idx, p, was in zip(plan.segments, indices, safe, old):
    within, ids = _slot_leaves(seg, p, leaf_ids)
    gain = gain + change_digest(_slot_bits(plan, seg, out, p), was, within, ids, idx < seg.size)
  return out, gain


positions_program = jax.jit(_positions, static_argnums=(0, 1, 2))
_APPLY_PROGRAMS = {donate: jax.jit(_apply, static_argnums=(0, 1),
                                   donate_argnums=(2,) if donate else ())
                   for donate in (False, True)}
digest_program = jax.jit(bits_digest, static_argnums=1)


def apply_program(donate: bool):
  """The receiver's jitted apply of a chunk: ``(plan, layouts, flat, indices, values (ulp
  codes), leaf_ids) -> (flat, its digest gain, or its digest where ``layouts`` split a leaf)``
  with the first two static; ``flat`` donated if ``donate``."""
  return _APPLY_PROGRAMS[bool(donate)]


def leaves_digest(plan: Plan, flat: list, layouts: tuple) -> jax.Array:
  """The digest of rollout leaves split into blocks as ``layouts`` says, chunk by chunk."""
  return sum_digests([digest_program(c.leaves(flat), tuple(c.leaves(layouts)), c.leaf_id_array)
                      for c in chunks_of(plan)])


def receiver_widest(chunk_plan: Plan) -> int:
  """The widest slot level a receiver compiles a chunk's programs for ahead: the one a sender
  widens its diff to at the default ``max_capacity`` (:class:`DiffWidths`). It holds whatever
  a sender that widens sends next while the level its changes need compiles; a sender that
  widens further costs the receiver a compilation when its changes first need it."""
  return widest_level(chunk_plan, range(len(chunk_plan.segments)), DEFAULT_MAX_CAPACITY)


def widens(chunk_plan: Plan, counts: Sequence[int], dense: Sequence[bool] = ()) -> bool:
  """Whether a sender's diff of a chunk (not of several processes) widens past its capacity
  after a version in which its segments had ``counts`` changes (``dense``: per segment,
  whether it was sent densely in a delta, its changes unknown): some segment came within the
  headroom of its capacity, or over it (:class:`DiffWidths`); a segment split into blocks
  within twice that, as the sender counts its fullest block (:func:`slot_counts`), which a
  receiver does not see. A receiver then compiles the widest level ahead."""
  for seg, n, d in itertools.zip_longest(chunk_plan.segments, counts, dense, fillvalue=False):
    headroom = WIDEN_HEADROOM * (2 if seg.blocks > 1 else 1)
    if seg.capacity < seg.size and (d or math.ceil(int(n) * headroom) > seg.capacity):
      return True
  return False


def receiver_family(chunk: Chunk, flat: Sequence) -> tuple:
  """The key of a receiver chunk's per-change programs in :data:`SLOT_LEVELS`: its structure,
  and the placement of its leaves ``flat`` (the receiver's)."""
  return ("receive", chunk.plan, getattr(flat[chunk.leaf_ids[0]], "sharding", None))


def apply_inputs(plan: Plan, layouts: tuple, flat: list, inputs: ReceiverInputs, *,
                 donate: bool, base: tuple[list, Any] | None = None
                 ) -> tuple[list[jax.Array], jax.Array]:
  """The receiver's device stage, chunk by chunk: (the updated leaves, their digest). A chunk
  whose slots are of a higher level than it had (see :class:`SlotLevels`) has that level
  compiled in the background for the next versions.

  ``base``: (the leaves before this version, their digest ``uint32[2]``), of which ``flat``
  has the leaves of dense records replaced: the digest is then updated from the changes (and
  the chunks of those leaves); without it, or where ``layouts`` split some leaf, each chunk is
  digested whole (the apply of a chunk with a split leaf digests it whole, the apply of
  another returns its gain: see :func:`apply_program`)."""
  chunks = chunks_of(plan)
  applies, requests = [], []
  gains = base is not None and not any(layouts)
  # Chunks with leaves written whole: their gain is the difference of their whole digests.
  rewritten = [any(flat[i] is not base[0][i] for i in c.leaf_ids) if gains else False
               for c in chunks]
  before = [digest_program(c.leaves(base[0]), tuple(c.leaves(layouts)), c.leaf_id_array)
            if r else None for c, r in zip(chunks, rewritten)]
  for k, c in enumerate(chunks):
    chunk_layouts, chunk_flat = tuple(c.leaves(layouts)), c.leaves(flat)
    ranked = c.segments(inputs.ranked)
    indices = keys = c.segments(inputs.keys)
    values, counts = c.segments(inputs.values), inputs.counts[list(c.segment_ids)]
    if inputs.levels:  # this call compiles its level; the one needed, the fallback level 0
      # (a first call of this config may not be at 0) and, when the sender widens its diff
      # after this version, the widest it widens to, in the background
      family = receiver_family(c, flat)
      config = (chunk_layouts, ranked, bool(donate), inputs.staging)
      level, needed, staged = inputs.levels[k]
      if staged:
        SLOT_LEVELS.ran(family, level, config)
      ahead = {needed, 0, level}
      if widens(c.plan, counts, c.segments(inputs.dense) if inputs.dense else ()):
        ahead.add(receiver_widest(c.plan))
      for wanted in sorted(ahead - ({level} if staged else set())):
        if SLOT_LEVELS.wanted(family, wanted, config):
          requests.append((family, wanted, _receiver_job(
              k, c, wanted, chunk_layouts, ranked, donate, chunk_flat, keys,
              values, counts, inputs.compile_staging), config))
    if any(ranked):  # (unused slots hold the segment size already: keys that are positions
      # need no pass)
      indices = positions_program(c.plan, chunk_layouts, ranked, chunk_flat, keys, counts)
    applies.append(((c.plan, chunk_layouts, bool(donate),
                     tuple(getattr(x, "sharding", None) for x in chunk_flat),
                     tuple(x.shape for x in indices)),
                    apply_program(donate), (c.plan, chunk_layouts, chunk_flat, indices, values,
                                            c.leaf_id_array), {}))
  compile_distinct(applies)
  outs = [fn(*args) for _, fn, args, _ in applies]
  for request in requests:  # once this call's programs are compiled: not competing with them
    SLOT_LEVELS.request(*request)
  out = place_leaves(plan, chunks, [o[0] for o in outs], flat)
  if not gains:  # whole: a chunk with a leaf split into blocks was digested by its apply
    return out, sum_digests([o[1] if any(c.leaves(layouts)) else
                             digest_program(c.leaves(out), tuple(c.leaves(layouts)),
                                            c.leaf_id_array) for c, o in zip(chunks, outs)])
  total = np.asarray(base[1], np.uint32) + np.asarray(sum_digests([o[1] for o in outs]))
  for c, o, r, b in zip(chunks, outs, rewritten, before):  # (on the host: no new program)
    if r:  # its gain: the difference of its whole digests, not what its slots gained
      whole = digest_program(c.leaves(out), tuple(c.leaves(layouts)), c.leaf_id_array)
      total += np.asarray(whole) - np.asarray(b) - np.asarray(o[1])
  return out, total


def _receiver_job(k: int, chunk: Chunk, level: int, layouts: tuple, ranked: tuple,
                  donate: bool, flat: list, keys: tuple, values: tuple, counts: np.ndarray,
                  compile_staging: Callable[[int, tuple[int, ...]], None] | None
                  ) -> Callable[[], None]:
  """What compiles the programs of a receiver's chunk ``k`` at ``level``, with the shapes and
  shardings of this call's arrays (taken now: the job holds no array)."""
  slots = level_slots(chunk.plan, range(len(chunk.segment_ids)), level)
  flat = [like(x) for x in flat]
  keys = tuple(like(x, (n,)) for x, n in zip(keys, slots))
  values = tuple(like(x, (n,)) for x, n in zip(values, slots))

  def job() -> None:
    if compile_staging is not None:
      compile_staging(k, slots)
    indices = keys
    if any(ranked):
      compiled = positions_program.lower(chunk.plan, layouts, ranked, flat, keys,
                                         counts).compile()
      indices = tuple(jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding)
                      for n, sharding in zip(slots, compiled.output_shardings))
    apply_program(donate).lower(chunk.plan, layouts, flat, indices, values,
                                chunk.leaf_id_array).compile()
  return job
