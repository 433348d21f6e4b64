"""A cheap on-device digest of a tree's bit patterns, to check sender and receiver agree.

Each element's bits are mixed with its position and its leaf's index through a murmur3-style
finalizer, and the mixed words are summed (mod 2**32) twice with different constants: one
streaming pass giving 64 bits. Both sums are one variadic ``lax.reduce``: on XLA:CPU that is
about 10x faster than two ``jnp.sum`` (21M elements: 6 ms against 59 ms, measured).
It detects any difference in any bit of any element with overwhelming probability; it is not
a cryptographic hash.

>>> import jax.numpy as jnp
>>> a = bits_digest([jnp.array([0.0], jnp.float32)])
>>> b = bits_digest([jnp.array([-0.0], jnp.float32)])
>>> bool((a != b).any())
True
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.blocks import block_positions
from jsparse._src.core.layout import Layout

_SEEDS = ((0x9E3779B1, 0x85EBCA77), (0xC2B2AE3D, 0x27D4EB2F))


def _fmix(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _words(bits: jax.Array) -> jax.Array:
  if bits.dtype == jnp.uint64:
    return bits.astype(jnp.uint32) ^ _fmix((bits >> 32).astype(jnp.uint32))
  return bits.astype(jnp.uint32)


# Leaves up to this size, unsplit, of one size and next to each other, are
# digested as one stacked array: a program's size then follows the groups, not the leaves (a
# pool of 32 norms: 2,926 lines of HLO leaf by leaf, 364 stacked), and the sums are the same.
_STACKED_MAX_SIZE = 1 << 16


def _mixed_sums(words: jax.Array, positions: jax.Array, leaf_ids: jax.Array) -> jax.Array:
  """``uint32[2]``: the two sums, over every element, of ``words`` mixed with ``positions`` and
  ``leaf_ids`` (the three broadcast together)."""
  positions = positions.astype(jnp.uint32)
  lanes = []
  for k, (c_bits, c_pos) in enumerate(_SEEDS):
    seed = leaf_ids * jnp.uint32(0x632BE5AB) + jnp.uint32(k)  # wraps mod 2**32
    lanes.append(_fmix(words * jnp.uint32(c_bits) + positions * jnp.uint32(c_pos) + seed))
  zero = jnp.uint32(0)
  sums = lax.reduce(tuple(lanes), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]),
                    tuple(range(lanes[0].ndim)))
  return jnp.stack(sums)


def _leaf_words(leaf: jax.Array) -> jax.Array:
  return _words(bits_lib.to_bits(leaf)).reshape(-1)


def _split_leaf_digest(leaf: jax.Array, leaf_id: jax.Array, layout: Layout) -> jax.Array:
  def local(block, leaf_id):  # each device sums its own block; the partial sums add up
    partial = _mixed_sums(_leaf_words(block), block_positions(layout, leaf.shape).reshape(-1),
                          leaf_id)
    return lax.psum(partial, layout.split_axes)

  return layout.shard_map(local, (layout.spec, PartitionSpec()), PartitionSpec())(leaf, leaf_id)


def _layout(layouts: Sequence[Layout | None] | None, j: int) -> Layout | None:
  return layouts[j] if layouts else None


def _groups(leaves: Sequence[jax.Array], layouts: Sequence[Layout | None] | None
            ) -> list[list[int]]:
  """The non-empty leaves in runs digested together: next to each other, unsplit, of one size
  (at most :data:`_STACKED_MAX_SIZE`); any other leaf alone. A run is of consecutive leaves
  (an empty one ends it), so its ids are one slice. (Each element is mixed into a 32-bit word
  first, whatever its dtype, so unlike dtypes stack too.)"""
  groups: list[list[int]] = []
  key_of_last = None
  for j, leaf in enumerate(leaves):
    if not leaf.size:
      key_of_last = None
      continue
    stackable = _layout(layouts, j) is None and leaf.size <= _STACKED_MAX_SIZE
    key = leaf.size if stackable else None
    if key is not None and key == key_of_last:
      groups[-1].append(j)
    else:
      groups.append([j])
    key_of_last = key
  return groups


def bits_digest(leaves: Sequence[jax.Array],
                layouts: Sequence[Layout | None] | None = None,
                leaf_ids: jax.Array | None = None) -> jax.Array:
  """Returns ``uint32[2]``, a position-sensitive digest of the bit patterns of ``leaves``.

  ``layouts`` (static) says which leaves are split into blocks over a mesh; those are digested
  block by block on the devices that hold them, without gathering. ``leaf_ids`` (``uint32``,
  may be traced; default ``0, 1, ...``) are the leaves' ids in the whole tree: the digest of a
  tree is the sum (mod 2**32) of the digests of any split of its leaves with their ids.

  >>> import jax.numpy as jnp, jsparse
  >>> jsparse.bits_digest([jnp.zeros(3)]).shape
  (2,)
  """
  if leaf_ids is None:
    leaf_ids = np.arange(len(leaves), dtype=np.uint32)
  leaf_ids = jnp.asarray(leaf_ids, jnp.uint32)
  total = jnp.zeros((2,), jnp.uint32)
  for group in _groups(leaves, layouts):
    first = group[0]
    layout = _layout(layouts, first)
    if layout is not None:  # a split leaf, always alone in its group
      total = total + _split_leaf_digest(leaves[first], leaf_ids[first], layout)
      continue
    members = [_leaf_words(leaves[j]) for j in group]
    words = jnp.stack(members) if len(members) > 1 else members[0]  # [leaves, size] or [size]
    positions = jnp.arange(words.shape[-1], dtype=jnp.uint32)
    total = total + _mixed_sums(words, positions, leaf_ids[first:first + len(group), None])
  return total
