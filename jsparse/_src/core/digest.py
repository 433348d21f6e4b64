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

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.blocks import block_positions
from jsparse._src.core.layout import Layout
from jsparse._src.errors import ConfigError

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


def _mixed_lanes(words: jax.Array, positions: jax.Array, leaf_ids: jax.Array) -> list[jax.Array]:
  """The two mixed words of every element (``words``, ``positions`` and ``leaf_ids`` broadcast
  together), that the digest sums."""
  positions = positions.astype(jnp.uint32)
  lanes = []
  for k, (c_bits, c_pos) in enumerate(_SEEDS):
    seed = leaf_ids * jnp.uint32(0x632BE5AB) + jnp.uint32(k)  # wraps mod 2**32
    lanes.append(_fmix(words * jnp.uint32(c_bits) + positions * jnp.uint32(c_pos) + seed))
  return lanes


def _lane_sums(lanes: Sequence[jax.Array]) -> jax.Array:
  zero = jnp.uint32(0)
  sums = lax.reduce(tuple(lanes), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]),
                    tuple(range(lanes[0].ndim)))
  return jnp.stack(sums)


def _mixed_sums(words: jax.Array, positions: jax.Array, leaf_ids: jax.Array) -> jax.Array:
  """``uint32[2]``: the two sums, over every element, of ``words`` mixed with ``positions`` and
  ``leaf_ids`` (the three broadcast together)."""
  return _lane_sums(_mixed_lanes(words, positions, leaf_ids))


def change_digest(new_bits: jax.Array, old_bits: jax.Array, positions: jax.Array,
                  leaf_ids: jax.Array, used: jax.Array) -> jax.Array:
  """``uint32[2]``: what :func:`bits_digest` of a tree gains (mod 2**32) when the elements
  where ``used`` go from ``old_bits`` to ``new_bits`` (bit patterns; ``positions``: flat, in
  their leaves; ``leaf_ids``: of those leaves). The digest is a sum over elements, so a sync
  updates it from its changes alone, without reading the other elements.

  >>> import jax.numpy as jnp
  >>> old, new = jnp.zeros(4, jnp.uint16), jnp.zeros(4, jnp.uint16).at[2].set(7)
  >>> gain = change_digest(new[2:3], old[2:3], jnp.array([2]), jnp.array([0], jnp.uint32),
  ...                      jnp.array([True]))
  >>> bool((bits_digest([old]) + gain == bits_digest([new])).all())
  True
  """
  leaf_ids = jnp.asarray(leaf_ids, jnp.uint32)
  lanes = [jnp.where(used, n - o, jnp.uint32(0)) for n, o in zip(
      _mixed_lanes(_words(new_bits), positions, leaf_ids),
      _mixed_lanes(_words(old_bits), positions, leaf_ids))]
  return _lane_sums(lanes)


def _leaf_words(leaf: jax.Array) -> jax.Array:
  return _words(bits_lib.to_bits(leaf)).reshape(-1)


def _explicitly_split(leaf: jax.Array) -> bool:
  """Whether ``leaf`` is split over an Explicit mesh axis (its type names the axis): such a
  leaf cannot always be flattened without saying how the result is sharded."""
  spec = getattr(jax.typeof(leaf).sharding, "spec", None)
  return spec is not None and any(axes is not None for axes in spec)


@jax.jit  # traced, its type's (abstract) mesh places the positions without a mesh context
def _shaped_digest(leaf: jax.Array, leaf_id: jax.Array) -> jax.Array:
  """The digest of one leaf in its own shape (not flattened): each element's position is its
  row-major index, so the sums are those of the flattened leaf, and the leaf keeps its
  sharding (each device mixes its own elements; the reduction adds the partial sums)."""
  words = _words(bits_lib.to_bits(leaf))
  sharding = jax.typeof(words).sharding
  positions, stride = None, 1
  for d in reversed(range(words.ndim)):
    term = lax.broadcasted_iota(jnp.uint32, words.shape, d, out_sharding=sharding)
    term = term * jnp.uint32(stride) if stride != 1 else term
    positions = term if positions is None else positions + term
    stride *= words.shape[d]
  return _mixed_sums(words, positions, leaf_id)


def _as_leaves(tree: Any) -> list[jax.Array]:
  """The leaves of ``tree`` (any pytree of arrays, e.g. a list of leaves), checked."""
  flat = jax.tree.flatten_with_path(tree)[0]
  if not flat and jax.tree.leaves(tree, is_leaf=lambda x: x is None):
    raise ConfigError("bits_digest: expected a pytree of arrays, got a tree of None only")
  leaves = []
  for path, leaf in flat:
    if isinstance(leaf, (np.ndarray, np.generic)):
      leaf = jnp.asarray(leaf)
    if not isinstance(leaf, jax.Array):
      raise ConfigError(f"bits_digest: expected a pytree of arrays; leaf "
                        f"{jax.tree_util.keystr(path) or '(the root)'} is a "
                        f"{type(leaf).__name__}")
    leaves.append(leaf)
  return leaves


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
    stackable = (_layout(layouts, j) is None and leaf.size <= _STACKED_MAX_SIZE
                 and not _explicitly_split(leaf))
    key = leaf.size if stackable else None
    if key is not None and key == key_of_last:
      groups[-1].append(j)
    else:
      groups.append([j])
    key_of_last = key
  return groups


def bits_digest(tree: Any,
                layouts: Sequence[Layout | None] | None = None,
                leaf_ids: jax.Array | None = None) -> jax.Array:
  """Returns ``uint32[2]``, a position-sensitive digest of the bit patterns of ``tree``'s
  leaves.

  Args:
    tree: a pytree of arrays (a list of leaves, a dict, a flax ``State``...): the digest is
      that of its leaves in ``jax.tree.leaves`` order (for a list of arrays, the list). Leaves
      sharded over a mesh, of Auto or Explicit axes, give the digest of the same values
      unsharded.
    layouts: (static) per leaf, a :class:`Layout` if it is split into blocks over a mesh (it
      is then digested block by block on the devices that hold them, without gathering), or
      ``None``.
    leaf_ids: ``uint32`` per leaf (may be traced; default ``0, 1, ...``), the leaves' ids in
      the whole tree: the digest of a tree is the sum (mod 2**32) of the digests of any split
      of its leaves with their ids.

  Raises:
    ConfigError: a leaf is not an array (a ``str``...), or the tree holds only ``None``.

  >>> import jax.numpy as jnp, jsparse
  >>> jsparse.bits_digest([jnp.zeros(3)]).shape
  (2,)
  >>> tree = {'b': jnp.ones(2), 'a': jnp.zeros(3)}
  >>> bool((jsparse.bits_digest(tree) == jsparse.bits_digest([tree['a'], tree['b']])).all())
  True
  """
  leaves = _as_leaves(tree)
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
    if len(group) == 1 and _explicitly_split(leaves[first]):
      total = total + _shaped_digest(leaves[first], leaf_ids[first])
      continue
    members = [_leaf_words(leaves[j]) for j in group]
    words = jnp.stack(members) if len(members) > 1 else members[0]  # [leaves, size] or [size]
    positions = jnp.arange(words.shape[-1], dtype=jnp.uint32)
    total = total + _mixed_sums(words, positions, leaf_ids[first:first + len(group), None])
  return total
