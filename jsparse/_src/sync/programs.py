"""The jitted device programs of :class:`~jsparse.Sender` and :class:`~jsparse.Receiver`, and
the host arrays they take.

Every program runs per chunk (``core/chunks.py``: a few segments of one structure), with the
chunk's structural sub-plan (and the receiver's block layouts) static: chunks of the same
structure share one compilation, so compile time follows the distinct leaf shapes, not the leaf
count. The sender's diff program and the digest compile once per chunk structure; the
per-change programs (ranks, positions, the receiver's apply) take slots sized to the payload's
changes and compile at most 4 variants each (:func:`slots_needed`). The chunks' results are
put back in plan order (per leaf, per segment), so everything after the device stages sees the
whole tree.

- Sender: :func:`sender_changes` diffs, takes the next snapshot and digests it (one program),
  then ranks the changes of the ordered segments (a second, on slots sized to the changes).
- Receiver: ``staging.py`` writes a decoded payload's records into those slots on the device;
  :func:`apply_inputs` turns ranks into positions and applies bits or ulp codes (two
  programs: fused into one, XLA:CPU ran them 2x slower), in place when donated, and digests.

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(1000)}, capacity=0.1, bucket_size=1000)
>>> slots_needed(plan, [3]), slots_needed(plan, [60]), slots_needed(plan, [100])
((13,), (100,), (100,))
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core.chunks import (chunks_of, place_leaves, place_segments, sum_digests,
                                      unchunked_leaves)
from jsparse._src.core.delta import Delta, apply_flat, diff_flat_with_old, segment_bits
from jsparse._src.core.digest import bits_digest
from jsparse._src.core.plan import Plan, Segment
from jsparse._src.core.units import local_value
from jsparse._src.wire import block_ranks
from jsparse._src.wire import ranks as ranks_lib
from jsparse._src.wire import ulp_codes
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
  """

  delta: Delta
  old_values: tuple
  ranks: tuple | None
  block_counts: tuple = ()


class ReceiverInputs(NamedTuple):
  """A decoded payload's sparse records in :func:`slots_needed` slots (from ``staging.py``).

  Attributes:
    keys: per segment, positions or ranks (the segment size in unused slots).
    values: per segment, new bits or ulp codes (0 in unused slots).
    counts: ``int32[segments]``: used slots (0 for dense records, written separately).
    ranked: per segment, whether its keys are ranks (static).
    coded: whether the values are ulp codes (format 2) or new bits (static).
  """

  keys: tuple
  values: tuple
  counts: np.ndarray
  ranked: tuple[bool, ...]
  coded: bool


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
  outs = [snapshot_program(c.plan, c.leaves(flat), c.leaf_id_array) for c in chunks]
  return (place_leaves(plan, chunks, [o[0] for o in outs], _cast_unchunked(plan, flat)),
          sum_digests([o[1] for o in outs]))


