"""The packed coding's stages: a sender's changes to a format-3 body, a body to a receiver's
device inputs. The device codes; the host moves words.

Sender (:func:`packed_body`): each chunk with changes runs ``pack_program`` on the device (all
chunks are dispatched at once), which lays its two streams in one buffer as the receiver reads
them; the host then reads every chunk's used lengths in one copy, copies only the used prefix
of each buffer (sliced on the device at one of a few sizes, at most twice what is used; on CPU
devices read in place) in one ``device_get``, and frames them. (Streams of parts, where a part
crosses the link while the next is packed, copy unit by unit: ``packed_units.py``.) Receiver
(:func:`receiver_inputs`): the streams of all chunks staged on one device go there in one copy
(each array on a word);
each chunk is unpacked and checked there from its offsets (one flag per chunk, read before
anything is applied), and replicated over the devices of each segment's leaves, as
``staging.py`` does for the other formats.

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
from typing import NamedTuple, Sequence

import jax
import numpy as np

from jsparse._src.core import bitpack
from jsparse._src.core.chunks import chunks_of
from jsparse._src.core.placement import replicated_on
from jsparse._src.core.plan import Plan
from jsparse._src.core.units import local_value
from jsparse._src.errors import PayloadError
from jsparse._src.sync import programs
from jsparse._src.sync.programs import DeviceChanges, ReceiverInputs
from jsparse._src.sync.staging import replicated_copies, staging_device
from jsparse._src.wire import device_codes, packed
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


def copied_streams(packed: Sequence[tuple]) -> list[tuple[np.ndarray, ...]]:
  """:func:`used_streams` of several ``(outputs, keys, codes)`` at once: their used word
  counts in one copy, then each buffer's used prefix (sliced on the device at one of a few
  sizes, :func:`copy_size`; on CPU devices the whole buffer, read in place) in one
  ``device_get``, the copies in flight together; the four arrays are views of those words."""
  used = jax.device_get([outputs[1] for outputs, _, _ in packed])
  offsets, prefixes = [], []
  for ((words, _), keys, codes), (key_words, code_words) in zip(packed, used):
    at = device_codes.stream_offsets(keys, codes, int(key_words), int(code_words))
    size = copy_size(at[-1])
    offsets.append((at, keys, codes))
    whole = size >= words.shape[0] or in_host_memory(words)
    prefixes.append(words if whole else _prefix(words, size))
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
  launched = []
  for c in chunks_of(plan):
    ids = list(c.segment_ids)
    if not counts[ids].sum():
      launched.append(None)
      continue
    keys = tuple(changes.ranks[s] if modes[s] == Mode.BY_RANK else changes.delta.indices[s]
                 for s in ids)
    block_counts = tuple(changes.block_counts[s] if changes.block_counts else None for s in ids)
    inputs = _replicated((keys, tuple(changes.delta.values[s] for s in ids),
                          tuple(changes.old_values[s] for s in ids), block_counts))
    launched.append(device_codes.pack_program(c.plan, ranked, *inputs[:3],
                                              counts[ids].astype(np.int32), inputs[3]))
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


def on_device(streams: Sequence[tuple | None], device) -> tuple[jax.Array, list]:
  """Streams laid in one ``uint32`` buffer (``device_codes.aligned_streams``) of one of a
  few sizes (:func:`copy_size`: zeros after them, so that the programs that read it compile
  once per doubling), on ``device``; and each stream's word offsets."""
  words = sum(-(-np.asarray(a).nbytes // 4) for stream in streams for a in stream or ())
  data, offsets = device_codes.aligned_streams(streams, copy_size(words))
  return jax.device_put(data, device), offsets


def _block_starts(blocks: int, counts: np.ndarray | None) -> np.ndarray | None:
  """Where each block's run starts among a split segment's changes (None: not split)."""
  if blocks == 1:
    return None
  counts = np.zeros(blocks, np.int64) if counts is None else counts
  return (np.cumsum(counts) - counts).astype(np.int32)


def stage_streams(plan: Plan, flat: Sequence[jax.Array], body: packed.PackedBody) -> list:
  """The host half of :func:`receiver_inputs`: the streams of all chunks staged on a device
  go there in one copy; per chunk ``(device, slots, (words, their offsets, counts), block
  starts)``."""
  slots = programs.slots_needed(plan, body.counts)
  devices = [staging_device(replicated_on(flat[plan.segments[c.segment_ids[0]].leaf_ids[0]]))
             for c in chunks_of(plan)]
  placed = {}  # device: (its words, each of its chunks' offsets)
  for device in dict.fromkeys(devices):
    mine = [k for k, d in enumerate(devices) if d == device]
    data, offsets = on_device([body.streams[k] for k in mine], device)
    placed[device] = (data, dict(zip(mine, offsets)))
  staged = []
  for k, (c, device) in enumerate(zip(chunks_of(plan), devices)):
    ids = list(c.segment_ids)
    data, offsets = placed[device]
    starts = tuple(_block_starts(plan.segments[s].blocks, body.block_counts[s]) for s in ids)
    inputs = (data, np.asarray(offsets[k] or (0,) * 4, np.int32),
              np.asarray(body.counts[ids], np.int32))
    staged.append((device, tuple(slots[s] for s in ids), inputs, starts))
  return staged


def unpack_streams(plan: Plan, flat: Sequence[jax.Array], staged: list,
                   counts: np.ndarray, ranked: tuple[bool, ...]) -> ReceiverInputs:
  """The device half of :func:`receiver_inputs`: unpacks and checks every chunk, then
  replicates each segment's slots over the devices of its leaves."""
  shardings = [replicated_on(flat[seg.leaf_ids[0]]) for seg in plan.segments]
  keys, values = [None] * len(plan.segments), [None] * len(plan.segments)
  checks = []
  for c, (device, chunk_slots, arrays, starts) in zip(chunks_of(plan), staged):
    with jax.default_device(device):
      chunk_keys, chunk_values, ok = device_codes.unpack_program(c.plan, chunk_slots, *arrays,
                                                                 starts)
    checks.append(ok)
    for s, k, v in zip(c.segment_ids, chunk_keys, chunk_values):
      keys[s], values[s] = k, v
  if not all(bool(ok) for ok in checks):
    raise PayloadError("a packed payload names a change out of range or out of order, or "
                       "codes a value wider than its dtype")
  placed = replicated_copies(keys + values, shardings * 2)
  return ReceiverInputs(tuple(placed[:len(keys)]), tuple(placed[len(keys):]), counts,
                        ranked, True)


def receiver_inputs(plan: Plan, flat: Sequence[jax.Array], body: packed.PackedBody
                    ) -> ReceiverInputs:
  """The :class:`~programs.ReceiverInputs` of a checked format-3 ``body`` for a receiver
  holding ``flat``, on its devices.

  Raises:
    PayloadError: a key out of range or out of order, or a code too wide for its dtype.
  """
  return unpack_streams(plan, flat, stage_streams(plan, flat, body), body.counts, body.ranked)
