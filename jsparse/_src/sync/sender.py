"""The trainer side of a sync: :class:`Sender` turns successive params into payloads.

The sender keeps the last synced state in rollout dtypes. Each ``send`` runs two stages:

1. device (``programs.sender_changes``): diff the new params against the snapshot in one jitted
   program, which also produces the next snapshot and its digest, then rank the changes;
2. host (``parts.part_records``, ``wire/parts.py``): code the changes of the units this process
   sends (a whole segment, or the blocks of a split one) into a part, overflowed units densely;
   a version of one process is one part.

>>> import jax.numpy as jnp, jsparse
>>> params = {'w': jnp.zeros((1000,), jnp.float32)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> sender = jsparse.Sender(plan, params)
>>> data = sender.send({'w': params['w'].at[7].set(1.0)})
>>> sender.version, sender.last_stats.changed, len(data) < 200
(1, 1, True)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core.delta import capacity_that_fits
from jsparse._src.core.placement import commit_leaves, place_on_plan_layouts
from jsparse._src.core.layout import mesh_neutral
from jsparse._src.core.plan import Plan
from jsparse._src.errors import ConfigError, VersionError
from jsparse._src.options import float_option, int_option, typed_argument
from jsparse._src.pytree import PyTree
from jsparse._src.core.units import local_value
from jsparse._src.sync import auto, programs
from jsparse._src.sync.parts import (dense_records, every_part, first_process_value,
                                     part_records, processes_with, slowest, spans_processes)
from jsparse._src.sync.stream import Version, produce, start_host_copies, stream_pieces
from jsparse._src.wire.parts import PartHeader, encode_part
from jsparse._src.sync.state import (RUN_BYTES, SyncState, check_digest, check_state,
                                     check_version, digest_bytes, digest_words, state_run,
                                     versioned_digest)
from jsparse._src.sync.receiver import Receiver
from jsparse._src.wire.payload import Coding, Format, Kind


@dataclasses.dataclass(frozen=True)
class SendStats:
  """What the last ``send`` (or ``payload``) carried.

  Attributes:
    version: the version the payload produces.
    changed: elements whose rollout bits changed.
    elements: elements in the whole tree.
    dense_bytes: bytes of the tree in rollout dtypes (what a dense sync sends).
    overflowed_segments: segments carried densely because they overflowed their capacity
      (a Sender logs which, and the capacity that would have held them; see
      :class:`OverflowLog`).
    overflowed_changes: the changes of those segments (sent as their whole segments).
    anchor: whether the payload is an anchor (every segment dense).
    payload_bytes: the bytes of the version (of this process's parts).
    coding: the coding of what was sent (for ``coding="auto"``: the one it chose), on every
      path: ``send`` and ``send_stream``, deltas and anchors.
    coding_rates: for ``coding="auto"``, the rates its choice was made from: per candidate,
      ``(seconds of one sync's work, bytes per change)``; None for a fixed coding, an anchor,
      or before a representative calibration (see ``sync/auto.py``).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(100)})
  >>> sender = jsparse.Sender(plan, {'w': jnp.zeros(100)})
  >>> _ = sender.send({'w': jnp.zeros(100).at[:3].set(1.0)})
  >>> stats = sender.last_stats
  >>> stats.version, stats.changed, stats.density, stats.anchor, stats.overflowed_segments
  (1, 3, 0.03, False, 0)
  """

  version: int
  changed: int
  elements: int
  dense_bytes: int
  overflowed_segments: int
  anchor: bool
  payload_bytes: int | None = None
  overflowed_changes: int = 0
  coding: str | None = None
  coding_rates: dict | None = None

  @property
  def density(self) -> float:
    return self.changed / max(1, self.elements)


WHOLE = 1 << 62  # chunk bytes of a stream of one part per process (what ``Sender.send`` sends)


def anchor_due(version: int, anchor_every: int | None) -> bool:
  """Whether ``version`` carries an anchor under ``anchor_every`` (a :class:`Sender`'s or a
  ``Publisher``'s): its number is a multiple of it.

  >>> [v for v in range(1, 8) if anchor_due(v, 3)], anchor_due(3, None)
  ([3, 6], False)
  """
  return anchor_every is not None and version % anchor_every == 0


def coding_option(coding: Coding | str) -> Coding:
  """``coding`` as a :class:`Coding`, else :class:`ConfigError`."""
  try:
    return Coding(coding)
  except ValueError:
    raise ConfigError(f"coding must be one of {[c.value for c in Coding]}, got {coding!r}") \
        from None


class Sender:
  """Trainer side of a sync: turns successive params into payloads for a :class:`Receiver`.

  Args:
    plan: from :func:`jsparse.make_plan`.
    params: the params the receiver starts from, in trainer or rollout dtypes.
    version: the version ``params`` are (the receiver must start from the same one).
    anchor_every: a version whose number is a multiple of this carries an anchor: it is sent
      as one (the whole state), as ``anchor=True`` does (None: only when asked or needed).
    coding: a :class:`~jsparse.Coding` (or its string): ``"positioned"`` (the default, ~1.35
      bytes per change on RL updates, each side's device passes near one read of the weights),
      ``"ranked"`` (~1 byte per change, the receiver building class tables of its weights: for
      slow links), ``"packed"`` (as small, coded on the device: for accelerators), or
      ``"auto"`` (per version, the fastest over ``link_gbit``, from each coding's time on this
      tree, measured again when the density moves; on every path; see
      :attr:`SendStats.coding` and ``sync/auto.py``).
    link_gbit: the link's bandwidth in Gbit/s, for ``coding="auto"`` (an attribute: set it when
      the link changes).
    max_capacity: how far a segment's slots may widen when its changes outgrow the plan's
      ``capacity``, as a fraction of its elements (default 0.8; past it a segment is sent
      densely: there the packed coding's sparse form nears dense):
      ``capacity`` is a starting point, and a dense step (a high learning rate, a run's
      first steps) is still coded sparsely, from the first delta on; only a density that
      jumps past 3x its slots in one step is carried densely, once. A wider diff takes more
      device memory while it runs: 8 bytes per slot for a bf16 rollout (at most
      ``4 * max_capacity`` times the rollout bytes of the segments that widen), and compiled,
      a bf16 segment's diff takes 3.9x its rollout bytes at 5% and 11.6x widened whole. Its
      programs compile in the background. 0: slots never widen, and a segment over its
      capacity is sent densely. A segment the trainer splits into blocks widens block by
      block (its fullest block sets the level); jobs of several processes keep the capacity.
      See ``programs.DiffWidths``.

  Raises:
    ConfigError: a bad option.
    PlanMismatchError: ``params`` do not match the plan (the leaf is named).

  >>> import jax.numpy as jnp, jsparse
  >>> params = {'w': jnp.zeros(1000)}
  >>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  >>> sender = jsparse.Sender(plan, params, coding="ranked", anchor_every=10)
  >>> _ = sender.send({'w': params['w'].at[:5].set(1.0)})
  >>> sender.last_stats.changed, sender.last_stats.payload_bytes
  (5, 178)
  """

  @mesh_neutral
  def __init__(self, plan: Plan, params: PyTree, *, version: int = 0,
               anchor_every: int | None = None, coding: Coding | str = Coding.POSITIONED,
               link_gbit: float = auto.DEFAULT_LINK_GBIT,
               max_capacity: float = programs.DEFAULT_MAX_CAPACITY):
    self.max_capacity = float_option("max_capacity", max_capacity, minimum=0.0)
    if self.max_capacity > 1.0:
      raise ConfigError(f"max_capacity must be a fraction in [0, 1], got {max_capacity!r}")
    # None: no widening, and no per-version bookkeeping for it
    self._widths = programs.DiffWidths(self.max_capacity) if self.max_capacity else None
    self.anchor_every = int_option("anchor_every", anchor_every, minimum=1, optional=True)
    self.coding = coding_option(coding)
    self._auto = auto.AutoCoding(link_gbit)  # the policy of coding="auto"
    self.plan = typed_argument("plan", plan, Plan, "a jsparse.Plan (from make_plan)")
    self.version = check_version(version)
    self._snapshot, digest = programs.snapshot_and_digest(plan, _on_plan_layouts(plan, params))
    self._bits = digest_bytes(digest)  # of the snapshot's bit patterns
    self._needs_anchor = False  # set when a payload failed after the snapshot moved on
    self._snapshot_lost = False  # a failed diff consumed the snapshot (donated)
    self.run_id: bytes = os.urandom(RUN_BYTES)  # the run's identity in a feed (see engine)
    self._relaid: set[str] = set()  # leaves already warned about (laid out otherwise)
    self._pieces: dict[int, tuple] = {}  # by chunk_bytes: this process's stream pieces
    self.last_stats: SendStats | None = None
    self._overflow_log = OverflowLog()
    self._step_coding = self.coding  # the coding of the step being sent
    self._last_update: auto.Update | None = None  # what the last delta changed

  @property
  def link_gbit(self) -> float:
    """The link's bandwidth in Gbit/s that ``coding="auto"`` chooses for (settable: the next
    send chooses for the new rate)."""
    return self._auto.link_gbit

  @link_gbit.setter
  def link_gbit(self, value: float) -> None:
    self._auto.link_gbit = value

  def state(self) -> SyncState:
    """What a restarted trainer needs to resume without a full resend. The arrays are the live
    snapshot: save them before the next ``send``.

    Raises:
      VersionError: a failed send consumed the snapshot; the next send (an anchor) makes one.
    """
    if self._snapshot_lost:
      raise VersionError("a failed send consumed the sender's snapshot: send the next version "
                         "(an anchor) before saving the state")
    return SyncState.of(self.plan, self.version, self._bits, self.snapshot, self.run_id)

  @classmethod
  def restore(cls, plan: Plan, state: SyncState, *, anchor_every: int | None = None,
              coding: Coding | str = Coding.POSITIONED,
              link_gbit: float = auto.DEFAULT_LINK_GBIT,
              max_capacity: float = programs.DEFAULT_MAX_CAPACITY) -> "Sender":
    """A sender that resumes from ``state`` (from :meth:`state`, e.g. restored by Orbax).

    Raises:
      PlanMismatchError: the state belongs to another plan.
      IntegrityError: the restored snapshot does not match the digest saved with it.
    """
    version, digest, params = check_state(plan, state, rollout_only=False)
    sender = cls(plan, params, version=version, anchor_every=anchor_every, coding=coding,
                 link_gbit=link_gbit, max_capacity=max_capacity)
    check_digest(sender._bits, digest, version)
    sender.run_id = state_run(state) or sender.run_id
    return sender

  def _placed_like_snapshot(self, flat: list) -> list:
    """``flat`` ready to be diffed against the snapshot (see
    :func:`~jsparse._src.core.placement.placed_for_diff`): a leaf the plan holds whole may come
    laid out as the train step left it; one laid out otherwise than the plan's blocks, or on
    other devices, is resharded, with a warning the first time for each leaf."""
    from jsparse._src.core.placement import placed_for_diff
    return placed_for_diff(self.plan, flat, self._snapshot, self._relaid)

  @property
  def digest(self) -> bytes:
    """The 8-byte digest of the synced state (its bit patterns and version) that payloads
    carry."""
    return versioned_digest(self._bits, self.version)

  @property
  def snapshot(self) -> PyTree:
    """The last synced state, in rollout dtypes (what the receiver holds)."""
    return jax.tree.unflatten(self.plan.treedef, self._snapshot)

  @mesh_neutral
  def send(self, params: PyTree, *, anchor: bool = False, version: int | None = None) -> bytes:
    """Returns the bytes that bring a receiver from the current version to the next: a version
    of one part (:meth:`Receiver.receive` takes them). In a multi-controller trainer (one
    process per host, params spanning them) every process calls it with the same arguments
    and gets its own part, coded from the blocks it holds (a leaf held whole by several
    processes is sent by one of them); the parts of all processes together are the version,
    and a receiver takes them as a list, or joined. It is :meth:`send_stream` in one part per
    process, joined (:meth:`Version.join`): to ship a large version as it is coded, a few
    parts per process, use :meth:`send_stream` itself.

    Args:
      params: the new params (trainer or rollout dtypes, the plan's structure and shapes).
      anchor: send this version as an anchor (every segment dense), which a receiver
        accepts on any base version.
      version: the version these params are (e.g. the trainer step); default current + 1.

    Raises:
      PlanMismatchError: ``params`` do not match the plan (the leaf is named).
      VersionError: ``version`` is not newer than the sender's.

    >>> import jax.numpy as jnp, jsparse
    >>> plan = jsparse.make_plan({'w': jnp.zeros(100)}, rollout_dtype=jnp.bfloat16)
    >>> sender = jsparse.Sender(plan, {'w': jnp.zeros(100)})
    >>> data = sender.send({'w': jnp.zeros(100).at[5].set(1.0)})
    >>> receiver = jsparse.Receiver(plan, {'w': jnp.zeros(100, jnp.bfloat16)})
    >>> float(receiver.receive(data)['w'][5]), sender.last_stats.payload_bytes == len(data)
    (1.0, True)
    """
    return self.send_stream(params, anchor=anchor, version=version, chunk_bytes=WHOLE).join()

  def _finish(self, payload_bytes: int, coding: Coding) -> None:
    """Completes ``last_stats`` once a version is all out (this process's ``payload_bytes``),
    and tells ``auto`` what it carried."""
    stats = self.last_stats
    rates = None
    if self.coding is Coding.AUTO and not stats.anchor and self._auto.rates_used is not None:
      rates = {c.value: (r.seconds, r.bytes_per_change) for c, r in self._auto.rates_used.items()}
    self.last_stats = dataclasses.replace(stats, payload_bytes=payload_bytes,
                                          coding=coding.value, coding_rates=rates)
    if not stats.anchor:
      update = auto.Update(stats.changed, stats.elements, stats.overflowed_changes)
      if not spans_processes(self._snapshot):
        self._auto.observe(coding, update, payload_bytes)  # (a process's part is not the version)
      self._last_update = update

  def _coding_for(self, anchor: bool, flat: list) -> Coding:
    """The sender's coding, or for ``"auto"`` its policy's choice (``sync/auto.py``), which
    measures every candidate on this update when it must. An anchor is ``ranked``. In a job of
    several processes all of them calibrate together (:func:`timed_sync`) and send in process
    0's choice (every part of a version is of one coding)."""
    if self.coding is not Coding.AUTO:
      return self.coding
    if anchor:
      self._auto.rates_used = None
      return auto.FEWEST_BYTES
    self._auto.adopt(auto.measured(self.plan), self._last_update)
    new = jax.tree.unflatten(self.plan.treedef, flat)
    choice = self._auto.choose(self._last_update, lambda: auto.calibrate(
        self.plan, self.snapshot, new, timed_sync))
    return auto.CANDIDATES[first_process_value(auto.CANDIDATES.index(choice), self._snapshot)]

  def send_stream(self, params: PyTree, *, anchor: bool = False, version: int | None = None,
                  chunk_bytes: int = 64 << 20) -> Version:
    """The next version as a stream of parts, each covering at most ``chunk_bytes`` of rollout
    data (a larger leaf is a part alone): ship each part as it comes, while the next ones are
    coded (on ``JSPARSE_THREADS`` threads) and the device still diffs. Returns a
    :class:`Version` (an iterator of the part bytes, with their numbers). A receiver checks and
    decodes each part as it arrives (:meth:`Receiver.open_stream`) and applies the version
    when all have arrived; :meth:`Receiver.receive` takes them all at once. Peak host
    memory is a few parts, not the model, even for an anchor.

    The diff runs, and the sender moves to the new version, when this is called; until every
    part has been produced the sender will send an anchor next (a stream dropped halfway never
    reaches a receiver). In a multi-controller trainer every process calls it alike, and the
    parts of all processes together are the version. Arguments and errors as :meth:`send`.

    Raises:
      ConfigError: ``chunk_bytes`` is not a positive int.

    >>> import jax.numpy as jnp, jsparse
    >>> params = {f'w{i}': jnp.zeros(100_000) for i in range(4)}
    >>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
    >>> sender = jsparse.Sender(plan, params)
    >>> parts = list(sender.send_stream(params, anchor=True, chunk_bytes=400_000))
    >>> len(parts), max(len(p) for p in parts) < 420_000, sender.last_stats.payload_bytes
    (2, True, 800376)
    """
    pieces, per_process = self._stream_pieces(chunk_bytes)
    head, changes, snapshot, anchor = self._step(params, anchor, version)
    self._needs_anchor = True  # until the last part is out
    coding = self._step_coding.parts

    def done(total: int) -> None:
      self._needs_anchor = False
      self._finish(total, coding)

    return self._part_stream(
        head, pieces, per_process,
        lambda piece: part_records(self.plan, coding, piece, changes, snapshot, anchor),
        done, None if anchor or coding.format == Format.PACKED
        else functools.partial(start_host_copies, changes))  # packed: the device packs

  def anchor_stream(self, *, chunk_bytes: int = 64 << 20) -> Version:
    """An anchor of the *current* version (the snapshot, every unit dense) as a stream of parts
    of at most ``chunk_bytes`` of rollout data each, without moving to a new version: what a
    publisher offers next to a delta, for rollouts that fell behind or lost their state, with
    no more than a few parts on the host at a time. Every process calls it alike, as
    ``send_stream``. Iterate it to the end before the next ``send``: it reads the snapshot,
    which the next diff replaces.

    Raises:
      VersionError: at version 0 (an anchor must be newer than what a receiver can hold).
      ConfigError: ``chunk_bytes`` is not a positive int.

    >>> import jax.numpy as jnp, jsparse
    >>> params = {f'w{i}': jnp.zeros(100_000) for i in range(4)}
    >>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
    >>> sender = jsparse.Sender(plan, params, version=3)
    >>> stream = sender.anchor_stream(chunk_bytes=400_000)
    >>> receiver = jsparse.Receiver(plan, {k: v.astype(jnp.bfloat16) + 1
    ...                                    for k, v in params.items()})
    >>> _ = receiver.receive(list(stream))
    >>> stream.parts, stream.anchor, receiver.version, float(receiver.params['w0'][0])
    (2, True, 3, 0.0)
    """
    if self.version == 0:
      raise VersionError("an anchor of version 0 would not be newer than any receiver's "
                         "state: send a first version (sender.send(params)) before an "
                         "anchor, or create the Sender with version >= 1")
    pieces, per_process = self._stream_pieces(chunk_bytes)
    head = PartHeader(self.coding.parts.format, Kind.ANCHOR, False, self.version - 1,
                      self.version, bytes(8), self.digest, 0, 1)
    snapshot = self._snapshot
    return self._part_stream(head, pieces, per_process,
                             lambda piece: dense_records(self.plan, piece, snapshot))

  def _stream_pieces(self, chunk_bytes: int) -> tuple[list, int]:
    """This process's pieces of at most ``chunk_bytes`` and the pieces per process (cached:
    the same every step)."""
    chunk_bytes = int_option("chunk_bytes", chunk_bytes, minimum=1)
    if chunk_bytes not in self._pieces:
      self._pieces[chunk_bytes] = stream_pieces(self.plan, self._snapshot, chunk_bytes)
    return self._pieces[chunk_bytes]

  def _part_stream(self, head: PartHeader, pieces: list, per_process: int,
                   records_of, done=None, prefetch=None) -> Version:
    """This process's parts of the version ``head`` states, piece ``k`` coded from
    ``records_of(piece)`` as part ``process * per_process + k`` (see :func:`stream.produce`)."""
    head = dataclasses.replace(head, parts=per_process * jax.process_count())
    first = jax.process_index() * per_process

    threads = 1 if len(pieces) > 1 else None  # the pool codes parts side by side, else units

    def encode(k: int, piece: tuple) -> bytes:
      return encode_part(self.plan, dataclasses.replace(head, part=first + k), piece,
                         records_of(piece), threads=threads)

    return Version(range(first, first + per_process), head.parts,
                      produce(pieces, encode, done or (lambda total: None), prefetch),
                      version=head.version, base_version=head.base_version,
                      anchor=head.kind == Kind.ANCHOR)

  @mesh_neutral
  def _step(self, params: PyTree, anchor: bool, version: int | None) -> tuple:
    """Diffs ``params`` against the snapshot in the step's coding (``_step_coding``: for
    ``"auto"``, the one chosen for it) and moves to the new version: (the parts' header, the
    changes on the devices, the next snapshot, whether the version is an anchor)."""
    version = check_version(self.version + 1 if version is None else version)
    if version <= self.version:
      raise VersionError(f"version {version} must be newer than the sender's {self.version}: "
                         f"pass one above {self.version}, or none (the next is "
                         f"{self.version + 1})")
    base_bits = self._bits  # the snapshot's digest, which its changes update
    if self._snapshot_lost:  # a failed diff consumed it: start again from these params
      self._snapshot, base = programs.snapshot_and_digest(self.plan,
                                                          _on_plan_layouts(self.plan, params))
      base_bits = digest_bytes(base)
      self._snapshot_lost, self._needs_anchor = False, True
    # A multi-process trainer sends an anchor if any process must (its encode failed): all
    # parts of a version are of one kind.
    needs_anchor = bool(processes_with(self._needs_anchor, self._snapshot))
    anchor = anchor or needs_anchor or anchor_due(version, self.anchor_every)
    flat = self._placed_like_snapshot(commit_leaves(self.plan.flatten(params, what="params")))
    self._step_coding = self._coding_for(anchor, flat)
    snapshot_ids = {id(x) for x in self._snapshot}  # the snapshot is donated below
    flat = [jnp.copy(x) if id(x) in snapshot_ids else x for x in flat]
    old = self._snapshot
    try:
      changes, self._snapshot, digest = programs.sender_changes(
          self.plan, self._step_coding, old, flat, base_digest=digest_words(base_bits),
          ranks=not anchor, widths=self._widths)
    except BaseException:
      if any(x.is_deleted() for x in old):  # donated: only an anchor from new params is exact
        self._snapshot_lost = self._needs_anchor = True
      raise
    new_bits = digest_bytes(digest)
    head = PartHeader(self._step_coding.parts.format, Kind.ANCHOR if anchor else Kind.DELTA,
                      self._step_coding.ranked and not anchor, self.version, version,
                      self.digest, versioned_digest(new_bits, version), 0, 1)
    self.version, self._bits = version, new_bits  # the snapshot has moved: so do they
    counts = local_value(changes.delta.counts).astype(np.int64)
    overflowed = [] if anchor else np.flatnonzero(local_value(changes.delta.overflow)).tolist()
    self.last_stats = SendStats(version, int(counts.sum()), self.plan.num_elements,
                                self.plan.rollout_bytes, len(overflowed), anchor,
                                overflowed_changes=int(counts[overflowed].sum()))
    if overflowed:
      self._overflow_log.report(self.plan, version, counts, overflowed)
    return head, changes, self._snapshot, anchor


class OverflowLog:
  """A Sender's warnings about segments that overflowed their capacity (carried densely, so
  exact, but dense): the first at once, then at most one per ``every_seconds`` with how many
  versions overflowed in between. Each names the segments and the capacity that would have
  held them.

  >>> import logging, jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(100_000)}, capacity=0.01)
  >>> sender = jsparse.Sender(plan, {'w': jnp.zeros(100_000)}, max_capacity=0)  # static slots
  >>> _ = sender.send({'w': jnp.ones(100_000).at[::2].set(0.0)})  # 50% changed: logged
  >>> sender.last_stats.overflowed_segments, sender.last_stats.overflowed_changes
  (1, 50000)
  """

  def __init__(self, every_seconds: float = 60.0):
    self.every_seconds = every_seconds
    self._last = -float("inf")
    self._quiet = 0  # overflowed versions not logged since the last warning

  def report(self, plan: Plan, version: int, counts: np.ndarray, overflowed: list) -> None:
    now = time.monotonic()
    if now - self._last < self.every_seconds:
      self._quiet += 1
      return
    named = "; ".join(
        f"{plan.describe_segment(s)}: {int(counts[s]):,} changes for "
        f"{plan.segments[s].capacity:,} slots ({capacity_that_fits(plan, s, int(counts[s]))} "
        "would fit)" for s in overflowed[:3])
    more = f"; and {len(overflowed) - 3} more" if len(overflowed) > 3 else ""
    quiet = f" ({self._quiet} more overflowed versions since the last warning)" \
        if self._quiet else ""
    logging.getLogger("jsparse").warning(
        "jsparse: version %d carries %d segment(s) densely, over their capacity: %s%s%s. Exact, "
        "but dense; SendStats.overflowed_segments counts them", version, len(overflowed),
        named, more, quiet)
    self._last, self._quiet = now, 0


def _on_plan_layouts(plan: Plan, params: PyTree) -> list:
  """``params``' leaves, committed to devices and laid out as the plan's (a snapshot's
  source)."""
  return place_on_plan_layouts(plan, commit_leaves(plan.flatten(params, what="params")),
                               what="params")


_TIMED_REPEATS = 2


def timed_sync(coding: Coding, plan, old: Any, new: Any) -> tuple[float, int, auto.Update]:
  """Best seconds of a send and a receive of ``old`` to ``new``, the payload bytes and what
  the update changed (what ``auto.calibrate`` measures each coding by). In a job of several
  processes every process calls it alike: each receives every process's part, and the
  seconds are the slowest process's."""
  flat = jax.tree.leaves(old)
  best, size, update = float("inf"), 0, None
  for _ in range(_TIMED_REPEATS + 1):  # the first compiles
    # Copies: a throwaway sender's diff and receiver's apply donate what they hold. At the
    # capacity: a fresh sender's first delta would run at its widest slots, not as the next.
    sender = Sender(plan, jax.tree.map(jnp.copy, old), coding=coding, max_capacity=0)
    receiver = Receiver(plan, jax.tree.map(jnp.copy, old))
    jax.block_until_ready((sender.snapshot, receiver.params))
    start = time.perf_counter()
    data = sender.send(new)
    seconds = time.perf_counter() - start
    parts = every_part(data, flat)  # (the link: not timed)
    start = time.perf_counter()
    jax.block_until_ready(receiver.receive(parts))
    best = min(best, slowest(seconds + time.perf_counter() - start, flat))
    size = sum(map(len, parts))
    stats = sender.last_stats
    update = auto.Update(stats.changed, stats.elements, stats.overflowed_changes)
    del sender, receiver
  return best, size, update
