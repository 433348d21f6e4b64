"""The body of a packed (format 3) payload: the changes bit-packed on the device, framed here.

The device (``device/packing.py``) codes every change; the host only frames the words it gets
back, and a receiver's host only checks the framing and hands the words to its devices. Per
chunk of the plan (``core/chunks.py``) that has changes, two streams: the key gaps and the
value codes, each a run of fixed-width blocks of 32 values (``core/bitpack.py``). The body::

  segment table   per segment: mode u8 | count u32 (changes; DENSE: the segment size);
                  modes EMPTY, DENSE, BY_POSITION, or BY_RANK for ordered segments (a
                  payload names the changes of all its ordered segments alike)
  block counts    per sparse segment the trainer splits into blocks: u32 changes per block
  streams         per chunk with changes, keys then codes, each:
                    blocks u32 | widths u8[blocks] | words u32[...]: the values of each
                    block at its width, end to end (the last block's only), in whole words
  dense           the DENSE segments' bit patterns, little-endian

Decoding checks every count against the plan, each stream's block count against the changes
it must hold, every width (at most 32) and the word count against the widths, before anything
reaches a device; the keys and codes are checked on the device (``unpack_program``).

>>> import numpy as np
>>> stream = encode_stream(np.array([5], np.uint8), np.arange(4, dtype=np.uint32))
>>> r = Reader(stream); read_stream(r, 20, 'keys')[0].tolist(), r.remaining  # 20 5-bit values
([5], 0)
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable, Sequence

import numpy as np

from jsparse._src.core import bitpack
from jsparse._src.core.chunks import chunks_of
from jsparse._src.core.plan import Plan, Segment
from jsparse._src.errors import PayloadError
from jsparse._src.device.packing import values_per_change
from jsparse._src.wire.payload import (RECORD, Kind, Mode, SegmentPayload, check_modes,
                                       ranked_segments)
from jsparse._src.wire.reader import Reader

_U32 = struct.Struct("<I")


@dataclasses.dataclass(frozen=True)
class PackedBody:
  """A format-3 body, framing checked, its streams still packed.

  Attributes:
    modes: per segment, its :class:`Mode`.
    counts: ``int32[segments]``, per segment its changes in the streams (0: dense or empty).
    block_counts: per segment split into blocks and sparse, its changes per block (else
      None).
    streams: per chunk of the plan, ``(key widths, key words, code widths, code words)`` as
      numpy arrays, or None when the chunk has no changes.
    dense: the DENSE segments' bit patterns, by segment.
    ranked: per segment, whether its keys are ranks (all the ordered segments, or none).
  """

  modes: tuple[Mode, ...]
  counts: np.ndarray
  block_counts: tuple
  streams: tuple
  dense: dict
  ranked: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class PackedRecord:
  """A sparse unit's record in a packed part (``wire/parts.py``): ``count`` changes of
  ``mode`` (``BY_RANK``, ``BY_POSITION``; ``EMPTY``: none, ``streams`` None), their
  ``streams`` as :attr:`PackedBody.streams` has them per chunk."""

  mode: Mode
  count: int
  streams: tuple | None


def encode_unit(record) -> bytes:
  """A unit's body in a packed part: a :class:`PackedRecord`'s streams, or a dense record's
  bits (little-endian)."""
  if record.mode == Mode.DENSE:
    return np.ascontiguousarray(record.values, record.values.dtype.newbyteorder("<")).tobytes()
  return streams_bytes(record.streams)


def streams_bytes(streams: tuple) -> bytes:
  """A chunk's (or unit's) key stream then code stream, as the body holds them."""
  return b"".join(stream_pieces(streams))


def stream_pieces(streams: tuple) -> list:
  """:func:`streams_bytes` as a list of buffers (nothing copied), to join once with others."""
  return [*_pieces(*streams[:2]), *_pieces(*streams[2:])]


def _pieces(widths: np.ndarray, words: np.ndarray) -> list:
  return [_U32.pack(len(widths)), np.ascontiguousarray(widths, np.uint8).data,
          np.ascontiguousarray(words, "<u4").data]


def decode_unit(slot: Segment, mode: Mode, count: int, reader: Reader, where: str):
  """Inverse of :func:`encode_unit` for a unit of ``slot`` whose table entry states ``mode``
  and ``count``: a dense ``SegmentPayload``, or a :class:`PackedRecord` whose streams are
  checked as far as the host can (their keys and codes are checked on the device)."""
  if mode == Mode.DENSE:
    return SegmentPayload(Mode.DENSE, None, reader.array(slot.bit_dtype, slot.size,
                                                         f"{where} dense"))
  keys = read_stream(reader, count, f"{where} keys")
  codes = read_stream(reader, count * values_per_change(slot), f"{where} codes")
  return PackedRecord(Mode(mode), count, (*keys, *codes))


def encode_stream(widths: np.ndarray, words: np.ndarray) -> bytes:
  """One packed stream's bytes: its block count, widths and words."""
  return b"".join(_pieces(widths, words))


def read_stream(reader: Reader, values: int, what: str) -> tuple[np.ndarray, np.ndarray]:
  """The widths and words of a stream that must hold ``values`` values, checked."""
  (blocks,) = _U32.unpack(reader.take(_U32.size, f"{what} block count"))
  if blocks != bitpack.num_blocks(values):
    raise PayloadError(f"{what}: {blocks} blocks for {values} values")
  widths = reader.array(np.uint8, blocks, f"{what} widths")
  if blocks and int(widths.max()) > 32:
    raise PayloadError(f"{what}: a block of width {int(widths.max())} (at most 32)")
  words = reader.array(np.uint32, bitpack.num_words(widths, values), f"{what} words")
  return widths, words


