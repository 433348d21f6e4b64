"""Selecting changes with a static capacity: the positions of the first ``capacity`` set bits.

``jnp.nonzero(mask, size=K)`` does a full-length cumsum and scatter; here the mask is packed into
32-bit words in one fused pass, the prefix sum runs over the words only (n/32 elements), and each
of the K output slots finds its word by binary search and its bit by a 5-step rank search inside
the word. The cost is one streaming pass over the data plus O(K log n) small work. When ``K``
is a large share of ``n`` (pools of small leaves take every slot they may need), that small
work is not small: each set bit then goes straight to its slot, by a prefix sum over the mask
and one scatter (XLA:CPU, a 65,536-element mask with 4% set and K = n: 1.42 ms by search,
0.23 ms by scatter; K = n / 20: 0.14 and 0.27 ms).

Binary searches (:func:`sorted_search`) run as a loop of steps on CPU and unrolled elsewhere:
the JAX docs' advice for ``jnp.searchsorted`` ("'scan' tends to be more performant on CPU",
"'scan_unrolled' is more performant on GPU", where each iteration of a loop is a launch).

>>> import jax.numpy as jnp
>>> idx, count = first_set_positions(jnp.array([0, 1, 1, 0, 1], bool), capacity=2)
>>> idx.tolist(), int(count)
([1, 2], 3)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse._src.core import bits as bits_lib

_WORD = 32
# Slots at or above this share of the mask's size are filled by scatter (see the docstring).
SCATTER_SHARE = 1 / 8


def sorted_search(sorted_values: jax.Array, queries: jax.Array, side: str,
                  method: str | None = None) -> jax.Array:
  """``jnp.searchsorted(sorted_values, queries, side=side)``, by ``method`` (default: 'scan' if
  JAX's default backend is the CPU, else 'scan_unrolled'; every method gives the same result).

  Chosen when traced, by the default backend rather than ``lax.platform_dependent``: that one
  traces and lowers both searches into every program (on CPU, a program of one selection and
  one rank search took 0.36 s to trace and lower instead of 0.25 s), and jsparse's programs
  run where they are traced.

  >>> sorted_search(jnp.array([1, 3, 3, 7]), jnp.array([0, 3, 8]), 'right').tolist()
  [0, 3, 4]
  """
  if method is None:
    method = "scan" if jax.default_backend() == "cpu" else "scan_unrolled"
  return jnp.searchsorted(sorted_values, queries, side=side, method=method)


def pack_words(mask: jax.Array) -> jax.Array:
  """Packs a flat bool mask into uint32 words, bit ``j`` of word ``w`` being ``mask[32 w + j]``."""
  pad = (-mask.shape[0]) % _WORD
  if pad:
    mask = jnp.pad(mask, (0, pad))
  shifts = jnp.arange(_WORD, dtype=jnp.uint32)
  words = mask.reshape(-1, _WORD).astype(jnp.uint32) << shifts
  return jnp.sum(words, axis=1, dtype=jnp.uint32)  # distinct bits: the sum is the bitwise or


def rank_select(word: jax.Array, rank: jax.Array) -> jax.Array:
  """Position of the ``rank``-th (1-based) set bit of each uint32 ``word``."""
  pos = jnp.zeros(word.shape, jnp.uint32)
  for step in (16, 8, 4, 2, 1):
    probe = pos + step
    below = word & ((jnp.uint32(1) << probe) - 1)  # bits [0, probe)
    pos = jnp.where(lax.population_count(below).astype(jnp.int32) < rank, probe, pos)
  return pos.astype(jnp.int32)


def first_set_positions(mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """Returns the first ``capacity`` positions where the flat ``mask`` is true, and the true count.

  Slots past the count hold ``mask.size`` (out of range: scatter with ``mode='drop'`` skips
  them; never -1, which would wrap). The count may exceed ``capacity``: that is an overflow.
  """
  size = mask.shape[0]
  if capacity >= SCATTER_SHARE * size:
    return _scattered_positions(mask, capacity)
  words = pack_words(mask)
  ends = jnp.cumsum(lax.population_count(words).astype(jnp.int32))  # set bits in words [0, w]
  count = ends[-1]
  k = jnp.arange(1, capacity + 1, dtype=jnp.int32)
  word_id = sorted_search(ends, k, "left").astype(jnp.int32)
  safe_word = jnp.minimum(word_id, words.shape[0] - 1)
  before = jnp.where(word_id > 0, ends[jnp.maximum(safe_word - 1, 0)], 0)
  bit = rank_select(words[safe_word], k - before)
  positions = jnp.where(k <= count, safe_word * _WORD + bit, size)
  return positions, count


def _scattered_positions(mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """:func:`first_set_positions` by one scatter: each set bit's rank is its slot."""
  size = mask.shape[0]
  ranks = jnp.cumsum(mask.astype(jnp.int32))
  slots = jnp.where(mask, ranks - 1, capacity)  # past the slots: dropped
  positions = jnp.full((capacity,), size, jnp.int32).at[slots].set(
      jnp.arange(size, dtype=jnp.int32), mode="drop")
  return positions, ranks[-1]


def changed_elements(base: jax.Array, new: jax.Array, rollout_dtype: np.dtype,
                     capacity: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Compares two flat arrays in ``rollout_dtype`` bits and returns the first ``capacity``
  changed positions (the size where unused), their new and old rollout bits (0 where unused),
  and the number of changed elements."""
  size = new.shape[0]
  old_bits = bits_lib.to_bits(base.astype(rollout_dtype))
  positions, count = first_set_positions(old_bits != bits_lib.to_bits(new.astype(rollout_dtype)),
                                       capacity)
  used, safe = positions < size, jnp.minimum(positions, size - 1)
  new_values = bits_lib.gather_rollout_bits(new, safe, rollout_dtype)
  old_values = bits_lib.gather_rollout_bits(base, safe, rollout_dtype)
  return positions, jnp.where(used, new_values, 0), jnp.where(used, old_values, 0), count
