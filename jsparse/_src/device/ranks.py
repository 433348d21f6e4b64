"""Ranks in the exponent-class order of a segment: ranks of positions, and positions of ranks.

Sort the elements of a flat segment by (exponent class of the old value, position): an element's
*rank* is its index in that order. Both sides of a sync hold the old bits, so both can compute
the order, and a payload can name changed elements by rank. Changes are far more likely in some
classes than in others, so ranks of changes bunch up: their gaps cost ~5.4 bits instead of ~8.2.

Nothing is sorted. One streaming pass packs each class bit of every element into four uint32
bit planes (plus a plane marking real elements) and counts the elements of each class in each
superblock of 256 elements; an exclusive prefix sum over the (class, superblock) counts, class
major, gives the rank of the first class-c element of every superblock. A rank is then that
prefix plus a popcount over at most 8 words of the element's superblock; a position is found by
binary search in the prefix table and a popcount rank search in one word. The work is one pass
over the old bits plus O(log n) per queried element, with tables of 0.875 bytes per element
(five bit planes, 0.625 B, and per-class prefix counts per 256 elements, 0.25 B).

>>> import jax.numpy as jnp
>>> bits = jnp.array([0x3F80, 0x3400, 0x3F80, 0x3400], jnp.uint16)   # bf16: 1.0, ~1e-7, ...
>>> tables = class_tables(bits, jnp.bfloat16)
>>> ranks = ranks_of(tables, jnp.array([0, 1, 2, 3]), exponent_class(bits, jnp.bfloat16, jnp))
>>> ranks.tolist(), positions_of(tables, ranks).tolist()
([2, 0, 3, 1], [0, 1, 2, 3])
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse._src.core.select import pack_planes, rank_select, sorted_search
from jsparse._src.device.ulp_codes import NUM_CLASSES, exponent_class

_WORD = 32
_SUPERBLOCK_WORDS = 8
_SUPERBLOCK = _WORD * _SUPERBLOCK_WORDS
_CLASS_BITS = 4


class ClassTables(NamedTuple):
  """What ranks and positions are computed from.

  Attributes:
    planes: ``uint32[num_superblocks, 5, 8]``: bit ``k`` of each element's class for k < 4, then
      whether the element exists (the segment is padded to whole superblocks); a superblock's
      planes are contiguous, so a query gathers one 160-byte row.
    first_rank: ``int32[16 * num_superblocks]``: class major, the rank of the first element of
      class c in superblock s, at ``c * num_superblocks + s`` (non-decreasing).
  """

  planes: jax.Array
  first_rank: jax.Array


def _class_mask(planes: jax.Array, cls: jax.Array | int) -> jax.Array:
  """Words whose set bits are the (existing) elements of class ``cls``."""
  mask = planes[..., _CLASS_BITS, :]
  for k in range(_CLASS_BITS):
    has_bit = ((cls >> k) & 1) == 1
    if isinstance(has_bit, jax.Array):
      has_bit = has_bit[..., None]
    mask &= jnp.where(has_bit, planes[..., k, :], ~planes[..., k, :])
  return mask


def class_tables(bits: jax.Array, dtype: np.dtype) -> ClassTables:
  """The tables of a flat segment of old bit patterns of ``dtype``."""
  size = bits.shape[0]
  num_superblocks = max(1, -(-size // _SUPERBLOCK))
  num_words = num_superblocks * _SUPERBLOCK_WORDS
  cls = exponent_class(bits, dtype, jnp)
  planes = pack_planes(cls, _CLASS_BITS)
  word_start = jnp.arange(num_words, dtype=jnp.int32) * _WORD
  filled = jnp.clip(size - word_start, 0, _WORD).astype(jnp.uint32)
  exists = jnp.where(filled == _WORD, jnp.uint32(0xFFFFFFFF),
                     (jnp.uint32(1) << (filled & 31)) - 1)
  planes = [jnp.pad(p, (0, num_words - p.shape[0])) for p in planes] + [exists]
  planes = jnp.stack([p.reshape(num_superblocks, _SUPERBLOCK_WORDS) for p in planes], axis=1)
  # Every class's masks at once (``[superblocks, classes, words]``): one fused pass, and a
  # program whose size does not grow with the number of classes.
  masks = _class_mask(planes[:, None], jnp.arange(NUM_CLASSES, dtype=jnp.int32)[None, :])
  counts = jnp.sum(lax.population_count(masks).astype(jnp.int32), axis=-1).T.reshape(-1)
  first_rank = jnp.cumsum(counts) - counts
  # Materialize the tables: fused into the queries' gathers, XLA would recompute them per query.
  return ClassTables(*lax.optimization_barrier((planes, first_rank)))


def _superblock_words(tables: ClassTables, superblock: jax.Array,
                      cls: jax.Array) -> jax.Array:
  """``uint32[n, 8]``: the class-``cls`` masks of the words of each ``superblock``."""
  return _class_mask(tables.planes[superblock], cls)


def ranks_of(tables: ClassTables, positions: jax.Array, classes: jax.Array) -> jax.Array:
  """The ranks of the elements at ``positions`` (in range), of exponent classes ``classes``."""
  superblock = positions // _SUPERBLOCK
  word = (positions // _WORD) % _SUPERBLOCK_WORDS
  bit = (positions % _WORD).astype(jnp.uint32)
  words = _superblock_words(tables, superblock, classes)
  index = jnp.arange(_SUPERBLOCK_WORDS, dtype=jnp.int32)
  below = jnp.where(index < word[:, None], words,
                    jnp.where(index == word[:, None], words & ((jnp.uint32(1) << bit) - 1)[:, None],
                              0))
  before = jnp.sum(lax.population_count(below).astype(jnp.int32), axis=-1)
  num_superblocks = tables.planes.shape[0]
  return tables.first_rank[classes.astype(jnp.int32) * num_superblocks + superblock] + before


def positions_of(tables: ClassTables, ranks: jax.Array) -> jax.Array:
  """The positions of the elements with the given ranks (each in ``[0, size)``)."""
  num_superblocks = tables.planes.shape[0]
  flat = sorted_search(tables.first_rank, ranks, "right") - 1
  cls, superblock = flat // num_superblocks, flat % num_superblocks
  within = ranks - tables.first_rank[flat]
  # (Materialized: fused into each of the columns below, the gather would run once per column.)
  words = lax.optimization_barrier(_superblock_words(tables, superblock, cls))
  # The word holding the class's element number ``within`` of the superblock, the elements
  # before that word, and the word: the 8 columns walked in one elementwise pass. (A prefix sum
  # and arg-max along rows of 8 words took 1.6x as long on XLA:CPU: on the benchmark's four
  # largest leaves, 14-16 ms against 8-10 ms after the class tables.)
  passed = before = jnp.zeros(ranks.shape, jnp.int32)
  word = jnp.full(ranks.shape, _SUPERBLOCK_WORDS, jnp.int32)  # no word: past the segment
  chosen = jnp.zeros(ranks.shape, jnp.uint32)
  for w in range(_SUPERBLOCK_WORDS):
    column = words[:, w]
    ends = passed + lax.population_count(column).astype(jnp.int32)
    here = (passed <= within) & (within < ends)
    word = jnp.where(here, w, word)
    before = jnp.where(here, passed, before)
    chosen = jnp.where(here, column, chosen)
    passed = ends
  bit = rank_select(chosen, within - before + 1)
  return superblock * _SUPERBLOCK + word * _WORD + bit