def encode_body(plan: Plan, modes: Sequence[Mode], counts: np.ndarray, block_counts: dict,
                streams: Sequence, dense: Callable[[int], np.ndarray]) -> bytes:
  """A format-3 body. ``counts``: per segment, its changes (dense: ignored); ``block_counts``:
  by split sparse segment, its changes per block; ``streams``: per chunk, the four arrays of
  its streams (see :class:`PackedBody`) or None; ``dense(s)``: segment ``s``'s bits."""
  return b"".join(body_pieces(plan, modes, counts, block_counts, streams, dense))


def body_pieces(plan: Plan, modes: Sequence[Mode], counts: np.ndarray, block_counts: dict,
                streams: Sequence, dense: Callable[[int], np.ndarray]) -> list:
  """:func:`encode_body` as a list of buffers: the streams' and dense segments' arrays are
  not copied, so that framing joins the whole payload once."""
  out = []
  for s, (seg, mode) in enumerate(zip(plan.segments, modes)):
    out.append(RECORD.pack(mode, seg.size if mode == Mode.DENSE else int(counts[s])))
  for s, seg in enumerate(plan.segments):
    if seg.blocks > 1 and modes[s] not in (Mode.DENSE, Mode.EMPTY):
      out.append(np.asarray(block_counts[s], "<u4").tobytes())
  for stream in streams:
    if stream is not None:
      out += stream_pieces(stream)
  for s, mode in enumerate(modes):
    if mode == Mode.DENSE:
      bits = dense(s)
      out.append(np.ascontiguousarray(bits, bits.dtype.newbyteorder("<")).data)
  return out


def _table(plan: Plan, kind: Kind, reader: Reader) -> tuple[list[Mode], np.ndarray]:
  modes, counts = [], np.zeros(len(plan.segments), np.int64)
  for s, seg in enumerate(plan.segments):
    if reader.remaining < RECORD.size:  # a segment is named only in an error (naming every
      # one would cost a sync more than reading the table)
      raise PayloadError(f"payload truncated while reading {plan.describe_segment(s)} record")
    mode, count = RECORD.unpack(reader.take(RECORD.size, "a segment record"))
    sparse = (Mode.BY_RANK, Mode.BY_POSITION) if seg.ordered else (Mode.BY_POSITION,)
    if kind == Kind.ANCHOR and mode in (Mode.EMPTY, *sparse):
      raise PayloadError("an anchor payload must carry every segment densely")
    problem = None
    if mode not in (Mode.EMPTY, Mode.DENSE, *sparse):
      problem = (f"mode {mode} in a packed payload (expected EMPTY, DENSE or "
                 f"{' or '.join(m.name for m in sparse)})")
    elif mode == Mode.DENSE and count != seg.size:
      problem = f"a dense record of {count} elements, the segment has {seg.size}"
    elif mode == Mode.EMPTY and count:
      problem = f"an empty record with {count} changes"
    elif mode in sparse and not 0 < count <= seg.sparse_limit:
      problem = f"{count} changes, at most {seg.sparse_limit} in a sparse record"
    if problem:
      raise PayloadError(f"{plan.describe_segment(s)}: {problem}")
    modes.append(Mode(mode))
    counts[s] = count if mode in sparse else 0
  check_modes(plan, modes)
  return modes, counts


def decode_body(plan: Plan, kind: Kind, reader: Reader) -> PackedBody:
  """Reads and checks a format-3 body (see the module docstring)."""
  modes, counts = _table(plan, kind, reader)
  block_counts = [None] * len(plan.segments)
  for s, seg in enumerate(plan.segments):
    if seg.blocks > 1 and counts[s]:
      where = plan.describe_segment(s)
      per_block = reader.array(np.uint32, seg.blocks, f"{where} block counts").astype(np.int64)
      block = seg.size // seg.blocks  # (a sender widens a block's slots up to its size)
      if per_block.sum() != counts[s] or per_block.max() > block:
        raise PayloadError(f"{where}: block counts {per_block.tolist()} do not add up to "
                           f"{counts[s]} changes within {block} per block")
      block_counts[s] = per_block
  streams = []
  for k, chunk in enumerate(chunks_of(plan)):
    ids = list(chunk.segment_ids)
    keys = int(counts[ids].sum())
    codes = sum(int(counts[s]) * values_per_change(plan.segments[s]) for s in ids)
    streams.append(None if not keys else (*read_stream(reader, keys, f"chunk {k} keys"),
                                          *read_stream(reader, codes, f"chunk {k} codes")))
  dense = {}
  for s, mode in enumerate(modes):
    if mode == Mode.DENSE:
      seg = plan.segments[s]
      dense[s] = reader.array(seg.bit_dtype, seg.size, f"{plan.describe_segment(s)} dense")
  if reader.remaining:
    raise PayloadError(f"{reader.remaining} unexpected bytes after the last segment")
  return PackedBody(tuple(modes), counts.astype(np.int32), tuple(block_counts), tuple(streams),
                    dense, ranked_segments(plan, modes))
