"""The rollout side of an engine: :class:`Subscriber` applies a feed's versions, in order.

``poll`` applies everything available: the delta from the version it holds while the chain
continues, else the newest anchor. A version whose parts fail (corrupt, truncated, lost) is read
again once (a resend); if it fails again it is skipped and an anchor is requested, and until one
arrives only anchors are taken. A rollout never applies versions out of order, and ``version``
is always the policy version it serves (stamp samples with it).

>>> import tempfile, jax.numpy as jnp, jsparse
>>> from jsparse._src.engine.feed import DirectoryFeed
>>> from jsparse._src.engine.publisher import Publisher
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
>>> feed = DirectoryFeed(tempfile.mkdtemp())
>>> publisher = Publisher(jsparse.Sender(plan, {'w': jnp.zeros(8)}), feed)
>>> subscriber = Subscriber(jsparse.Receiver(plan, {'w': jnp.zeros(8, jnp.bfloat16)}), feed)
>>> for i in range(3):
...   _ = publisher.publish({'w': jnp.full(8, float(i))})
>>> subscriber.poll(), subscriber.version
([1, 2, 3], 3)
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import jax

from jsparse._src.engine.agreement import agreed_bytes, agreed_entry, agreed_int
from jsparse._src.engine.feed import Entry, Feed
from jsparse._src.engine.ledger import Ledger
from jsparse._src.engine.records import Commit, Status, check_rollout_id, status_record
from jsparse._src.engine.signing import SigningKey, key_argument
from jsparse._src.errors import (IntegrityError, PartsLostError, PayloadError, StalenessError,
                                 VersionError)
from jsparse._src.options import feed_argument, float_option, int_option, typed_argument
from jsparse._src.pytree import PyTree
from jsparse._src.sync import parts as parts_lib
from jsparse._src.sync.receiver import NEEDS_ANCHOR, Receiver

_FAILURES = (PayloadError, IntegrityError, VersionError, PartsLostError)
_TRAINER_PROCESSES = 1024  # the default bound of a version's parts: this many times the units
_TRANSIENT = PayloadError("damaged or missing parts")  # read them again once
# What a rollout does about a version it cannot use (the trainer's Publisher answers a request
# with an anchor at its next publish): nothing for the user to do while the trainer publishes.
_ASKS = ("the rollout asked the trainer for an anchor (its Publisher adds one at its next "
         "publish; if none comes, check that the trainer still publishes into this feed)")


@dataclasses.dataclass(frozen=True)
class Weights:
  """The weights a rollout serves now: stamp every sample generated with them, so that the
  trainer can reject or correct samples by staleness.

  Attributes:
    version: the policy version (None: no version of the run yet).
    digest: the digest of the rollout's state (hex), verified against the trainer's.
    generation: the trainer generation it follows.
    run: the run (hex).

  >>> Weights(version=3, digest="00" * 8, generation=1, run="ab" * 16).version
  3
  """

  version: int | None
  digest: str
  generation: int
  run: str


@dataclasses.dataclass
class SubscriberStats:
  """What a subscriber did so far: versions applied, by kind; reads retried; versions skipped
  (failed twice); anchors requested; bytes read; and whether it is stalled now.

  Attributes:
    stalled: None while the rollout can follow the feed; else why it cannot (the feed has newer
      versions, but no delta from the version it holds and no newer anchor).
    stalls: how many times it became stalled.

  >>> SubscriberStats().deltas, SubscriberStats().stalled
  (0, None)
  """

  deltas: int = 0
  anchors: int = 0
  retries: int = 0
  skipped: int = 0
  anchor_requests: int = 0
  bytes_read: int = 0
  stalled: str | None = None
  stalls: int = 0


class Subscriber:
  """Applies a feed's versions to a :class:`~jsparse.Receiver`, in every rollout process.

  Args:
    receiver: the rollout's receiver (fresh, or restored from its saved state).
    feed: the feed the trainer publishes into.
    start_with_anchor: the receiver does not hold any version of the trainer's (a rollout that
      joins with empty weights): ask for an anchor, and take only anchors until one applies.
    stall_versions, stall_seconds: a rollout that cannot follow the feed (the feed holds newer
      versions, but no delta from its version and no newer anchor) asks for an anchor once it
      is this many versions behind or has waited this long, whichever comes first, and again
      after as many more: it never waits silently. :attr:`SubscriberStats.stalled` says why
      it waits, and a warning is logged each time it asks.

    key: apply only versions whose commits this key verifies (the trainer's
      :class:`~jsparse.engine.HmacKey`, or its :class:`~jsparse.engine.Ed25519Key`'s public
      key): unsigned or wrongly signed versions are ignored before any part is read, and
      every part is checked against its signed checksum.
    max_parts: a version naming more parts than this is ignored unread (default: what the
      plan can produce from up to 1,024 trainer processes).
    rollout_id: this rollout's name in the trainer's fleet view (1-64 of ``A-Za-z0-9._-``):
      give the same one to a restarted rollout so that it is recognised; default: a new
      random id. After every poll that applied, refused or stalled, and at least every
      ``heartbeat_seconds`` while it polls, the rollout reports what it holds in the feed
      (:attr:`weights`, the stall or refusal reason) for the trainer's
      :meth:`~jsparse.engine.Publisher.fleet`.

  Only versions of the feed's run, committed by its newest generation (the trainer that
  opened the feed last), are applied; so a zombie trainer's versions, another run's copied
  into the feed, or a forged commit are never applied, and a version number never names two
  states for a rollout.

  The feed's run identity is checked at every poll: a receiver restored from the state of
  another run (the feed was reset for a new run) does not serve its weights as this run's
  version: it is detached (:attr:`version` is None until it holds a version of this run, see
  :meth:`~jsparse.Receiver.detach`), with a warning, and takes an anchor.

  >>> import tempfile, jax.numpy as jnp, jsparse
  >>> from jsparse import engine
  >>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
  >>> feed = engine.DirectoryFeed(tempfile.mkdtemp())
  >>> rollout = Subscriber(jsparse.Receiver(plan, {'w': jnp.ones(8)}), feed,
  ...                      start_with_anchor=True)
  >>> _ = engine.Publisher(jsparse.Sender(plan, {'w': jnp.zeros(8)}), feed).publish(
  ...     {'w': jnp.zeros(8)})
  >>> rollout.poll(), rollout.version, float(rollout.params['w'][0])
  ([1], 1, 0.0)
  """

  def __init__(self, receiver: Receiver, feed: Feed, *, start_with_anchor: bool = False,
               stall_versions: int = 2, stall_seconds: float = 60.0,
               key: SigningKey | None = None, max_parts: int | None = None,
               rollout_id: str | None = None, heartbeat_seconds: float = 5.0):
    self.receiver = typed_argument("receiver", receiver, Receiver, "a jsparse.Receiver")
    self.feed = feed_argument(feed)
    self.key = key_argument("key", key)
    self.ledger = Ledger(self.feed, self.key)
    units = sum(seg.blocks for seg in receiver.plan.segments)
    self.max_parts = int_option("max_parts", max_parts, minimum=1, optional=True) or \
        _TRAINER_PROCESSES * max(1, units)
    self._generation = 0  # the newest generation of the feed's run known (never goes back)
    self._run = ""  # the feed's run (hex), as last read
    self._commits: dict[Entry, Commit] = {}  # of the last listing
    self._holds = not start_with_anchor  # the receiver holds a version of the feed's run
    self.rollout_id = check_rollout_id(rollout_id) if rollout_id is not None else \
        agreed_bytes(f"rollout-{uuid.uuid4().hex[:12]}".encode()).decode()  # process 0's
    self.heartbeat_seconds = float_option("heartbeat_seconds", heartbeat_seconds)
    self._reported: tuple | None = None  # what the last status said, and when (monotonic)
    self._refused: str | None = None
    self.stall_versions = int_option("stall_versions", stall_versions, minimum=1)
    self.stall_seconds = float_option("stall_seconds", stall_seconds)
    self.stats = SubscriberStats()
    self._skipped: set[Entry] = set()
    self._needs_anchor = bool(start_with_anchor)
    self._newest = -1  # the newest version of the feed's last listing (-1: not read)
    self._stall: tuple[float, int] | None = None  # since when, at which feed version: asked
    if start_with_anchor:
      self._request_anchor()

  @property
  def version(self) -> int | None:
    """The version the rollout holds: the policy version its samples come from (None while it
    holds no version of the feed's run: joined empty, or restored from another run's state)."""
    return self.receiver.version if self._holds else None

  @property
  def weights(self) -> Weights:
    """The version and digest of the weights this rollout serves now (stamp samples)."""
    return Weights(self.version, self.receiver.digest.hex(), self._generation, self._run)

  def wait_for(self, version: int, timeout: float = 60.0, interval: float = 0.02) -> list[int]:
    """Polls until this rollout holds ``version`` or a later one; returns what it applied.

    Raises:
      StalenessError: it does not within ``timeout`` seconds (the message says why, e.g. the
        trainer has not published it, or the rollout is stalled).
    """
    deadline, applied = time.monotonic() + timeout, []
    while True:
      applied += self.poll()
      if self.version is not None and self.version >= version:
        return applied
      if time.monotonic() > deadline:
        raise StalenessError(
            f"rollout {self.rollout_id} holds version {self.version}, not {version}, after "
            f"{timeout:g} s: " + (self.stats.stalled or self._refused or
                                  f"the feed's newest version is {max(self._newest, 0)}"))
      time.sleep(interval)

  @property
  def generation(self) -> int:
    """The newest generation of the feed's run this rollout knows (it follows only that)."""
    return self._generation

  @property
  def params(self) -> PyTree:
    return self.receiver.params

  def poll(self) -> list[int]:
    """Applies every version available now, in order; returns the versions applied."""
    self._check_run()
    applied = []
    while (entry := agreed_entry(self._on_process_0("listing the feed", self._next))) \
        is not None:
      outcome = self._apply(entry)
      if outcome is _TRANSIENT:
        outcome = self._apply(entry, retry=True)
      if outcome is None:
        applied.append(entry.version)
        self._needs_anchor, self._holds, self._refused = False, True, None
        continue
      self._skipped.add(entry)
      self._refused = f"version {entry.version} ({entry.kind}) not applied: {outcome}"
      self.stats.skipped += 1
      self._needs_anchor = True
      self._request_anchor()
      self._stall = (time.monotonic(), entry.version)  # the bound counts from this request
    self._check_stall()
    self._on_process_0("reporting this rollout's status", self._report)
    return applied

  def _report(self) -> None:
    """Writes this rollout's status into the feed if it changed, or if the last report is
    ``heartbeat_seconds`` old (process 0)."""
    if not self._run:
      return
    said = (self.version, self._generation, self.receiver.digest, self.stats.stalled,
            self._refused, self.stats.deltas + self.stats.anchors)
    now = time.monotonic()
    if self._reported is not None and self._reported[0] == said and \
        now - self._reported[1] < self.heartbeat_seconds:
      return
    status = Status(self.rollout_id, self.version, self._generation, self.receiver.digest.hex(),
                    time.time(), self.stats.stalled, self._refused, said[-1])
    self.feed.put_status(self.rollout_id, status_record(self._run, status, self.key))
    self._reported = (said, now)

  def _on_process_0(self, what: str, call, default=None):
    """``call()`` on process 0 (what the feed says, which every process then agrees on);
    ``default`` on the others, or if it fails (logged, and said in ``stats.stalled``): a feed
    that cannot be read now is tried again at the next poll, and no process is left out of
    step with the others."""
    if jax.process_index() != 0:
      return default
    try:
      return call()
    except Exception as e:  # noqa: BLE001 - a feed's failure must not stop a poll midway
      logging.getLogger("jsparse").warning("jsparse: %s failed: %r", what, e)
      self.stats.stalled = f"{what} failed: {e!r}"
      return default

  def _request_anchor(self) -> None:
    self.stats.anchor_requests += 1
    self._on_process_0("asking for an anchor", self.feed.request_anchor)

  def _check_run(self) -> None:
    """Detaches a receiver that holds another run's state (see the class docstring)."""
    feed_run = agreed_bytes(self._on_process_0("reading the feed's run", self.feed.run_id)
                            or b"") or None
    if feed_run is not None and feed_run.hex() != self._run:
      self._run, self._generation = feed_run.hex(), 0  # another run's generations
    if feed_run is None or self.receiver.run_id == feed_run:
      return
    if self.receiver.run_id is not None:
      logging.getLogger("jsparse").warning(
          "jsparse: this rollout holds version %d of run %s, but the feed belongs to run %s "
          "(reset for a new run): its weights are not served as this run's; it takes an "
          "anchor", self.receiver.version, self.receiver.run_id.hex(), feed_run.hex())
      self.receiver.detach()
      self._holds = False
      self._needs_anchor = True
      self._request_anchor()
    self.receiver.run_id = feed_run

  def _check_stall(self) -> None:
    """Asks for an anchor, bounded by ``stall_versions`` and ``stall_seconds``, while the feed
    holds newer versions that this rollout cannot use (the poll applied all it could)."""
    newest = agreed_int(self._newest)  # from the poll's last listing (process 0's)
    if newest < 0:  # unread: said in stats.stalled; asked again at the next poll
      return
    held = self.receiver.version
    if newest <= held and self._holds:
      self._stall, self.stats.stalled = None, None
      return
    now = time.monotonic()
    missing = "no anchor newer than it" if self._needs_anchor else \
        "no delta from it and no newer anchor"
    if self.stats.stalled is None:
      self.stats.stalls += 1
    self.stats.stalled = f"the feed holds version {newest}, but this rollout holds " \
        f"{held if self._holds else 'no version of its run'} and the feed has {missing}"
    if self._stall is None:
      self._stall = (now, held)
    since, at = self._stall
    if newest - at >= self.stall_versions or now - since >= self.stall_seconds:
      logging.getLogger("jsparse").warning("jsparse: stalled: %s; %s", self.stats.stalled,
                                           _ASKS)
      self._needs_anchor = True
      self._request_anchor()
      self._stall = (now, newest)  # ask again after as many more versions or seconds

  def _next(self) -> Entry | None:
    """The entry to apply next (None: nothing now); notes the feed's newest version. Only
    verified commits of the feed's run by its newest generation count; the generations are
    read after the commits, so a commit of a replaced publisher that is listed is always
    seen together with the generation that replaced it."""
    self._newest = -1  # unread, unless the listing below succeeds
    if not self._run:  # the feed's run is unknown (none claimed, or not read): nothing yet
      return None
    listed = self.ledger.commits(self._run, self.max_parts)
    self._generation = max(self._generation, self.ledger.newest_generation(self._run),
                           max((c.entry.generation for c in listed), default=0))
    current = [c for c in listed if c.entry.generation == self._generation]
    self._commits = {c.entry: c for c in current}
    self._newest = max((c.entry.version for c in current), default=0)
    entries = [c.entry for c in current if c.entry not in self._skipped]
    held = self.receiver.version
    if not self._needs_anchor:
      deltas = [e for e in entries if e.kind == "delta" and e.base == held]
      if deltas:
        return max(deltas)
    anchors = [e for e in entries if e.kind == "anchor" and e.version > held]
    return max(anchors) if anchors else None

  def _commit_of(self, entry: Entry) -> Commit:
    """The verified commit of ``entry`` (read here on processes other than 0)."""
    commit = self._commits.get(entry)
    if commit is None:
      commit = self.ledger.commit_of(entry)
    if entry.parts > self.max_parts:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) names {entry.parts} parts, "
                           f"more than this plan produces ({self.max_parts}): not read")
    return commit

  def _apply(self, entry: Entry, retry: bool = False) -> Exception | None:
    """Applies ``entry``; else (logged, nothing applied) the error: ``_TRANSIENT`` ones (parts
    damaged or missing: read them again) or others (this rollout's state does not fit: only
    an anchor helps)."""
    self.stats.retries += retry
    lost = None
    try:
      parts = self.feed.parts(entry, self._commit_of(entry).parts,
                              check_digests=self.key is not None)
    except PartsLostError as e:
      lost, parts = e, []
    except Exception as e:  # noqa: BLE001 - any read failure: agreed below, read again once
      lost, parts = PartsLostError(f"version {entry.version} ({entry.kind}) could not be read: "
                                   f"{e!r}"), []
    before = self.receiver.digest
    try:
      parts_lib.agree(lost, jax.tree.leaves(self.receiver.params))  # all processes, or none
      self.receiver.receive(parts)
    except _FAILURES as e:
      if self.receiver.digest != before:  # a donating receiver kept what failed its check
        self.receiver.detach()  # its bits are no version: it serves none until an anchor
        self._holds = False
      again = isinstance(e, (PayloadError, PartsLostError)) and not retry
      logging.getLogger("jsparse").warning(
          "jsparse: version %d (%s) not applied%s: %s; %s", entry.version, entry.kind,
          " after a second read" if retry else "", str(e).replace(NEEDS_ANCHOR, "it needs an "
                                                                  "anchor"),
          "reading it once more" if again else f"it is skipped and {_ASKS}")
      return _TRANSIENT if again else e
    setattr(self.stats, entry.kind + "s", getattr(self.stats, entry.kind + "s") + 1)
    self.stats.bytes_read += self.receiver.last_read.bytes_read
    return None
