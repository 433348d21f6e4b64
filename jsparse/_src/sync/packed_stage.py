"""The packed coding's stages: a sender's changes to a format-3 body, a body to a receiver's
device inputs. The device codes; the host moves words.

Sender (:func:`packed_body`): each chunk with changes runs ``pack_program`` on the device (all
chunks are dispatched at once), which lays its two streams in one buffer as the receiver reads
them; the host then reads every chunk's used lengths in one copy, copies only the used prefix
of each buffer (sliced on the device at one of a few sizes, at most twice what is used, once
that size is compiled; on CPU devices read in place) in one ``device_get``, and frames them.
(Streams of parts, where a part crosses the link while the next is packed, copy unit by unit:
``packed_units.py``.) Receiver (:func:`receiver_inputs`): each chunk's streams go to its
device in a buffer sized by its slot level (each array on a word; all chunks in one batched
copy); each chunk is unpacked and checked there from its offsets (one flag per chunk, read
before anything is applied), and replicated over the devices of each segment's leaves, as
``staging.py`` does for the other formats. Both sides' programs take shapes that follow the
slot levels only, compiled ahead with them (``programs.SlotLevels``).

>>> import jax.numpy as jnp, jsparse
>>> params = {'w': jnp.zeros(1000)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> sender = jsparse.Sender(plan, params, coding="packed")
>>> receiver = jsparse.Receiver(plan, plan.cast(params))
>>> data = sender.send({'w': params['w'].at[3].set(1.0).at[500].set(-2.0)})
>>> p = receiver.receive(data)
>>> float(p['w'][3]), float(p['w'][500]), len(data)
(1.0, -2.0, 87)
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core import bitpack
from jsparse._src.core.chunks import Chunk, chunks_of
from jsparse._src.core.placement import replicated_on
from jsparse._src.core.plan import Plan
from jsparse._src.core.units import local_value
from jsparse._src.errors import PayloadError
from jsparse._src.sync import programs
from jsparse._src.sync.programs import DeviceChanges, ReceiverInputs
from jsparse._src.sync.staging import empty_slots, replicated_copies, staging_device
from jsparse._src.device import packing as device_codes
from jsparse._src.wire import packed
from jsparse._src.wire.payload import Mode, segment_host_bits


def copy_size(n: int) -> int:
  """The size a prefix of ``n`` elements is copied at: a power of two (at least 256), so that
  few copy programs compile (one per doubling), at most twice the bytes.

  >>> [copy_size(n) for n in (0, 5, 300, 1000, 1025)]
  [256, 256, 512, 1024, 2048]
  """
  return max(256, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, static_argnums=1)
def _prefix(x: jax.Array, size: int) -> jax.Array:
  return x[:size]


def in_host_memory(x: jax.Array) -> bool:
  """Whether ``x`` is in the host's memory (on CPU devices), where the host reads it in place:
  there a copy of a prefix on the device would only add a copy."""
  return all(d.platform == "cpu" for d in x.devices())


def used_streams(outputs: tuple, keys: int, codes: int) -> tuple[np.ndarray, ...]:
  """The used words of a ``pack_program``'s two streams, as four arrays on the host (key
  widths, key words, code widths, code words); ``keys`` and ``codes``: how many it packed."""
  return copied_streams([(outputs, keys, codes)])[0]


def _streams_in(words: np.ndarray, at: tuple, keys: int, codes: int) -> tuple[np.ndarray, ...]:
  """The four arrays of a chunk's streams, as views of its words (``at``:
  ``device_codes.stream_offsets``; widths are bytes, least significant first in a word)."""
  words = words.astype("<u4", copy=False)
  widths = lambda start, n: words[start:].view(np.uint8)[:bitpack.num_blocks(n)]
  return (widths(at[0], keys), words[at[1]:at[2]], widths(at[2], codes), words[at[3]:at[4]])


def _used_prefix(words: jax.Array, used: int) -> jax.Array:
  """The first :func:`copy_size` words of ``words`` holding its ``used`` ones, to copy: sliced
  on the device at the smallest size compiled that holds them, else the whole buffer, while
  the size they need compiles in the background (``programs.SlotLevels``): no sync compiles a
  copy. On CPU devices, and at sizes past the buffer, the whole buffer (read in place)."""
  size = copy_size(used)
  if size >= words.shape[0] or in_host_memory(words):
    return words
  if jax.process_count() > 1:  # every process runs the same programs: compiled when needed
    return _prefix(words, size)
  family = ("prefix", programs.like(words))
  compiled = [n for n in programs.SLOT_LEVELS.ready(family) if n >= size]
  abstract = programs.like(words)
  programs.SLOT_LEVELS.request(family, size, lambda: _prefix.lower(abstract, size).compile())
  return _prefix(words, min(compiled)) if compiled else words


def copied_streams(packed: Sequence[tuple]) -> list[tuple[np.ndarray, ...]]:
  """:func:`used_streams` of several ``(outputs, keys, codes)`` at once: their used word
  counts in one copy, then each buffer's used prefix (:func:`_used_prefix`) in one
  ``device_get``, the copies in flight together; the four arrays are views of those words."""
  used = jax.device_get([outputs[1] for outputs, _, _ in packed])
  offsets, prefixes = [], []
  for ((words, _), keys, codes), (key_words, code_words) in zip(packed, used):
    at = device_codes.stream_offsets(keys, codes, int(key_words), int(code_words))
    offsets.append((at, keys, codes))
    prefixes.append(_used_prefix(words, at[-1]))
  return [_streams_in(np.asarray(host), *where)
          for host, where in zip(jax.device_get(prefixes), offsets)]


def _replicated(tree):
  """``tree``'s arrays whole on each of their devices: the slots of a leaf the trainer splits
  into blocks are laid out like it (they are small: a few per cent of the leaf)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef,
                            replicated_copies(leaves, [replicated_on(x) for x in leaves]))


