"""A cheap on-device digest of a tree's bit patterns, to check sender and receiver agree.

Each element's bits are mixed with its position and its leaf's index through a murmur3-style
finalizer, and the mixed words are summed (mod 2**32) twice with different constants: one
streaming pass, fused by XLA, giving 64 bits. It detects any difference in any bit of any
element with overwhelming probability; it is not a cryptographic hash.

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

from jsparse._src import bits as bits_lib

_SEEDS = ((0x9E3779B1, 0x85EBCA77), (0xC2B2AE3D, 0x27D4EB2F))


def _fmix(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _words(leaf: jax.Array) -> jax.Array:
  b = bits_lib.to_bits(leaf.reshape(-1))
  if b.dtype == jnp.uint64:
    return b.astype(jnp.uint32) ^ _fmix((b >> 32).astype(jnp.uint32))
  return b.astype(jnp.uint32)


def bits_digest(leaves: Sequence[jax.Array]) -> jax.Array:
  """Returns ``uint32[2]``, a position-sensitive digest of the bit patterns of ``leaves``."""
  totals = [jnp.uint32(0), jnp.uint32(0)]
  for leaf_id, leaf in enumerate(leaves):
    if leaf.size == 0:
      continue
    words = _words(leaf)
    position = jnp.arange(words.shape[0], dtype=jnp.uint32)
    for k, (c_bits, c_pos) in enumerate(_SEEDS):
      seed = jnp.uint32((leaf_id * 0x632BE5AB + k) & 0xFFFFFFFF)
      mixed = _fmix(words * jnp.uint32(c_bits) + position * jnp.uint32(c_pos) + seed)
      totals[k] = totals[k] + jnp.sum(mixed, dtype=jnp.uint32)
  return jnp.stack(totals)
