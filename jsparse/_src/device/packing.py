"""The packed coding's device programs: a chunk's changes to packed words, and back.

The sender's :func:`pack_program` takes a chunk's changes in their slots (keys: positions, or
ranks in the exponent-class order for ordered segments; new and old bits) and returns two
bit-packed streams (``core/bitpack.py``): the *key gaps* (per run of ascending keys: the first
key, then each key minus the previous minus 1) and the *value codes* (the ulp code against the
old bits, zigzagged, minus 1: a changed element's code is never 0; 64-bit dtypes give two
32-bit values per change, low half first). A segment is one run, except a leaf the trainer
splits into blocks, where each block's changes are a run of their own (ascending within the
block). Ranks come from the diff in position order; a bitmap of the ranks and prefix
popcounts over its words put them in ascending order (:func:`rank_order`). The receiver's
:func:`unpack_program` inverts this and checks every key (in range, ascending) and code (fits
the dtype) on the device, returning one flag, so the host never touches a change.

>>> import jax.numpy as jnp
>>> old = jnp.array([0x3F80, 0x3F80, 0x0001], jnp.uint16)  # bf16 1.0, 1.0, the least subnormal
>>> new = jnp.array([0x3F81, 0x3F7F, 0x8000], jnp.uint16)  # one ulp up, one down, -0.0
>>> z = value_codes(old, new, jnp.bfloat16)  # +1, -1, -2 ulps
>>> z.tolist(), from_value_codes(z, jnp.uint16).tolist()
([1, 0, 2], [1, 65535, 65534])
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse._src.core import bitpack
from jsparse._src.core.plan import LeafSpec, Plan, Segment
from jsparse._src.errors import ConfigError
from jsparse._src.device import ulp_codes


def values_per_change(seg: Segment) -> int:
  """32-bit values a change's code takes in the codes stream (2 for 64-bit dtypes)."""
  return 2 if seg.bit_dtype.itemsize == 8 else 1


def _signed(dtype: np.dtype) -> np.dtype:
  return np.dtype(f"int{8 * np.dtype(dtype).itemsize}")


def value_codes(old: jax.Array, new: jax.Array, dtype: np.dtype) -> jax.Array:
  """Zigzagged ulp codes minus 1 of changed elements (unsigned ints of the bit width)."""
  codes = ulp_codes.ulp_codes(old, new, np.dtype(dtype), jnp)
  width = 8 * codes.dtype.itemsize
  signed = lax.bitcast_convert_type(codes, _signed(codes.dtype))
  zigzag = lax.bitcast_convert_type((signed << 1) ^ (signed >> (width - 1)), codes.dtype)
  return zigzag - codes.dtype.type(1)


def from_value_codes(z: jax.Array, bit_dtype: np.dtype) -> jax.Array:
  """Inverse of :func:`value_codes`: the ulp codes (modular, of ``bit_dtype``)."""
  zigzag = (z + 1).astype(bit_dtype)
  return (zigzag >> 1) ^ (jnp.zeros_like(zigzag) - (zigzag & 1))


def _as_words(z: jax.Array) -> jax.Array:
  """``uint32[n, k]``: each code as ``k`` 32-bit values, low half first."""
  if z.dtype.itemsize < 8:
    return z.astype(jnp.uint32)[:, None]
  return jnp.stack([(z & 0xFFFFFFFF).astype(jnp.uint32), (z >> 32).astype(jnp.uint32)], axis=1)


def _from_words(words: jax.Array, bit_dtype: np.dtype) -> jax.Array:
  """Inverse of :func:`_as_words`."""
  if words.shape[1] == 1:
    return words[:, 0]
  return words[:, 0].astype(bit_dtype) | (words[:, 1].astype(bit_dtype) << 32)