def segment_modes(plan: Plan, counts: np.ndarray, overflow: np.ndarray, full: bool,
                  ranked: bool) -> tuple[Mode, ...]:
  """Each segment's record mode in a packed payload (``ranked``: ordered segments by rank)."""
  return tuple(Mode.DENSE if full or overflow[s] else Mode.EMPTY if not counts[s]
               else Mode.BY_RANK if ranked and seg.ordered else Mode.BY_POSITION
               for s, seg in enumerate(plan.segments))


def _pack_job(chunk: Chunk, ranked: bool, by_rank: Sequence[bool], level: int, diff_level: int,
              args: tuple) -> Callable[[], None]:
  """What compiles a chunk's ``pack_program`` at slot ``level``, its diff's at ``diff_level``,
  for arguments like ``args`` (the call's keys, new and old bits, counts and block counts;
  shardings taken now, the job holds no array). ``by_rank``: per segment, whether its keys are
  ranks."""
  keys, new, old, counts, block_counts = args
  ids = range(len(chunk.segment_ids))
  slots = programs.level_slots(chunk.plan, ids, level)
  # The level's slots, but a split segment keeps all the diff's (``sparse_program``), except
  # for its ranks.
  lengths = [n if seg.blocks == 1 else m for n, m, seg in
             zip(slots, programs.level_slots(chunk.plan, ids, diff_level), chunk.plan.segments)]
  abstract = (tuple(programs.like(x, (n if r else m,)) for x, n, m, r in
                    zip(keys, slots, lengths, by_rank)),
              *(tuple(programs.like(x, (m,)) for x, m in zip(xs, lengths)) for xs in (new, old)),
              jax.ShapeDtypeStruct(counts.shape, counts.dtype),
              jax.tree.map(programs.like, block_counts))
  return lambda: device_codes.pack_program.lower(chunk.plan, ranked, *abstract).compile()


