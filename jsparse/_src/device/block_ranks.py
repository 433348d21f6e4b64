"""Positions of ranks in a segment whose leaves the receiver splits into blocks.

A rank names an element by its place in the (exponent class, position) order of the whole
segment (``ranks.py``), but a rollout device holds only its own block of a split leaf. Instead
of gathering the leaf, every query runs a binary search over positions: "how many class-``c``
elements lie before position ``p``" is a sum of per-block counts, each computed by the device
that holds the block from its own class tables (a popcount over ≤ 8 words) and added up with one
``psum`` of the queries' counts. Whole (unsplit) leaves of the segment answer the same question
from their own tables. 32 rounds find every position exactly; per device the memory is the
block's tables (0.875 bytes per element: five bit planes and per-class prefix counts) plus a few
arrays of the queries' size, and the traffic per round is one all-reduce of 4 bytes per query:
no device sees another's block.

This works for any rollout layout, so one payload stream serves rollouts with different meshes.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> from jsparse._src.core.layout import Layout
>>> from jsparse._src.device import ranks
>>> bits = jnp.array(np.random.default_rng(0).integers(0x3000, 0x3F80, 64), jnp.uint16)
>>> mesh = jax.make_mesh((jax.device_count(),), ("x",))
>>> split = jax.device_put(bits.reshape(8, 8), NamedSharding(mesh, P("x")))
>>> layout = Layout.of(split.sharding, (8, 8))
>>> every = jnp.arange(64)
>>> r = ranks.ranks_of(ranks.class_tables(bits, jnp.bfloat16), every,
...                    ranks.exponent_class(bits, jnp.bfloat16, jnp))
>>> found = positions_of_ranks([split], [layout], [(8, 8)], jnp.bfloat16, r)
>>> bool((found == every).all())
True
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.blocks import unravel
from jsparse._src.core.layout import Layout
from jsparse._src.core.select import sorted_search
from jsparse._src.device import ranks as ranks_lib
from jsparse._src.device.ulp_codes import NUM_CLASSES

_ROUNDS = 32  # positions are int32


def _class_starts(tables: ranks_lib.ClassTables, size: int) -> jax.Array:
  """``int32[17]``: the rank of the first element of each class, then the size."""
  starts = tables.first_rank[::tables.planes.shape[0]]
  return jnp.concatenate([starts, jnp.full((1,), size, starts.dtype)])


def _count_below(tables: ranks_lib.ClassTables, starts: jax.Array, size: int,
                 limits: jax.Array, classes: jax.Array) -> jax.Array:
  """Per query, the class-``classes`` elements at positions ``< limits`` (0..size)."""
  inside = jnp.minimum(limits, size - 1)
  before = ranks_lib.ranks_of(tables, inside, classes) - starts[classes]
  total = starts[classes + 1] - starts[classes]
  return jnp.where(limits >= size, total, before).astype(jnp.int32)


def _block_prefix(layout: Layout, shape: tuple[int, ...], limits: jax.Array) -> jax.Array:
  """Inside ``shard_map``: per query, how many elements of this device's block have a global
  flat position ``< limits`` (0..size). Row-major order restricted to a block is the block's
  own row-major order, so that is a prefix of the block: the block elements before the
  multi-index of ``limits``, counted dimension by dimension while the index is inside."""
  size = math.prod(shape)
  block = layout.block_shape(shape)
  multi = unravel(jnp.minimum(limits, size - 1), shape)
  count = jnp.zeros(limits.shape, jnp.int32)
  inside = jnp.ones(limits.shape, bool)
  for d, (g, s, b) in enumerate(zip(multi, layout.block_start(shape), block)):
    stride = math.prod(block[d + 1:])
    count += jnp.where(inside, jnp.clip(g - s, 0, b) * stride, 0)
    inside &= (g >= s) & (g < s + b)
  return jnp.where(limits >= size, math.prod(block), count)


class _WholeLeaf:
  """A leaf the receiver holds whole: counts from its own tables."""

  def __init__(self, bits: jax.Array, dtype: np.dtype):
    self.size = bits.shape[0]
    self.tables = ranks_lib.class_tables(bits, dtype)
    self.starts = _class_starts(self.tables, self.size)

  def totals(self) -> jax.Array:
    return self.starts[1:] - self.starts[:-1]

  def count_below(self, limits: jax.Array, classes: jax.Array) -> jax.Array:
    return _count_below(self.tables, self.starts, self.size, limits, classes)


class _SplitLeaf:
  """A leaf split into blocks: each device counts in its block, one psum adds them up."""

  def __init__(self, leaf: jax.Array, layout: Layout, shape: tuple[int, ...], dtype: np.dtype):
    self.layout, self.shape, self.size = layout, shape, math.prod(shape)
    stacked = PartitionSpec(layout.split_axes)
    block_size = math.prod(layout.block_shape(shape))

    def tables(block):
      t = ranks_lib.class_tables(bits_lib.to_bits(block).reshape(-1), dtype)
      starts = _class_starts(t, block_size)
      return t.planes, t.first_rank, starts
    # Per-device tables, stacked along dimension 0 in block order (never gathered).
    self.planes, self.first_rank, self.starts = layout.shard_map(
        tables, (layout.spec,), (stacked,) * 3)(leaf)

  def totals(self) -> jax.Array:
    def local(starts):
      return lax.psum(starts[1:] - starts[:-1], self.layout.split_axes)
    return self.layout.shard_map(local, (PartitionSpec(self.layout.split_axes),),
                                 PartitionSpec())(self.starts)

  def count_below(self, limits: jax.Array, classes: jax.Array) -> jax.Array:
    block_size = math.prod(self.layout.block_shape(self.shape))

    def local(planes, first_rank, starts, limits, classes):
      tables = ranks_lib.ClassTables(planes, first_rank)
      mine = _block_prefix(self.layout, self.shape, limits)
      count = _count_below(tables, starts, block_size, mine, classes)
      return lax.psum(count, self.layout.split_axes)

    stacked = PartitionSpec(self.layout.split_axes)
    return self.layout.shard_map(local, (stacked,) * 3 + (PartitionSpec(),) * 2,
                                 PartitionSpec())(self.planes, self.first_rank, self.starts,
                                                  limits, classes)


def positions_of_ranks(leaves: Sequence[jax.Array], layouts: Sequence[Layout | None],
                       shapes: Sequence[tuple[int, ...]], dtype: np.dtype,
                       ranks: jax.Array) -> jax.Array:
  """The segment positions of ``ranks`` (each in ``[0, size)``) in the exponent-class order of
  the segment made of ``leaves`` laid end to end (old bits of ``dtype``), each leaf whole
  (layout None) or split into blocks as its layout says."""
  parts, offsets, at = [], [], 0
  for leaf, layout, shape in zip(leaves, layouts, shapes):
    if layout is None:
      parts.append(_WholeLeaf(bits_lib.to_bits(leaf).reshape(-1), dtype))
    else:
      parts.append(_SplitLeaf(leaf, layout, tuple(shape), dtype))
    offsets.append(at)
    at += math.prod(shape)
  size = at
  totals = sum(part.totals() for part in parts)
  class_start = jnp.cumsum(totals) - totals
  classes = (sorted_search(class_start, ranks, "right") - 1).astype(jnp.int32)
  classes = jnp.clip(classes, 0, NUM_CLASSES - 1)
  wanted = ranks - class_start[classes]  # the wanted-th class-c element, in position order

  def count_below(limits):
    return sum(part.count_below(jnp.clip(limits - off, 0, part.size), classes)
               for part, off in zip(parts, offsets))

  def round_(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) // 2
    right = count_below(mid + 1) <= wanted
    return jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)

  zeros = jnp.zeros(ranks.shape, jnp.int32)
  lo, _ = lax.fori_loop(0, _ROUNDS, round_, (zeros, zeros + size))
  return lo
