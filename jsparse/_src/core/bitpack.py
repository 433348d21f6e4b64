"""Fixed-width bit packing per block of 32 values, on the device: the inner code of the packed
coding (``wire/packed.py``).

A stream of unsigned 32-bit values is cut into blocks of :data:`BLOCK` values; each block is
written with the bit width of its largest value (``widths``, one byte per block), its values
laid end to end, least significant bit first, in little-endian ``uint32`` words. Small values
(gaps between sorted keys, zigzagged ulp codes) take a few bits each, and a block's width
adapts to its neighbourhood. Both directions are a few whole-array passes: bit lengths, a
prefix sum over the blocks' sizes, then every value's bit offset; packing scatter-adds each
value's two word halves (the bit ranges are disjoint, so adding is or-ing), unpacking gathers
two words per value and shifts and masks. Nothing is sorted, no loop runs per value, no 64-bit
integer is used: the programs suit GPUs and TPUs alike.

>>> import jax.numpy as jnp
>>> values = jnp.array([3, 0, 5, 1, 2**20], jnp.uint32)
>>> widths, words, used = pack(values, 4)  # the first 4 values
>>> widths.tolist(), int(used), num_words(widths, 4)  # 4 values of 3 bits
([3], 1, 1)
>>> unpack(widths, words, 4, 5).tolist()
[3, 0, 5, 1, 0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = 32
# Blocks per page: bit offsets are int32 within a page (2**24 values, at most 2**29 bits), and
# each page starts on a word (its words: the page's used bits, rounded up), so a stream of any
# length packs with int32 arithmetic only.
PAGE_BLOCKS = 1 << 19


def num_blocks(size: int) -> int:
  """Blocks of a stream of ``size`` values."""
  return -(-size // BLOCK)


def max_words(size: int, page_blocks: int = PAGE_BLOCKS) -> int:
  """The words :func:`pack` returns for a stream of ``size`` values (what any count fills, and
  one more)."""
  blocks = num_blocks(size)
  return blocks * BLOCK + -(-blocks // page_blocks) + 1


def _block_values(num: int, count, xp):
  """Values of each of ``num`` blocks below ``count`` (the last used block may be partial)."""
  return xp.clip(count - BLOCK * xp.arange(num), 0, BLOCK)


def num_words(widths: np.ndarray, count: int, page_blocks: int = PAGE_BLOCKS) -> int:
  """``uint32`` words that :func:`pack` fills with ``count`` values in blocks of ``widths``
  (on the host): per page, its values' bits (the last block holds only its values, not 32)
  rounded up to whole words."""
  widths = np.asarray(widths, np.int64)
  full = len(widths) - 1  # blocks before the last: full when count fills them (a stream's own)
  if 0 <= full < page_blocks and count >= BLOCK * full:
    bits = BLOCK * int(widths[:full].sum()) + int(widths[full]) * min(BLOCK, count - BLOCK * full)
    return (bits + 31) // 32
  bits = widths * _block_values(len(widths), count, np)
  pages = np.add.reduceat(bits, np.arange(0, len(bits), page_blocks)) if len(bits) else bits
  return int(np.sum((pages + 31) // 32))


def _layout(widths: jax.Array, count, page_blocks: int) -> tuple[jax.Array, jax.Array,
                                                                  jax.Array]:
  """``(word, shift, used)``: per value of each block, the word it starts in and its bit
  there (``int32[blocks, BLOCK]``, ``uint32``), and the words the first ``count`` values
  fill."""
  widths = widths.astype(jnp.int32)
  num = widths.shape[0]
  pages = max(1, -(-num // page_blocks))
  per_page = page_blocks if pages > 1 else max(1, num)  # one page: no padding to its size
  paged = jnp.zeros((pages * per_page,), jnp.int32).at[:num].set(widths)
  paged = paged.reshape(pages, per_page)
  block_bits = paged * BLOCK
  start = (jnp.cumsum(block_bits, axis=1) - block_bits).reshape(-1)[:num]
  used_bits = (paged.reshape(-1)[:num] * _block_values(num, count, jnp)).astype(jnp.int32)
  page_bits = jnp.zeros((pages * per_page,), jnp.int32).at[:num].set(used_bits)
  page_words = (jnp.sum(page_bits.reshape(pages, per_page), axis=1) + 31) // 32
  page_start = jnp.cumsum(page_words) - page_words
  offsets = start[:, None] + jnp.arange(BLOCK, dtype=jnp.int32)[None, :] * widths[:, None]
  page_of = jnp.arange(num, dtype=jnp.int32) // page_blocks
  word = page_start[page_of][:, None] + (offsets >> 5)
  return word, (offsets & 31).astype(jnp.uint32), jnp.sum(page_words)


def _blocked(values: jax.Array, count: jax.Array | int) -> jax.Array:
  """``values`` as ``uint32[blocks, BLOCK]``, zero past ``count``."""
  size = values.shape[0]
  padded = jnp.zeros((num_blocks(size) * BLOCK,), jnp.uint32).at[:size].set(
      values.astype(jnp.uint32))
  used = jnp.arange(padded.shape[0], dtype=jnp.int32) < count
  return jnp.where(used, padded, jnp.uint32(0)).reshape(-1, BLOCK)


def pack(values: jax.Array, count: jax.Array | int, page_blocks: int = PAGE_BLOCKS, *,
         out: jax.Array | None = None, at: jax.Array | int = 0
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Packs the first ``count`` of ``values`` (unsigned ints of at most 32 bits).

  Returns:
    ``(widths, words, used)``: ``uint8[blocks]`` bit widths (0 for blocks past ``count``),
    ``uint32[max_words(size)]`` words of which the first ``used`` (an ``int32`` scalar,
    :func:`num_words`) hold the values. Shapes depend on ``values.shape`` only. With ``out``
    (``uint32`` words, zero where the values go), ``words`` is ``out`` (its shape) with the
    values' words added from word ``at`` on: several streams packed into one buffer.
  """
  blocks = _blocked(values, count)
  widths = jnp.max(32 - lax.clz(blocks), axis=1).astype(jnp.int32)
  word, shift, used = _layout(widths, count, page_blocks)
  word = word.reshape(-1) + at
  low = blocks << shift
  # The bits that spill into the next word; none when the value starts a word.
  high = jnp.where(shift > 0, blocks >> (jnp.uint32(32) - jnp.maximum(shift, 1)), jnp.uint32(0))
  if out is None:
    out = jnp.zeros((max_words(values.shape[0], page_blocks),), jnp.uint32)
  words = out.at[word].add(low.reshape(-1), mode="drop")
  words = words.at[word + 1].add(high.reshape(-1), mode="drop")
  return widths.astype(jnp.uint8), words, used