class Packing(NamedTuple):
  """A sender's packed chunks in flight on the device (:func:`pack_chunks`)."""

  modes: tuple[Mode, ...]
  counts: np.ndarray
  launched: list


def pack_chunks(plan: Plan, changes: DeviceChanges, full: bool, ranked: bool) -> Packing:
  """The device half of :func:`packed_body`: dispatches ``pack_program`` for every chunk with
  changes (asynchronously: nothing waits here but the counts)."""
  counts = local_value(changes.delta.counts).astype(np.int64)
  overflow = local_value(changes.delta.overflow)
  modes = segment_modes(plan, counts, overflow, full, ranked)
  sparse = np.array([m in (Mode.BY_RANK, Mode.BY_POSITION) for m in modes], bool)
  counts = np.where(sparse, counts, 0)
  launched, requests = [], []
  for k, c in enumerate(chunks_of(plan)):
    ids = list(c.segment_ids)
    # Ranks wherever the changes have them, whatever a segment's mode (its count is 0 if not
    # by rank): the program's shapes do not follow which segments are empty or dense.
    by_rank = [ranked and changes.ranks is not None and changes.ranks[s] is not None
               for s in ids]
    keys = tuple(changes.ranks[s] if r else changes.delta.indices[s] for s, r in zip(ids, by_rank))
    block_counts = tuple(changes.block_counts[s] if changes.block_counts else None for s in ids)
    args = (*_replicated((keys, tuple(changes.delta.values[s] for s in ids),
                          tuple(changes.old_values[s] for s in ids))),
            counts[ids].astype(np.int32), _replicated(block_counts))
    ran = bool(counts[ids].sum())
    if changes.levels:  # compiled at its level by the call, or in the background: the one
      # its changes need and the fallback (the diff's width), as ``sparse_program``'s (the
      # same family), and the level the diff moves to before it moves there
      family, level, needed, ahead = changes.levels[k]
      config, base = ("pack", ranked), family[2]
      if ran:
        programs.SLOT_LEVELS.ran(family, level, config)
      for wanted in sorted({needed, base, level} - ({level} if ran else set())):
        if programs.SLOT_LEVELS.wanted(family, wanted, config):
          requests.append((family, wanted, _pack_job(c, ranked, by_rank, wanted, base, args),
                           config, base))
      if ahead is not None and programs.SLOT_LEVELS.wanted(*ahead, config):
        requests.append((*ahead, _pack_job(c, ranked, by_rank, ahead[1], ahead[1], args),
                         config, None))
    launched.append(device_codes.pack_program(c.plan, ranked, *args) if ran else None)
  for request in requests:  # once this call's programs are dispatched
    programs.SLOT_LEVELS.request(*request)
  return Packing(modes, counts, launched)


def collect_body(plan: Plan, packing: Packing, changes: DeviceChanges, snapshot: list) -> list:
  """The host half of :func:`packed_body`: every chunk's used words copied at once, and laid
  out as the body (a list of buffers, for ``framing.frame`` to join once)."""
  counts, chunks = packing.counts, chunks_of(plan)
  sizes = []
  for c, out in zip(chunks, packing.launched):
    if out is not None:
      ids = list(c.segment_ids)
      sizes.append((out, int(counts[ids].sum()),
                    sum(int(counts[s]) * device_codes.values_per_change(plan.segments[s])
                        for s in ids)))
  copied = iter(copied_streams(sizes))
  streams = [None if out is None else next(copied) for out in packing.launched]
  block_counts = {s: local_value(changes.block_counts[s]) for s in np.flatnonzero(counts)
                  if plan.segments[s].blocks > 1}
  return packed.body_pieces(plan, packing.modes, counts, block_counts, streams,
                            lambda s: segment_host_bits(plan, s, snapshot))


