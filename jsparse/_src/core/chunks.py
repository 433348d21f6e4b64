"""Chunks: the plan's segments grouped into small, repeated jitted programs.

One jitted program over every segment of a large tree compiles in time that grows faster than
the number of leaves (XLA:CPU here, ranked diff: 100 leaves 19 s, 400 leaves 107 s), while the
per-change work of each segment stays small. The sync programs therefore run *per chunk*: a few
segments of the same structure (shapes, dtypes, capacities, layouts). A chunk's program takes a
structural sub-plan that names no paths, so every chunk of the same structure -- the same
matrix in each transformer layer, each expert of an MoE layer -- reuses one compiled program:
compile time follows the number of distinct leaf shapes, not the number of leaves.

A chunk is also what a stage can hand on as soon as it is done: the device runs chunk ``k + 1``
while the host copies and codes chunk ``k``.

>>> import jax.numpy as jnp, jsparse
>>> params = {f'layer{i}': {'w': jnp.zeros((256, 256)), 'b': jnp.zeros(256)} for i in range(9)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> chunks = chunks_of(plan)
>>> [c.segment_ids for c in chunks]  # the matrices by four; the last one mixed with the biases
[(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
>>> [leaf.path for leaf in chunks[1].plan.leaves]  # no paths: the two chunks share one program
['[0]', '[1]', '[2]', '[3]']
>>> chunks[0].plan == chunks[1].plan
True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core.plan import LeafSpec, Plan, Segment

# Per chunk: bigger chunks compile superlinearly, smaller ones dispatch more. A pool's leaves
# are each an input and an output of its programs: a pool of many leaves is a chunk alone.
MAX_SEGMENTS = 4
MAX_LEAVES = 32
# Segments whose structure occurs once share no compilation: they run together in mixed chunks
# of up to this many, so a tree of unlike leaves compiles a few programs, not one per leaf.
MAX_MIXED_SEGMENTS = 8


@dataclasses.dataclass(frozen=True)
class Chunk:
  """A few segments of one structure, run as one program.

  Attributes:
    segment_ids: the plan's segments in this chunk.
    leaf_ids: their leaves, in the order of the sub-plan's leaves.
    plan: the structural sub-plan (leaves named ``[0]``, ``[1]``, ...; segments re-indexed):
      equal for chunks of the same structure, so jit reuses their compiled programs.
  """

  segment_ids: tuple[int, ...]
  leaf_ids: tuple[int, ...]
  plan: Plan

  @functools.cached_property
  def leaf_id_array(self) -> np.ndarray:
    """``uint32[leaves]``: the global leaf ids (a traced argument: digests mix them in)."""
    return np.asarray(self.leaf_ids, np.uint32)

  def leaves(self, flat: Sequence[Any]) -> list:
    """This chunk's entries of a per-leaf list."""
    return [flat[i] for i in self.leaf_ids]

  def segments(self, per_segment: Sequence[Any]) -> tuple:
    """This chunk's entries of a per-segment sequence."""
    return tuple(per_segment[s] for s in self.segment_ids)


def _structure(plan: Plan, seg: Segment) -> tuple:
  """What a segment's programs depend on: everything but the leaves' paths and ids."""
  leaves = tuple(dataclasses.replace(plan.leaves[i], path="") for i in seg.leaf_ids)
  return (leaves, seg.offsets, seg.size, seg.capacity, seg.dtype, seg.blocks, seg.ordered)


def sub_plan(plan: Plan, segment_ids: Sequence[int]) -> Plan:
  leaves: list[LeafSpec] = []
  segments = []
  for s in segment_ids:
    seg = plan.segments[s]
    local = tuple(range(len(leaves), len(leaves) + len(seg.leaf_ids)))
    leaves += [dataclasses.replace(plan.leaves[i], path=f"[{len(leaves) + j}]")
               for j, i in enumerate(seg.leaf_ids)]
    segments.append(dataclasses.replace(seg, leaf_ids=local))
  treedef = jax.tree.structure([0] * len(leaves))
  return Plan(treedef, tuple(leaves), tuple(segments), plan.bucket_size)


@functools.lru_cache(maxsize=64)
def chunks_of(plan: Plan) -> tuple[Chunk, ...]:
  """The plan's segments as chunks: segments of one structure, taken in plan order, by up to
  :data:`MAX_SEGMENTS` (and :data:`MAX_LEAVES` leaves, at least one segment) in chunks of one
  size; segments of a structure that occurs once, and those left over from a run of full
  chunks, in plan order, by up to :data:`MAX_MIXED_SEGMENTS` (and :data:`MAX_LEAVES` leaves);
  chunks ordered by their first segment."""
  by_structure: dict[tuple, list[int]] = {}
  for s, seg in enumerate(plan.segments):
    by_structure.setdefault(_structure(plan, seg), []).append(s)
  runs, alone, mixed, leaves = [], [], [[]], 0
  for ids in by_structure.values():
    per_chunk = max(1, min(MAX_SEGMENTS, MAX_LEAVES // len(plan.segments[ids[0]].leaf_ids)))
    if len(ids) == 1:
      shared = 0
    elif len(ids) <= per_chunk:
      shared = len(ids)
    else:  # a short last chunk would be a structure of its own: its segments go mixed instead
      shared = len(ids) - len(ids) % per_chunk
    runs += [ids[i:i + per_chunk] for i in range(0, shared, per_chunk)]
    alone += ids[shared:]
  for s in sorted(alone):
    n = len(plan.segments[s].leaf_ids)
    if mixed[-1] and (len(mixed[-1]) == MAX_MIXED_SEGMENTS or leaves + n > MAX_LEAVES):
      mixed.append([])
      leaves = 0
    mixed[-1].append(s)
    leaves += n
  runs += [run for run in mixed if run]
  return tuple(Chunk(tuple(ids), tuple(i for s in ids for i in plan.segments[s].leaf_ids),
                     sub_plan(plan, ids))
               for ids in sorted(runs))


@functools.lru_cache(maxsize=64)
def unchunked_leaves(plan: Plan) -> tuple[int, ...]:
  """Leaves in no chunk (zero-size leaves belong to no segment)."""
  chunked = {i for seg in plan.segments for i in seg.leaf_ids}
  return tuple(i for i in range(len(plan.leaves)) if i not in chunked)


def place_leaves(plan: Plan, chunks: Sequence[Chunk], outputs: Sequence[Sequence[Any]],
                 rest: Sequence[Any]) -> list:
  """The per-leaf list from each chunk's per-leaf ``outputs``; leaves in no chunk from ``rest``
  (a per-leaf list)."""
  flat = list(rest)
  for chunk, out in zip(chunks, outputs):
    for i, x in zip(chunk.leaf_ids, out):
      flat[i] = x
  return flat


def place_segments(plan: Plan, chunks: Sequence[Chunk], outputs: Sequence[Sequence[Any]]
                   ) -> tuple:
  """The per-segment tuple from each chunk's per-segment ``outputs``."""
  per_segment: list[Any] = [None] * len(plan.segments)
  for chunk, out in zip(chunks, outputs):
    for s, x in zip(chunk.segment_ids, out):
      per_segment[s] = x
  return tuple(per_segment)


@jax.jit
def _sum_digests(digests: list[jax.Array]) -> jax.Array:
  return functools.reduce(jnp.add, digests, jnp.zeros((2,), jnp.uint32))


def sum_digests(digests: Sequence[jax.Array]) -> jax.Array:
  """The digest of a tree from its chunks' digests (each a sum mod 2**32)."""
  return _sum_digests(list(digests))