def bytes_as_words(values: jax.Array) -> jax.Array:
  """``uint8`` values laid in ``uint32`` words, least significant byte first (the last word
  padded with zeros): bytes as a little-endian host reads them from the words.

  >>> bytes_as_words(jnp.array([1, 2, 3, 4, 5], jnp.uint8)).tolist()
  [67305985, 5]
  """
  padded = jnp.zeros((-(-values.shape[0] // 4) * 4,), jnp.uint32)
  padded = padded.at[:values.shape[0]].set(values.astype(jnp.uint32)).reshape(-1, 4)
  return jnp.sum(padded << (jnp.uint32(8) * jnp.arange(4, dtype=jnp.uint32)), axis=1,
                 dtype=jnp.uint32)


def unpack(widths: jax.Array, words: jax.Array, count: jax.Array | int, size: int,
           page_blocks: int = PAGE_BLOCKS) -> jax.Array:
  """Inverse of :func:`pack`: ``uint32[size]``, the first ``count`` values (0 after them).

  ``widths`` must be at most 32 each (check on the host); ``words`` may be of any length:
  a read past its end gives 0 bits.
  """
  widths = widths.astype(jnp.int32)
  if not words.shape[0]:
    words = jnp.zeros((1,), jnp.uint32)
  word, shift, _ = _layout(widths, count, page_blocks)
  low = jnp.take(words, word, mode="fill", fill_value=0)
  high = jnp.take(words, word + 1, mode="fill", fill_value=0)
  value = (low >> shift) | jnp.where(shift > 0, high << (jnp.uint32(32) - jnp.maximum(shift, 1)),
                                     jnp.uint32(0))
  width = widths[:, None].astype(jnp.uint32)
  mask = jnp.where(width >= 32, jnp.uint32(0xFFFFFFFF),
                   (jnp.uint32(1) << jnp.minimum(width, 31)) - 1)
  value = (value & mask).reshape(-1)[:size]
  return jnp.where(jnp.arange(size, dtype=jnp.int32) < count, value, jnp.uint32(0))
