"""Units: the pieces a multi-process sync is cut into, who sends each and who needs each.

A *unit* is one segment of the plan, or, for a leaf the trainer splits into blocks, some of its
blocks. Every unit has its own index space (its blocks laid end to end, each row-major), so its
record is coded like a segment of that size (``parts.py``). In a multi-controller trainer each
process sends the units it owns: the blocks whose first holder (in mesh order) is one of its
devices, and the whole segments that it holds entirely, balanced by size among the processes
that do; replicated leaves are thus sent once. A rollout process needs a unit when one of its
devices holds part of it.

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
>>> unit = Unit(0)
>>> unit_slot(plan, unit).size, to_segment_positions(plan, unit, np.array([3])).tolist()
(8, [3])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from jsparse._src.core.layout import Layout
from jsparse._src.core.plan import Plan, Segment
from jsparse._src.errors import PlanMismatchError

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop)


@dataclasses.dataclass(frozen=True)
class Unit:
  """A segment, or the listed trainer ``blocks`` of a segment whose leaf the trainer splits."""

  segment: int
  blocks: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class UnitSlots:
  """One unit seen as a one-segment plan: what the body codecs and record checks take."""

  segments: tuple[Segment, ...]
  name: str

  def describe_segment(self, s: int) -> str:
    return self.name


def _split_leaf(plan: Plan, seg: Segment):
  leaf = plan.leaves[seg.leaf_ids[0]]
  return leaf, leaf.layout


def block_size(plan: Plan, segment: int) -> int:
  seg = plan.segments[segment]
  return seg.size // seg.blocks


def unit_slot(plan: Plan, unit: Unit) -> Segment:
  """The unit as a segment of its own index space: size, capacity, dtype, rank order."""
  seg = plan.segments[unit.segment]
  if seg.blocks == 1:
    return seg
  per_block = seg.capacity // seg.blocks
  return Segment((), (), block_size(plan, unit.segment) * len(unit.blocks),
                 per_block * len(unit.blocks), seg.dtype)


def unit_slots(plan: Plan, unit: Unit) -> UnitSlots:
  where = plan.describe_segment(unit.segment)
  if plan.segments[unit.segment].blocks > 1:
    where += f" blocks {list(unit.blocks)}"
  return UnitSlots((unit_slot(plan, unit),), where)


def block_box(layout: Layout, shape: tuple[int, ...], block: int) -> Box:
  """The region of ``shape`` that block ``block`` (row-major over the layout's parts) covers."""
  sizes = layout.block_shape(shape)
  index = np.unravel_index(block, layout.parts)
  return tuple((int(i) * n, (int(i) + 1) * n) for i, n in zip(index, sizes))


Geometry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def split_geometry(plan: Plan, unit: Unit) -> Geometry | None:
  """``(leaf shape, block shape, blocks per axis)`` of a unit of a leaf split into blocks, or
  None for a unit of a whole segment (whose positions are the segment's)."""
  seg = plan.segments[unit.segment]
  if seg.blocks == 1:
    return None
  leaf, layout = _split_leaf(plan, seg)
  return tuple(leaf.shape), tuple(layout.block_shape(leaf.shape)), tuple(layout.parts)


# The position arithmetic below takes NumPy or (under jit: no sort, no 64-bit) jax.numpy arrays.

def _coords(x, shape: Sequence[int]) -> list:
  """Row-major coordinates in ``shape`` of flat indices ``x`` (in range)."""
  coords = []
  for n in shape[:0:-1]:
    x, c = divmod(x, n)
    coords.append(c)
  return [x % shape[0]] + coords[::-1]


def _flat(coords: Sequence, shape: Sequence[int]):
  """Inverse of :func:`_coords`."""
  flat = 0
  for c, n in zip(coords, shape):
    flat = flat * n + c
  return flat


def block_coords(positions, leaf_shape: Sequence[int], block_shape: Sequence[int]
                 ) -> tuple[list, object]:
  """Leaf positions as (their block's coordinates, per axis; their position inside it)."""
  split = [divmod(c, n) for c, n in zip(_coords(positions, leaf_shape), block_shape)]
  return [b for b, _ in split], _flat([i for _, i in split], block_shape)


def leaf_positions(blocks, inner, leaf_shape: Sequence[int], block_shape: Sequence[int],
                   parts: Sequence[int]):
  """Leaf positions of positions ``inner`` inside ``blocks`` (row-major over ``parts``)."""
  return _flat([b * n + i for b, i, n in zip(_coords(blocks, parts), _coords(inner, block_shape),
                                             block_shape)], leaf_shape)


def to_unit_positions(plan: Plan, unit: Unit, positions: np.ndarray) -> np.ndarray:
  """Segment positions (inside the unit's blocks) as positions in the unit's index space."""
  positions = np.asarray(positions, np.int64)
  if (geometry := split_geometry(plan, unit)) is None:
    return positions
  leaf_shape, block_shape, parts = geometry
  coords, inner = block_coords(positions, leaf_shape, block_shape)
  slot_of = np.full(math.prod(parts), -1, np.int64)
  slot_of[list(unit.blocks)] = np.arange(len(unit.blocks))
  return slot_of[_flat(coords, parts)] * math.prod(block_shape) + inner


def to_segment_positions(plan: Plan, unit: Unit, positions: np.ndarray) -> np.ndarray:
  """Inverse of :func:`to_unit_positions`."""
  positions = np.asarray(positions, np.int64)
  if (geometry := split_geometry(plan, unit)) is None:
    return positions
  block, inner = divmod(positions, math.prod(geometry[1]))
  return leaf_positions(np.asarray(unit.blocks, np.int64)[block], inner, *geometry)


def _box_of(index: tuple, shape: tuple[int, ...]) -> Box:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape)) if shape else ()