def rank_order(ranks: jax.Array, used: jax.Array, size: int) -> jax.Array:
  """Where each used entry goes when the used entries are sorted by their ranks (distinct, in
  ``[0, size)``); -1 for unused entries. No sort: the ranks are set in a bitmap of ``size``
  bits (a scatter-add of one bit each: distinct bits, so adding is or-ing), and an entry's
  place is the number of set bits below its own (a prefix sum of the words' popcounts, plus a
  popcount in its word). The work is one pass over ``size / 32`` words and a few per entry.

  >>> import jax.numpy as jnp
  >>> rank_order(jnp.array([40, 3, 7, 0]), jnp.array([True, True, True, False]), 64).tolist()
  [2, 0, 1, -1]
  """
  num_words = max(1, -(-size // 32))
  ranks = jnp.where(used, ranks, size).astype(jnp.int32)
  word, bit = ranks >> 5, (ranks & 31).astype(jnp.uint32)
  bitmap = jnp.zeros((num_words,), jnp.uint32).at[word].add(jnp.uint32(1) << bit, mode="drop")
  counts = lax.population_count(bitmap).astype(jnp.int32)
  below_word = jnp.cumsum(counts) - counts
  word = jnp.minimum(word, num_words - 1)
  below_bit = lax.population_count(bitmap[word] & ((jnp.uint32(1) << bit) - 1))
  return jnp.where(used, below_word[word] + below_bit.astype(jnp.int32), -1)


def _gaps(keys: jax.Array) -> jax.Array:
  """Gaps of ascending ``keys`` along the last axis (the first key, then differences - 1)."""
  previous = jnp.concatenate([jnp.full(keys.shape[:-1] + (1,), -1, keys.dtype), keys[..., :-1]],
                             axis=-1)
  return (keys - previous - 1).astype(jnp.uint32)


def _segment_entries(seg: Segment, ranked: bool, keys: jax.Array, new: jax.Array,
                     old: jax.Array, count: jax.Array, block_counts: jax.Array | None):
  """A segment's (gaps, codes ``uint32[n, k]``, index in the segment's run of entries or -1
  for unused slots), all per slot."""
  codes = _as_words(value_codes(old, new, seg.dtype))
  if seg.blocks > 1:  # each block's slots hold its changes, ascending: a run each
    per_block = keys.shape[0] // seg.blocks
    shaped = keys[:per_block * seg.blocks].reshape(seg.blocks, per_block)
    slot = jnp.arange(per_block, dtype=jnp.int32)[None, :]
    start = jnp.cumsum(block_counts) - block_counts
    index = jnp.where((slot < block_counts[:, None]) & (count > 0), start[:, None] + slot,
                      -1).reshape(-1)
    return _gaps(shaped).reshape(-1), codes[:index.shape[0]], index
  used = jnp.arange(keys.shape[0], dtype=jnp.int32) < count
  if ranked and seg.ordered:  # ranks, in position order: ascending once sorted by class
    order = rank_order(keys, used, seg.size)
  else:
    order = jnp.arange(keys.shape[0], dtype=jnp.int32)
  order = jnp.where(used, order, keys.shape[0])
  keys = jnp.zeros_like(keys).at[order].set(keys, mode="drop")
  codes = jnp.zeros_like(codes).at[order].set(codes, mode="drop")
  return _gaps(keys), codes, jnp.where(used, jnp.arange(keys.shape[0], dtype=jnp.int32), -1)


def _widths_words(values):
  """The words that the bit widths (a byte per block) of ``values`` values take."""
  return (bitpack.num_blocks(values) + 3) // 4


def stream_offsets(keys, codes, used_key_words, used_code_words) -> tuple:
  """Where a chunk's two streams lie in the words of :func:`pack_program` (and of
  :func:`aligned_streams`): the words where the key widths, key words, code widths and code
  words begin, and where the code words end; ``keys``, ``codes``: how many it packs,
  ``used_*_words``: the words each stream's values fill. Integers or ``int32`` arrays alike.

  >>> stream_offsets(40, 40, 3, 5)  # 2 blocks of widths each: one word
  (0, 1, 4, 5, 10)
  """
  key_words_at = _widths_words(keys)
  code_widths_at = key_words_at + used_key_words
  code_words_at = code_widths_at + _widths_words(codes)
  return 0, key_words_at, code_widths_at, code_words_at, code_words_at + used_code_words


def packed_words(keys: int, codes: int) -> int:
  """The words :func:`pack_program` returns for ``keys`` key slots and ``codes`` code slots:
  what any counts fill."""
  return (_widths_words(keys) + bitpack.max_words(keys) + _widths_words(codes)
          + bitpack.max_words(codes))


@functools.partial(jax.jit, static_argnums=(0, 1))
def pack_program(plan: Plan, ranked: bool, keys: tuple, new: tuple, old: tuple,
                 counts: jax.Array, block_counts: tuple) -> tuple[jax.Array, jax.Array]:
  """A chunk's changes as ``(words, used)``: its two streams (see
  :func:`~jsparse._src.core.bitpack.pack`) laid in one ``uint32`` buffer as
  :func:`aligned_streams` lays them (key widths, key words, code widths, code words, each from
  a word: :func:`stream_offsets`), zeros after them, and ``int32[2]``, the words the key and the
  code values fill. ``ranked``: the keys of ordered segments are ranks (else every key is a
  position). ``counts``: per segment, the changes to code (0 for segments carried densely or
  empty); ``block_counts``: per segment split into blocks, its changes per block (else None).
  The host copies the buffer's used prefix in one piece."""
  key_start, code_start = jnp.int32(0), jnp.int32(0)
  total_keys = sum(k.shape[0] for k in keys)
  total_codes = sum(k.shape[0] * values_per_change(seg) for k, seg in zip(keys, plan.segments))
  gap_stream = jnp.zeros((total_keys,), jnp.uint32)
  code_stream = jnp.zeros((total_codes,), jnp.uint32)
  for s, seg in enumerate(plan.segments):
    count = counts[s]
    gaps, codes, index = _segment_entries(seg, ranked, keys[s], new[s], old[s], count,
                                          block_counts[s])
    k = values_per_change(seg)
    at = jnp.where(index >= 0, key_start + index, total_keys)
    gap_stream = gap_stream.at[at].set(gaps, mode="drop")
    code_at = jnp.where(index[:, None] >= 0,
                        code_start + index[:, None] * k + jnp.arange(k)[None, :], total_codes)
    code_stream = code_stream.at[code_at.reshape(-1)].set(codes.reshape(-1), mode="drop")
    key_start, code_start = key_start + count, code_start + count * k
  size = packed_words(total_keys, total_codes)
  if size > np.iinfo(np.int32).max:  # its word offsets are int32
    raise ConfigError(f"the packed coding lays a chunk's changes in one buffer of {size:,} "
                      "words, past the int32 indices it uses: lower the plan's capacity, or use "
                      "coding='ranked'")
  words = jnp.zeros((size,), jnp.uint32)
  key_widths, words, used_keys = bitpack.pack(gap_stream, key_start, out=words,
                                              at=_widths_words(key_start))
  _, _, code_widths_at, code_words_at, _ = stream_offsets(key_start, code_start, used_keys, 0)
  code_widths, words, used_codes = bitpack.pack(code_stream, code_start, out=words,
                                                at=code_words_at)
  # Widths past the counts are 0: adding all of them leaves the words after the used ones.
  for widths, at in ((key_widths, 0), (code_widths, code_widths_at)):
    as_words = bitpack.bytes_as_words(widths)
    words = words.at[at + jnp.arange(as_words.shape[0])].add(as_words, mode="drop")
  return words, jnp.stack([used_keys, used_codes]).astype(jnp.int32)


def block_of(leaf: LeafSpec, positions: jax.Array) -> jax.Array:
  """The trainer block (in the layout's row-major order of blocks) of each flat position of a
  leaf split into blocks.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jsparse._src.core.layout import Layout
  >>> mesh = jax.sharding.AbstractMesh((2, 3), ('a', 'b'))
  >>> leaf = LeafSpec('w', (4, 6), np.dtype('float32'), np.dtype('float32'),
  ...                 Layout(mesh, (('a',), ('b',))))
  >>> block_of(leaf, jnp.array([0, 2, 5, 12, 23])).tolist()
  [0, 1, 2, 3, 5]
  """
  sizes, parts = leaf.layout.block_shape(leaf.shape), leaf.layout.parts
  coords, rest = [], positions
  for dim in reversed(leaf.shape):
    coords.append(rest % dim)
    rest = rest // dim
  block = jnp.zeros_like(positions)
  for coord, size, part in zip(reversed(coords), sizes, parts):
    block = block * part + coord // size
  return block


def _segment_keys(plan: Plan, seg: Segment, gaps: jax.Array, start: jax.Array,
                  count: jax.Array, block_starts: jax.Array | None, slots: int
                  ) -> tuple[jax.Array, jax.Array]:
  """A segment's keys in ``slots`` slots (the segment size past ``count``) from the gaps
  stream, and whether they are well formed (in range, ascending within each run, and for a
  leaf split into blocks, each run inside its block: so no position repeats)."""
  index = jnp.arange(slots, dtype=jnp.int32)
  used = index < count
  g = jnp.where(used, jnp.take(gaps, start + index, mode="fill", fill_value=0), 0)
  step = g + jnp.uint32(1)
  running = jnp.cumsum(step)  # modulo 2**32: a wrap needs a key past the size first
  if block_starts is not None:
    run = jnp.sum(index[:, None] >= block_starts[None, :], axis=1) - 1
    first = jnp.clip(block_starts[jnp.maximum(run, 0)], 0, slots - 1)
    running = running - (running[first] - step[first])
  keys = running - jnp.uint32(1)
  size = jnp.uint32(seg.size)
  ok = jnp.all(~used | ((g < size) & (keys < size)))
  out = jnp.where(used, keys.astype(jnp.int32), seg.size)
  if block_starts is not None:
    leaf = plan.leaves[seg.leaf_ids[0]]
    inside = block_of(leaf, jnp.minimum(out, seg.size - 1)) == run
    ok = ok & jnp.all(~used | inside)
  return out, ok


def _segment_values(seg: Segment, codes: jax.Array, start: jax.Array, count: jax.Array,
                    slots: int) -> tuple[jax.Array, jax.Array]:
  """A segment's ulp codes in ``slots`` slots (0 past ``count``) from the codes stream, and
  whether each fits the dtype."""
  k = values_per_change(seg)
  index = jnp.arange(slots, dtype=jnp.int32)
  used = index < count
  at = start + index[:, None] * k + jnp.arange(k)[None, :]
  words = jnp.take(codes, at, mode="fill", fill_value=0)
  z = _from_words(words, seg.bit_dtype)
  top = np.iinfo(seg.bit_dtype).max
  ok = jnp.all(~used | (z < seg.bit_dtype.type(top)))  # z + 1 must not wrap to 0
  return jnp.where(used, from_value_codes(z, seg.bit_dtype), seg.bit_dtype.type(0)), ok


def _words_at(data: jax.Array, start: jax.Array, n: int) -> jax.Array:
  """``uint32[n]``: the words of ``data`` from word ``start`` (0 past its end)."""
  return jnp.take(data, start + jnp.arange(n, dtype=jnp.int32), mode="fill", fill_value=0)


def _bytes_at(data: jax.Array, start: jax.Array, n: int) -> jax.Array:
  """``uint8[n]``: the bytes laid in the words of ``data`` from word ``start``, each word's
  least significant byte first."""
  words = _words_at(data, start, -(-n // 4))
  shifts = jnp.uint32(8) * jnp.arange(4, dtype=jnp.uint32)
  return ((words[:, None] >> shifts) & jnp.uint32(0xFF)).astype(jnp.uint8).reshape(-1)[:n]


def _stream(data: jax.Array, widths_at: jax.Array, words_at: jax.Array, count: jax.Array,
            size: int) -> jax.Array:
  """The first ``count`` values (0 after them, ``uint32[size]``) of a stream whose widths and
  words begin at those words of ``data``: what follows the stream in ``data`` is never read
  into a value."""
  blocks = bitpack.num_blocks(size)
  widths = _bytes_at(data, widths_at, blocks)
  widths = jnp.where(jnp.arange(blocks) < (count + bitpack.BLOCK - 1) // bitpack.BLOCK, widths,
                     jnp.uint8(0))
  return bitpack.unpack(widths, _words_at(data, words_at, bitpack.max_words(size)), count, size)


@functools.partial(jax.jit, static_argnums=(0, 1))
def unpack_program(plan: Plan, slots: tuple[int, ...], data: jax.Array, offsets: jax.Array,
                   counts: jax.Array, block_starts: tuple) -> tuple:
  """Inverse of :func:`pack_program` for a receiver: ``(keys, ulp codes, ok)``, per segment in
  ``slots[s]`` slots (keys: the segment size in unused slots), and whether every key and code
  is well formed. ``data``: ``uint32`` words that hold the chunk's two streams, each of their
  widths and words starting on a word (:func:`aligned_streams`), ``offsets``: the words where
  the key widths, key words, code widths and code words begin;
  ``counts``: per segment, its changes in the streams (0: none); ``block_starts``: per segment
  split into blocks, where each block's run starts among the segment's changes (else None).
  The widths and word counts must be checked on the host."""
  total_keys = sum(slots)
  total_codes = sum(n * values_per_change(seg) for n, seg in zip(slots, plan.segments))
  per_change = jnp.array([values_per_change(seg) for seg in plan.segments], jnp.int32)
  key_start = jnp.cumsum(counts) - counts
  code_start = jnp.cumsum(counts * per_change) - counts * per_change
  gaps = _stream(data, offsets[0], offsets[1], jnp.sum(counts), total_keys)
  codes = _stream(data, offsets[2], offsets[3], jnp.sum(counts * per_change), total_codes)
  keys_out, values_out, ok = [], [], jnp.bool_(True)
  for s, (seg, n) in enumerate(zip(plan.segments, slots)):
    keys, keys_ok = _segment_keys(plan, seg, gaps, key_start[s], counts[s], block_starts[s], n)
    values, values_ok = _segment_values(seg, codes, code_start[s], counts[s], n)
    keys_out.append(keys)
    values_out.append(values)
    ok = ok & keys_ok & values_ok
  return tuple(keys_out), tuple(values_out), ok


def aligned_streams(streams: Sequence[tuple | None], size: int | None = None
                    ) -> tuple[np.ndarray, list]:
  """Chunks' (or units') streams (``(key widths, key words, code widths, code words)`` or
  None) laid in one ``uint32`` buffer of ``size`` words (default: just enough), each array
  starting on a word, as :func:`unpack_program` reads them; and per stream the four word
  offsets (None for None). On the host: a copy of the streams' bytes.

  >>> data, offsets = aligned_streams([(np.array([3, 5], np.uint8), np.array([7], np.uint32),
  ...                                   np.array([1], np.uint8), np.array([9], np.uint32))])
  >>> data.tolist(), offsets
  ([1283, 7, 1, 9], [(0, 1, 2, 3)])
  """
  offsets, at = [], 0
  for stream in streams:
    if stream is None:
      offsets.append(None)
      continue
    starts = []
    for array in stream:
      starts.append(at)
      at += -(-np.asarray(array).nbytes // 4)
    offsets.append(tuple(starts))
  data = np.zeros(at if size is None else size, "<u4")
  view = data.view(np.uint8)
  for stream, starts in zip(streams, offsets):
    for array, start in zip(stream or (), starts or ()):
      raw = np.ascontiguousarray(array, np.asarray(array).dtype.newbyteorder("<")).view(np.uint8)
      view[4 * start:4 * start + raw.size] = raw
  return data, offsets
