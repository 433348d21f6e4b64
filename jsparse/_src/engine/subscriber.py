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

import jax

from jsparse._src.engine.agreement import agreed_entry
from jsparse._src.engine.feed import Entry, Feed, PartsLostError
from jsparse._src.errors import IntegrityError, PayloadError, VersionError
from jsparse._src.pytree import PyTree
from jsparse._src.sync import parts as parts_lib
from jsparse._src.sync.receiver import Receiver

_FAILURES = (PayloadError, IntegrityError, VersionError, PartsLostError)
_TRANSIENT = PayloadError("damaged or missing parts")  # read them again once


@dataclasses.dataclass
class SubscriberStats:
  """What a subscriber did so far: versions applied, by kind; reads retried; versions skipped
  (failed twice); anchors requested; bytes read.

  >>> SubscriberStats().deltas
  0
  """

  deltas: int = 0
  anchors: int = 0
  retries: int = 0
  skipped: int = 0
  anchor_requests: int = 0
  bytes_read: int = 0


class Subscriber:
  """Applies a feed's versions to a :class:`~jsparse.Receiver`, in every rollout process.

  Args:
    receiver: the rollout's receiver (fresh, or restored from its saved state).
    feed: the feed the trainer publishes into.
    start_with_anchor: the receiver does not hold any version of the trainer's (a rollout that
      joins with empty weights): ask for an anchor, and take only anchors until one applies.

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

  def __init__(self, receiver: Receiver, feed: Feed, *, start_with_anchor: bool = False):
    self.receiver = receiver
    self.feed = feed
    self.stats = SubscriberStats()
    self._skipped: set[Entry] = set()
    self._needs_anchor = bool(start_with_anchor)
    if start_with_anchor:
      self.stats.anchor_requests += 1
      feed.request_anchor()

  @property
  def version(self) -> int:
    """The version the rollout holds: the policy version its samples come from."""
    return self.receiver.version

  @property
  def params(self) -> PyTree:
    return self.receiver.params

  def poll(self) -> list[int]:
    """Applies every version available now, in order; returns the versions applied."""
    applied = []
    while (entry := agreed_entry(self._next())) is not None:
      outcome = self._apply(entry)
      if outcome is _TRANSIENT:
        outcome = self._apply(entry, retry=True)
      if outcome is None:
        applied.append(entry.version)
        self._needs_anchor = False
        continue
      self._skipped.add(entry)
      self.stats.skipped += 1
      self._needs_anchor = True
      self.stats.anchor_requests += 1
      self.feed.request_anchor()
    return applied

  def _next(self) -> Entry | None:
    entries = [e for e in self.feed.entries() if e not in self._skipped]
    if not self._needs_anchor:
      deltas = [e for e in entries if e.kind == "delta" and e.base == self.version]
      if deltas:
        return max(deltas)
    anchors = [e for e in entries if e.kind == "anchor" and e.version > self.version]
    return max(anchors) if anchors else None

  def _apply(self, entry: Entry, retry: bool = False) -> Exception | None:
    """Applies ``entry``; else (logged, nothing applied) the error: ``_TRANSIENT`` ones (parts
    damaged or missing: read them again) or others (this rollout's state does not fit: only
    an anchor helps)."""
    self.stats.retries += retry
    lost = None
    try:
      parts = self.feed.parts(entry)
    except PartsLostError as e:
      lost, parts = e, []
    try:
      parts_lib.agree(lost, jax.tree.leaves(self.receiver.params))  # all processes, or none
      self.receiver.receive_parts(parts)
    except _FAILURES as e:
      logging.getLogger("jsparse").warning("jsparse: version %d (%s) not applied%s: %s",
                                           entry.version, entry.kind,
                                           " after a second read" if retry else "", e)
      return _TRANSIENT if isinstance(e, (PayloadError, PartsLostError)) and not retry else e
    setattr(self.stats, entry.kind + "s", getattr(self.stats, entry.kind + "s") + 1)
    self.stats.bytes_read += self.receiver.last_read.bytes_read
    return None