def packed_body(plan: Plan, changes: DeviceChanges, snapshot: list, full: bool,
                ranked: bool = False) -> list:
  """The format-3 body of a sender's ``changes`` as a list of buffers (``snapshot``: the new
  rollout leaves, for dense segments; ``ranked``: ordered segments named by rank, which
  ``changes`` must hold)."""
  return collect_body(plan, pack_chunks(plan, changes, full, ranked), changes, snapshot)


def stream_words(streams: tuple) -> int:
  """The words a chunk's (or unit's) streams fill, each array from a word."""
  return sum(-(-np.asarray(a).nbytes // 4) for a in streams)


def check_fits(streams: tuple, words: int, what: str) -> None:
  """Raises :class:`PayloadError` unless ``streams`` fit in ``words`` words (what the
  streams of the changes they state fill at most)."""
  if stream_words(streams) > words:
    raise PayloadError(f"{what} of a packed payload: streams longer than its {words} words")


def chunk_words(plan: Plan, slots: Sequence[int]) -> int:
  """The words of a chunk's streams buffer on a receiver (``plan``: the chunk's): what the
  streams of any changes in ``slots`` fill, so that its shape follows the slot level only."""
  return device_codes.packed_words(
      sum(slots), sum(n * device_codes.values_per_change(seg)
                      for n, seg in zip(slots, plan.segments)))


def _block_starts(blocks: int, counts: np.ndarray | None) -> np.ndarray | None:
  """Where each block's run starts among a split segment's changes (None: not split)."""
  if blocks == 1:
    return None
  counts = np.zeros(blocks, np.int64) if counts is None else counts
  return (np.cumsum(counts) - counts).astype(np.int32)


class StagedChunk(NamedTuple):
  """A chunk's streams on the receiver's device (:func:`stage_streams`).

  Attributes:
    device: the device its segments are staged on.
    slots: per segment, its slots (at ``level``).
    inputs: ``(words, their offsets, counts)`` of ``unpack_program``; None: no changes.
    starts: per segment, :func:`_block_starts`.
    level: ``(the slot level of its slots, the level its changes need, whether they are
      unpacked: else empty, and the unpacking is not compiled by this call)``.
  """

  device: jax.Device
  slots: tuple[int, ...]
  inputs: tuple | None
  starts: tuple
  level: tuple[int, int]


def stage_streams(plan: Plan, flat: Sequence[jax.Array], body: packed.PackedBody
                  ) -> list[StagedChunk]:
  """The host half of :func:`receiver_inputs`: each chunk's streams to its device, in a
  buffer of :func:`chunk_words` at the slot level ``programs.SlotLevels`` chooses (all of them
  in one batched copy)."""
  chunks, counts = chunks_of(plan), body.counts
  staged, buffers = [], []
  for k, c in enumerate(chunks):
    ids = list(c.segment_ids)
    device = staging_device(replicated_on(flat[plan.segments[ids[0]].leaf_ids[0]]))
    needed = programs.needed_level(plan, ids, counts, lowest=programs.MIN_LEVEL)
    level = programs.SLOT_LEVELS.choose(programs.receiver_family(c, flat), needed)
    slots = programs.level_slots(plan, ids, level)
    starts = tuple(_block_starts(plan.segments[s].blocks, body.block_counts[s]) for s in ids)
    staged.append(StagedChunk(device, slots, None, starts,
                              (level, needed, body.streams[k] is not None)))
    if body.streams[k] is not None:
      words = chunk_words(c.plan, slots)
      check_fits(body.streams[k], words, f"chunk {k}")
      buffers.append((k, *device_codes.aligned_streams([body.streams[k]], words)))
  placed = jax.device_put([data for _, data, _ in buffers],
                          [staged[k].device for k, _, _ in buffers])
  for (k, _, (offsets,)), data in zip(buffers, placed):
    ids = list(chunks[k].segment_ids)
    staged[k] = staged[k]._replace(inputs=(data, np.asarray(offsets, np.int32),
                                           np.asarray(counts[ids], np.int32)))
  return staged


def _chunk_slots(chunk: Chunk, device, slots: Sequence[int], staged: StagedChunk | None = None,
                 compile_only: bool = False):
  """A chunk's keys and ulp codes in ``slots`` on ``device`` and whether they are well formed:
  unpacked from its ``staged`` streams, or for a chunk without changes, empty slots (both
  committed to ``device``, as the programs after them see them). ``compile_only``: compiles
  the programs instead (for any ``staged``)."""
  with jax.default_device(device):
    if compile_only:
      sharding = jax.sharding.SingleDeviceSharding(device)
      words = jax.ShapeDtypeStruct((chunk_words(chunk.plan, slots),), jnp.uint32,
                                   sharding=sharding)
      segments = len(slots)
      device_codes.unpack_program.lower(
          chunk.plan, tuple(slots), words, jax.ShapeDtypeStruct((4,), jnp.int32),
          jax.ShapeDtypeStruct((segments,), jnp.int32),
          tuple(None if seg.blocks == 1 else jax.ShapeDtypeStruct((seg.blocks,), jnp.int32)
                for seg in chunk.plan.segments)).compile()
      for seg, n in zip(chunk.plan.segments, slots):
        empty_slots.lower(n, seg.bit_dtype, np.int32(seg.size)).compile()
      return None
    if staged is not None and staged.inputs is not None:
      return device_codes.unpack_program(chunk.plan, tuple(slots), *staged.inputs, staged.starts)
    empty = [empty_slots(n, seg.bit_dtype, np.int32(seg.size))
             for seg, n in zip(chunk.plan.segments, slots)]
    keys, values = jax.device_put(([k for k, _ in empty], [v for _, v in empty]), device)
    return tuple(keys), tuple(values), True


def _compile_chunk(plan: Plan, devices: Sequence, k: int, slots: Sequence[int]) -> None:
  """Compiles what makes chunk ``k``'s slots for its segments' ``slots`` on ``devices[k]``:
  the ``compile_staging`` of its :class:`~programs.ReceiverInputs`."""
  _chunk_slots(chunks_of(plan)[k], devices[k], slots, compile_only=True)


def unpack_streams(plan: Plan, flat: Sequence[jax.Array], staged: list[StagedChunk],
                   counts: np.ndarray, ranked: tuple[bool, ...]) -> ReceiverInputs:
  """The device half of :func:`receiver_inputs`: unpacks and checks every chunk, then
  replicates each segment's slots over the devices of its leaves."""
  shardings = [replicated_on(flat[seg.leaf_ids[0]]) for seg in plan.segments]
  keys, values = [None] * len(plan.segments), [None] * len(plan.segments)
  checks = []
  for c, chunk in zip(chunks_of(plan), staged):
    chunk_keys, chunk_values, ok = _chunk_slots(c, chunk.device, chunk.slots, chunk)
    checks.append(ok)
    for s, k, v in zip(c.segment_ids, chunk_keys, chunk_values):
      keys[s], values[s] = k, v
  if not all(bool(ok) for ok in checks):
    raise PayloadError("a packed payload names a change out of range or out of order, or "
                       "codes a value wider than its dtype")
  placed = replicated_copies(keys + values, shardings * 2)
  return ReceiverInputs(tuple(placed[:len(keys)]), tuple(placed[len(keys):]), counts,
                        ranked, True, tuple(chunk.level for chunk in staged),
                        functools.partial(_compile_chunk, plan,
                                          tuple(chunk.device for chunk in staged)), "packed")


def receiver_inputs(plan: Plan, flat: Sequence[jax.Array], body: packed.PackedBody
                    ) -> ReceiverInputs:
  """The :class:`~programs.ReceiverInputs` of a checked format-3 ``body`` for a receiver
  holding ``flat``, on its devices.

  Raises:
    PayloadError: a key out of range or out of order, or a code too wide for its dtype.
  """
  return unpack_streams(plan, flat, stage_streams(plan, flat, body), body.counts, body.ranked)