def _tables(plan: Plan, seg: Segment, flat: list) -> ranks_lib.ClassTables:
  return ranks_lib.class_tables(segment_bits(plan, seg, flat), seg.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def diff_program(plan: Plan, ranked: bool, snapshot: list, new: list, leaf_ids: jax.Array):
  """A chunk's (delta, old bits at its positions, per-block counts, class tables of the ordered
  segments (if ``ranked``; for :func:`sparse_program`), the next snapshot, its digest). The
  snapshot is donated."""
  delta, old_values, block_counts = diff_flat_with_old(plan, snapshot, new)
  tables = tuple(_tables(plan, seg, snapshot) if ranked and seg.ordered else None
                 for seg in plan.segments)
  next_snapshot = cast_flat(plan, new)
  return (delta, old_values, block_counts, tables, next_snapshot,
          bits_digest(next_snapshot, _trainer_layouts(plan), leaf_ids))


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


def sender_changes(plan: Plan, coding: Coding, snapshot: list, new: list, *, ranks: bool = True
                   ) -> tuple[DeviceChanges, list[jax.Array], jax.Array]:
  """The sender's device stage: (its changes, the next snapshot, its digest). ``snapshot`` is
  donated. ``ranks=False`` skips ranking (an anchor needs none)."""
  chunks = chunks_of(plan)
  outs = [diff_program(c.plan, coding.ranked, c.leaves(snapshot), c.leaves(new), c.leaf_id_array)
          for c in chunks]
  deltas = [o[0] for o in outs]
  delta = Delta(place_segments(plan, chunks, [d.indices for d in deltas]),
                place_segments(plan, chunks, [d.values for d in deltas]),
                _segment_array(plan, [d.counts for d in deltas], jnp.zeros((0,), jnp.int32)),
                _segment_array(plan, [d.overflow for d in deltas], jnp.zeros((0,), bool)))
  old_values, block_counts, tables = (place_segments(plan, chunks, [o[k] for o in outs])
                                      for k in (1, 2, 3))
  next_snapshot = place_leaves(plan, chunks, [o[4] for o in outs], _cast_unchunked(plan, new))
  digest = sum_digests([o[5] for o in outs])
  ranks_out = None
  if ranks:  # a delta: its changes (and ranks) need only as many slots as this step's changes
    slots = slots_needed(plan, local_value(delta.counts))
    trimmed = [sparse_program(c.plan, c.segments(slots), c.segments(tables),
                              c.segments(delta.indices), c.segments(delta.values),
                              c.segments(old_values)) for c in chunks]
    indices, values, old_values, ranks_out = (
        place_segments(plan, chunks, [[seg[k] for seg in out] for out in trimmed])
        for k in range(4))
    delta = delta._replace(indices=indices, values=values)
    ranks_out = ranks_out if coding.ranked else None
  return DeviceChanges(delta, old_values, ranks_out, block_counts), next_snapshot, digest


def slots_needed(plan: Plan, counts) -> tuple[int, ...]:
  """Per segment, how many slots a payload with ``counts`` changes is padded to: the capacity
  halved up to 3 times while every segment of its chunk still fits. A chunk's compiled shapes
  stay few (4 variants), and the per-change work of a sparse payload follows each chunk's
  density rather than its capacity: a pool of small leaves (all its elements as capacity)
  is not padded to its capacity because the matrices of another chunk need theirs."""
  slots = [seg.capacity for seg in plan.segments]
  for chunk in chunks_of(plan):
    for halvings in (3, 2, 1):
      halved = {s: -(-plan.segments[s].capacity // 2**halvings) for s in chunk.segment_ids}
      if all(int(counts[s]) <= n for s, n in halved.items()):
        for s, n in halved.items():
          slots[s] = n
        break
  return tuple(slots)


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


def _apply(plan: Plan, layouts: tuple, coded: bool, flat: list, indices: tuple, values: tuple,
           leaf_ids: jax.Array):
  out = apply_flat(plan, layouts, flat, indices, values,
                   decoders=_ulp_decoder if coded else None)
  return out, bits_digest(out, layouts, leaf_ids)


positions_program = jax.jit(_positions, static_argnums=(0, 1, 2))
_APPLY_PROGRAMS = {donate: jax.jit(_apply, static_argnums=(0, 1, 2),
                                   donate_argnums=(3,) if donate else ())
                   for donate in (False, True)}
digest_program = jax.jit(bits_digest, static_argnums=1)


def apply_program(donate: bool):
  """The receiver's jitted apply of a chunk: ``(plan, layouts, coded, flat, indices, values,
  leaf_ids) -> (flat, digest)`` with the first three static; ``flat`` donated if ``donate``."""
  return _APPLY_PROGRAMS[bool(donate)]


def leaves_digest(plan: Plan, flat: list, layouts: tuple) -> jax.Array:
  """The digest of rollout leaves split into blocks as ``layouts`` says, chunk by chunk."""
  return sum_digests([digest_program(c.leaves(flat), tuple(c.leaves(layouts)), c.leaf_id_array)
                      for c in chunks_of(plan)])


def apply_inputs(plan: Plan, layouts: tuple, flat: list, inputs: ReceiverInputs, *,
                 donate: bool) -> tuple[list[jax.Array], jax.Array]:
  """The receiver's device stage, chunk by chunk: (the updated leaves, their digest)."""
  chunks = chunks_of(plan)
  outs = []
  for c in chunks:
    chunk_layouts, chunk_flat = tuple(c.leaves(layouts)), c.leaves(flat)
    indices = keys = c.segments(inputs.keys)
    if inputs.coded:
      indices = positions_program(c.plan, chunk_layouts, c.segments(inputs.ranked), chunk_flat,
                                  keys, inputs.counts[list(c.segment_ids)])
    outs.append(apply_program(donate)(c.plan, chunk_layouts, inputs.coded, chunk_flat, indices,
                                      c.segments(inputs.values), c.leaf_id_array))
  return (place_leaves(plan, chunks, [o[0] for o in outs], flat),
          sum_digests([o[1] for o in outs]))