def _block_of(layout: Layout, shape: tuple[int, ...], index: tuple) -> int:
  starts = [lo // n for (lo, _), n in zip(_box_of(index, shape), layout.block_shape(shape))]
  return int(np.ravel_multi_index(starts, layout.parts))


def block_owners(layout: Layout, shape: tuple[int, ...]) -> list:
  """Per block, the device that sends it: its first holder in the mesh's device order."""
  index_map = NamedSharding(layout.mesh, layout.spec).devices_indices_map(shape)
  owners: dict[int, object] = {}
  for device in layout.mesh.devices.flat:
    owners.setdefault(_block_of(layout, shape, index_map[device]), device)
  return [owners[b] for b in range(layout.blocks)]


def _whole_holders(x: jax.Array) -> set[int]:
  """The processes that hold all of ``x`` on one of their devices."""
  devices = x.sharding.device_set
  if x.is_fully_replicated or len(devices) == 1:
    return {d.process_index for d in devices}
  return set()


def owned_units(plan: Plan, flat: Sequence[jax.Array], process: int) -> tuple[Unit, ...]:
  """The units trainer process ``process`` sends, for trainer leaves ``flat`` (laid out as the
  plan says; every process computes the same assignment).

  Raises:
    PlanMismatchError: naming a leaf that no process holds whole nor in the plan's blocks
      (split unevenly across devices).
  """
  load: dict[int, int] = {}
  units = []
  for s, seg in enumerate(plan.segments):
    if seg.blocks > 1:
      leaf, layout = _split_leaf(plan, seg)
      mine = tuple(b for b, d in enumerate(block_owners(layout, leaf.shape))
                   if d.process_index == process)
      if mine:
        units.append(Unit(s, mine))
      continue
    holders = set.intersection(*[_whole_holders(flat[i]) for i in seg.leaf_ids])
    if not holders:
      paths = [plan.leaves[i].path for i in seg.leaf_ids if not _whole_holders(flat[i])]
      raise PlanMismatchError(
          f"leaf {paths[0]} is split across devices but not into the plan's even blocks: no "
          "process holds it whole; shard it evenly (or replicate it) before planning")
    owner = min(sorted(holders), key=lambda p: load.get(p, 0))
    load[owner] = load.get(owner, 0) + seg.size
    if owner == process:
      units.append(Unit(s))
  return tuple(units)


def process_boxes(flat: Sequence[jax.Array]) -> list[list[Box]]:
  """Per leaf, the regions this process's devices hold."""
  return [[_box_of(index, x.shape) for index in
           x.sharding.addressable_devices_indices_map(x.shape).values()] for x in flat]


def _intersects(a: Box, b: Box) -> bool:
  return all(lo < hi2 and lo2 < hi for (lo, hi), (lo2, hi2) in zip(a, b))


def needs_unit(plan: Plan, unit: Unit, boxes: Sequence[Sequence[Box]]) -> bool:
  """Whether a process holding ``boxes`` (from :func:`process_boxes`) needs ``unit``."""
  seg = plan.segments[unit.segment]
  if seg.blocks == 1:
    return any(boxes[i] for i in seg.leaf_ids)
  leaf, layout = _split_leaf(plan, seg)
  return any(_intersects(block_box(layout, leaf.shape, b), box)
             for b in unit.blocks for box in boxes[seg.leaf_ids[0]])


def owned_block_data(layout: Layout, x: jax.Array, blocks: Sequence[int]) -> np.ndarray:
  """The listed blocks of ``x`` (held by this process), each flattened, laid end to end."""
  found = {}
  for shard in x.addressable_shards:
    found.setdefault(_block_of(layout, x.shape, shard.index), shard)
  return np.concatenate([np.asarray(found[b].data).reshape(-1) for b in blocks])


def block_slots(x: jax.Array, capacity: int, blocks: Sequence[int]) -> list[jax.Array]:
  """The slots of each listed block (held by this process) of a per-block diff output ``x``
  (``[blocks * capacity]``), as the device arrays that hold them."""
  found = {}
  for shard in x.addressable_shards:
    start = _box_of(shard.index, x.shape)[0][0]
    found.setdefault(start // capacity, shard)
  return [found[b].data for b in blocks]


def owned_slots(x: jax.Array, capacity: int, blocks: Sequence[int]) -> np.ndarray:
  """The listed blocks' slots (:func:`block_slots`) on the host, laid end to end."""
  return np.concatenate([np.asarray(d).reshape(-1) for d in block_slots(x, capacity, blocks)])


def unit_counts(plan: Plan, units: Sequence[Unit], counts: jax.Array, overflow: jax.Array,
                block_counts: Sequence, slots: Sequence[int] | None = None
                ) -> list[np.ndarray | None]:
  """Per unit of ``units`` (owned by this process), a diff's changes in it per block (one entry
  for a whole segment), or None where they overflow its slots (the unit goes dense).
  ``counts``, ``overflow``: the diff's per-segment outputs; ``block_counts``: per segment, the
  per-block counts of a split leaf; ``slots``: per segment, the diff's slots (a widened
  diff's; default: the capacity), which a split leaf shares equally among its blocks."""
  counts, overflow = local_value(counts), local_value(overflow)
  found = []
  for unit in units:
    s, seg = unit.segment, plan.segments[unit.segment]
    if seg.blocks == 1:
      found.append(None if overflow[s] else counts[s:s + 1])
      continue
    per_block = owned_slots(block_counts[s], 1, unit.blocks)
    limit = (seg.capacity if slots is None else slots[s]) // seg.blocks
    found.append(None if np.any(per_block > limit) else per_block)
  return found


def local_value(x: jax.Array) -> np.ndarray:
  """A replicated (or process-local) array's value on this host, never gathered."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_shards[0].data)
  raise PlanMismatchError(f"an array of shape {x.shape} is split across processes where jsparse "
                          "expected it replicated")


def write_regions(x_host: np.ndarray, box: Box, region: Box, values: np.ndarray) -> None:
  """Writes ``values`` (covering ``region`` of the leaf) into ``x_host`` (covering ``box``)
  where they overlap."""
  lo = [max(a, c) for (a, _), (c, _) in zip(box, region)]
  hi = [min(b, d) for (_, b), (_, d) in zip(box, region)]
  if any(l >= h for l, h in zip(lo, hi)):
    return
  dst = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box))
  src = tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, region))
  x_host[dst] = values[src]
