"""The payload vocabulary: what a sync payload says, independent of its bytes.

A :class:`Payload` brings a receiver from ``base_version`` to ``version``: per segment of the
plan one :class:`SegmentPayload` record, whose :class:`Mode` says how its changes are named and
valued. :class:`Format` is the body layout on the wire (``compact.py``, ``packed.py``);
:class:`Coding` is the user's choice of format and naming. :func:`sparse_record` builds a
record from changes moved to the host; :func:`check_records` states what every record must
satisfy (the decoders and the checkpoint reader both rely on it).

>>> import numpy as np, jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
>>> record = SegmentPayload(Mode.BY_POSITION, np.array([3], np.int32), np.array([7], np.uint32))
>>> payload = Payload(Kind.DELTA, 0, 1, bytes(8), bytes(8), (record,))
>>> check_records(plan, payload) is payload, Coding("packed").format
(True, <Format.PACKED: 3>)
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Sequence

import numpy as np

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.plan import Plan, Segment
from jsparse._src.core.units import local_value
from jsparse._src.errors import PayloadError
from jsparse._src.device import ulp_codes

MAX_VERSION = 2**63  # versions are int64 in a SyncState
RECORD = struct.Struct("<BI")  # a segment's entry in a compact body: mode u8, count u32


class Format(enum.IntEnum):
  """The body layout of a payload on the wire (1, positions and raw bits, is retired)."""
  COMPACT = 2  # gap-coded ranks or positions and ulp codes, zstd'd: ~1 B/change on RL updates
  PACKED = 3   # the same keys and codes bit-packed on the device: ~1 B/change, no host coding


class Kind(enum.IntEnum):
  """Whether a payload applies to one base version only, or to any."""
  DELTA = 0   # the changes since ``base_version``
  ANCHOR = 1  # every segment dense: accepted on any base


class Mode(enum.IntEnum):
  """How one segment record names its changes (indices) and gives their values (1 and 2,
  retired format 1's lists and bitmaps, are unused)."""
  EMPTY = 0        # nothing changed
  DENSE = 3        # the whole segment's bit patterns, no indices
  BY_RANK = 4      # ranks in the exponent-class order, ulp codes
  BY_POSITION = 5  # positions, ulp codes


class Coding(str, enum.Enum):
  """How a :class:`~jsparse.Sender` codes its versions (a string works too: ``"packed"``).

  Two codings, one per place the coding can run, and the default between them:

  - ``RANKED``: coded on the host (format 2): changes named by rank in the exponent-class order
    where the plan allows, values as ulp codes, gap-coded and zstd'd: the fewest bytes
    (~1 B/change on RL updates), for slow links and hosts that code while the devices train;
    the receiver builds class tables of its params for every version (on a CPU, a
    21M-parameter model's 1.3% step: its device passes 8.8x a dense copy).
  - ``PACKED``: the same ranks and ulp codes bit-packed in blocks of 32 on the device
    (format 3, ``device/packing.py``): as few bytes, and no per-change work on either host
    (it only moves the packed words): for accelerators.
  - ``POSITIONED`` (the default): ``RANKED`` with changes named by position: ~1.3x its bytes,
    and no pass over the params on either side beyond the diff and the writes (same step:
    receive 1.9x a dense copy). Kept beside the two because it is the fastest end to end
    where the device passes decide: on a 2-core CPU, a 21M-parameter model's 1.3% step synced
    in 137-164 ms at 100-0.1 Gbit/s, against 217-238 ms (``RANKED``) and 224-246 ms
    (``PACKED``): 1.45-1.64x faster (the benchmark's methods table, ``--only sync``).
  - ``AUTO``: per version, the one of the above that syncs fastest over the Sender's
    ``link_gbit``, predicted from each coding's time on the sender's tree, measured on a
    representative delta and again when the density moves (``sync/auto.py``); on payloads,
    parts and streams alike, in jobs of several processes (process 0's choice) and delta
    checkpoint chains; recorded in :attr:`SendStats.coding`. Anchors carry ``RANKED``.

  >>> import jsparse
  >>> coding = jsparse.Coding("positioned")
  >>> coding.format, coding.ranked
  (<Format.COMPACT: 2>, False)
  """
  RANKED = "ranked"
  POSITIONED = "positioned"
  PACKED = "packed"
  AUTO = "auto"

  @property
  def format(self) -> Format:
    return Format.PACKED if self is Coding.PACKED else Format.COMPACT

  @property
  def ranked(self) -> bool:
    return self is not Coding.POSITIONED

  @property
  def parts(self) -> "Coding":
    """The coding of this coding's parts and streams: its own (packed on the device for the
    packed coding), ``RANKED`` for ``AUTO`` where it has not chosen (anchors)."""
    return Coding.RANKED if self is Coding.AUTO else self


@dataclasses.dataclass(frozen=True)
class SegmentPayload:
  """One segment's record.

  Attributes:
    mode: a :class:`Mode` of the payload's format.
    indices: ``int32``, ascending: positions (or ranks for ``BY_RANK``) of the changes; None for
      ``DENSE``.
    values: the new bit patterns (``DENSE``: the whole segment) or ulp codes (``BY_RANK``,
      ``BY_POSITION``), unsigned ints of the rollout dtype's width.
  """

  mode: Mode
  indices: np.ndarray | None
  values: np.ndarray

  @property
  def count(self) -> int:
    """Changes carried sparsely (0 for dense records, which carry the whole segment)."""
    return 0 if self.mode == Mode.DENSE else len(self.indices)


@dataclasses.dataclass(frozen=True)
class Payload:
  """A decoded payload: what it applies to, what it produces, and the segments' records."""

  kind: Kind
  base_version: int
  version: int
  base_digest: bytes
  new_digest: bytes
  segments: tuple[SegmentPayload, ...]


def ranked_segments(plan: Plan, modes: Sequence[Mode]) -> tuple[bool, ...]:
  """Which segments' indices are ranks, for a payload with these record ``modes``: the ordered
  segments, unless the payload names changes of an ordered segment by position (then none: a
  payload does not mix the two). Stable across payloads of one coding, so the receiver's
  programs do not recompile when other segments happen to be empty."""
  by_position = any(m == Mode.BY_POSITION and seg.ordered for seg, m in zip(plan.segments, modes))
  return tuple(seg.ordered and not by_position for seg in plan.segments)


def segment_host_bits(plan: Plan, segment_id: int, flat: Sequence) -> np.ndarray:
  """The flat host bit patterns of one segment of rollout leaves ``flat`` (a dense record)."""
  seg = plan.segments[segment_id]
  parts = [bits_lib.np_to_bits(local_value(flat[i])).reshape(-1) for i in seg.leaf_ids]
  return parts[0] if len(parts) == 1 else np.concatenate(parts)


def sparse_record(seg: Segment, positions: np.ndarray, values: np.ndarray,
                  old: np.ndarray, ranks: np.ndarray | None) -> SegmentPayload:
  """The record of changes at ascending ``positions`` of ``seg`` (new bits ``values``, old bits
  ``old``; their ``ranks`` if they are to be named by rank)."""
  codes = ulp_codes.ulp_codes(old, values, seg.dtype, np)
  if ranks is not None:  # by class, then position: a stable sort
    order = np.argsort(ulp_codes.exponent_class(old, seg.dtype, np), kind="stable")
    return SegmentPayload(Mode.BY_RANK, ranks[order], codes[order])
  return SegmentPayload(Mode.BY_POSITION, positions, codes)


def check_records(plan: Plan, payload: Payload) -> Payload:
  """Returns ``payload`` if every record is well formed for ``plan``, else raises.

  Raises:
    PayloadError: versions that do not increase or reach 2**63; naming the segment: a mode
      that is none of :class:`Mode`, a dense record of the wrong size, indices out of range,
      unsorted or repeated (so never more changes than the segment's size), ranks for a
      segment that has no rank order, a payload mixing ranks and positions in ordered
      segments, an anchor with sparse records, values of the wrong width.
  """
  if len(payload.segments) != len(plan.segments):
    raise PayloadError(f"payload has {len(payload.segments)} segments, the plan "
                       f"{len(plan.segments)}")
  check_versions(payload)
  for s, part in enumerate(payload.segments):
    check_record(plan, payload, s, part)
  check_modes(plan, [p.mode for p in payload.segments])
  return payload


def check_versions(payload: Payload) -> None:
  """Raises unless the payload's versions increase and stay below 2**63."""
  if not 0 <= payload.base_version < payload.version < MAX_VERSION:
    raise PayloadError(f"payload turns version {payload.base_version} into {payload.version}: "
                       f"versions must increase and stay below 2**63")


def check_record(plan: Plan, payload: Payload, s: int, part: SegmentPayload) -> None:
  """Raises unless ``part`` is a well-formed record of segment ``s`` in a payload of
  ``payload``'s format and kind (its segments are not looked at): see
  :func:`check_records`."""
  seg = plan.segments[s]
  where = plan.describe_segment(s)
  if part.mode not in tuple(Mode):
    raise PayloadError(f"{where}: mode {part.mode} is none of {[m.name for m in Mode]}")
  if np.dtype(part.values.dtype) != seg.bit_dtype:
    raise PayloadError(f"{where}: values are {part.values.dtype}, expected {seg.bit_dtype}")
  if part.mode == Mode.DENSE:
    if part.indices is not None or len(part.values) != seg.size:
      raise PayloadError(f"{where}: a dense record of {len(part.values)} elements, the "
                         f"segment has {seg.size}")
    return
  if payload.kind == Kind.ANCHOR:
    raise PayloadError("an anchor payload must carry every segment densely")
  indices = part.indices
  if part.mode == Mode.EMPTY and len(indices):
    raise PayloadError(f"{where}: an empty record with {len(indices)} changes")
  if len(indices) != len(part.values) or len(indices) > seg.sparse_limit:
    raise PayloadError(f"{where}: {len(indices)} indices, {len(part.values)} values, "
                       f"at most {seg.sparse_limit} in a sparse record")
  if part.mode == Mode.BY_RANK and not seg.ordered:
    raise PayloadError(f"{where}: ranks in exponent order for a segment without that order")
  if len(indices) and (indices[0] < 0 or indices[-1] >= seg.size
                       or np.any(np.diff(indices) <= 0)):
    kind = "ranks" if part.mode == Mode.BY_RANK else "positions"
    raise PayloadError(f"{where}: {kind} out of range [0, {seg.size}), unsorted or repeated")


def check_modes(plan: Plan, modes: Sequence[Mode]) -> None:
  """Raises if the records' ``modes`` name changes by rank in some ordered segments and by
  position in others."""
  if Mode.BY_RANK in modes and any(m == Mode.BY_POSITION and seg.ordered
                                   for seg, m in zip(plan.segments, modes)):
    raise PayloadError("a payload names changes by rank in some ordered segments and by "
                       "position in others")
