"""The trainer side of an engine: :class:`Publisher` puts every version's parts into a feed.

Each ``publish`` sends a delta from the previous version; when the version's number is a
multiple of ``anchor_every`` (as on a :class:`~jsparse.Sender`: that version carries an
anchor), or when a subscriber asked for one, it also puts an anchor of the same version (the
dense state, accepted on any older base, streamed in parts like any version) next to the
delta. Retention keeps the newest anchor, the deltas after it and those of the last ``keep``
versions, so a rollout that lags by up to ``keep`` versions catches up along the deltas, one
that lags more takes the anchor, and the feed never grows: a slow rollout never blocks the
trainer, and nothing is deleted that a rollout needs while no newer anchor exists.

Each publisher that opens a feed claims a *generation* larger than every earlier one (a
create-only claim): a trainer restored from a saved state, and its zombie twin, hold different
ones. Every entry carries its publisher's run and generation; rollouts follow only the newest
generation of the feed's run, and a publisher whose generation was replaced (or whose run no
longer owns the feed) is refused at its next publish with :class:`~jsparse.errors.FencedError`.

>>> import tempfile, jax.numpy as jnp, jsparse
>>> from jsparse._src.engine.feed import DirectoryFeed
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
>>> feed = DirectoryFeed(tempfile.mkdtemp())
>>> publisher = Publisher(jsparse.Sender(plan, {'w': jnp.zeros(8)}), feed, anchor_every=2,
...                       keep=0)
>>> [[(e.version, e.kind) for e in publisher.publish({'w': jnp.full(8, float(i))})]
...  for i in range(1, 4)]
[[(1, 'delta')], [(2, 'delta'), (2, 'anchor')], [(3, 'delta')]]
>>> [(e.version, e.kind) for e in feed.entries()]  # older than the newest anchor: removed
[(2, 'delta'), (2, 'anchor'), (3, 'delta')]
"""

from __future__ import annotations

import logging
import time

import jax

from jsparse._src.engine.agreement import (agreed_blob, agreed_bytes, agreed_flag, agreed_int,
                                           gathered_parts, raise_if_any_failed)
from jsparse._src.engine.fleet import RolloutInfo, decode_rows, encode_rows, fleet_view
from jsparse._src.engine.feed import Entry, Feed
from jsparse._src.engine.ledger import Ledger
from jsparse._src.engine.records import part_meta
from jsparse._src.engine.signing import SigningKey, key_argument
from jsparse._src.errors import ConfigError, FencedError, PartsLostError, StalenessError
from jsparse._src.options import feed_argument, float_option, int_option, typed_argument
from jsparse._src.pytree import PyTree
from jsparse._src.sync.sender import Sender, anchor_due
from jsparse._src.sync.stream import Version


class Publisher:
  """Publishes a :class:`~jsparse.Sender`'s versions into a feed, in every trainer process.

  Args:
    sender: the trainer's sender (fresh, or restored from its saved state).
    feed: where parts go (:class:`~jsparse.engine.DirectoryFeed`, :class:`~jsparse.engine.RayFeed`).
    anchor_every: a version whose number is a multiple of this carries an anchor, as on a
      :class:`~jsparse.Sender`; here it is published next to the version's delta, so that
      rollouts that follow keep applying deltas (None: only on request). Give it to the
      publisher rather than to its sender, whose anchors replace the delta.
    keep: keep the deltas of the last ``keep`` versions even when an anchor is newer.
    chunk_bytes: each version (and each anchor) is streamed in parts of at most this many bytes
      of rollout data, each put into the feed as soon as it is coded: a trainer process never
      holds the whole dense state on the host.
    key: sign every commit and generation claim with this key
      (:class:`~jsparse.engine.HmacKey`, or an :class:`~jsparse.engine.Ed25519Key` holding the
      private key); rollouts given the key (or the public key) apply nothing else.
    cleanup_batch: at most this many leftovers of failed publishes are removed per publish (and
      when the publisher starts), so that a feed full of them does not hold up publishing;
      :attr:`leftovers` says how many remain.
    max_lag: bounded staleness: before publishing version ``v``, wait until every live rollout
      (:meth:`fleet`) holds ``v - 1 - max_lag`` or later (0: a synchronous loop, every rollout
      holds the previous version; None: never wait). A rollout that reports itself stalled
      is not waited for: this publish brings it the anchor it needs.
    lag_timeout, on_lag: how long to wait; then ``"raise"`` (a
      :class:`~jsparse.errors.StalenessError` naming who lags and why) or ``"log"`` (a
      warning, and the version is published).
    gone_seconds: a rollout not seen this long is reported gone and holds nothing back.
    retain_versions, retain_bytes: retention by need: beyond the last ``keep`` versions, the
      deltas back to the oldest version a live rollout holds are kept too (so a slow rollout
      catches up by deltas, not an anchor), at most this many of them and this many bytes
      (None: no byte cap). Statuses only ever keep more: what ``keep`` keeps stays.

  Raises:
    ConfigError: a bad option, or the feed belongs to another run (another trainer publishes
      into it): a feed has one publisher. A trainer that restarts resumes the run with
      :meth:`~jsparse.Sender.restore` from its saved state, which keeps the run's identity
      (and claims a new generation, which fences off the process it replaces).

  Every entry is labelled by what it really is: when a publish fails halfway (a full disk, a
  lost store) its version is never committed, the sender's next payload is an anchor, and it
  goes into the feed as an anchor, which every rollout accepts. An anchor that a rollout asked
  for is owed until one is committed. Leftovers of failed publishes are removed by the next
  publish. A sender restored from a state older than what the feed already holds (the trainer
  died after publishing more) must not reuse those version numbers: its first publish is then
  an anchor newer than everything in the feed.

  >>> import tempfile, jax.numpy as jnp, jsparse
  >>> from jsparse import engine
  >>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
  >>> publisher = Publisher(jsparse.Sender(plan, {'w': jnp.zeros(8)}),
  ...                       engine.DirectoryFeed(tempfile.mkdtemp()), anchor_every=None)
  >>> [(e.version, e.kind) for e in publisher.publish({'w': jnp.ones(8)}, with_anchor=True)]
  [(1, 'delta'), (1, 'anchor')]
  >>> [(e.version, e.kind) for e in publisher.publish({'w': jnp.ones(8)}, anchor=True)]
  [(2, 'anchor')]
  """

  def __init__(self, sender: Sender, feed: Feed, *, anchor_every: int | None = 8,
               keep: int = 8, chunk_bytes: int = 64 << 20, key: SigningKey | None = None,
               cleanup_batch: int = 16, max_lag: int | None = None, lag_timeout: float = 60.0,
               on_lag: str = "raise", gone_seconds: float = 60.0, retain_versions: int = 64,
               retain_bytes: int | None = None):
    self.sender = typed_argument("sender", sender, Sender, "a jsparse.Sender")
    self.feed = feed_argument(feed)
    self.chunk_bytes = int_option("chunk_bytes", chunk_bytes, minimum=1)
    self.anchor_every = int_option("anchor_every", anchor_every, minimum=1, optional=True)
    self.keep = int_option("keep", keep, minimum=0)
    self.cleanup_batch = int_option("cleanup_batch", cleanup_batch, minimum=1)
    self.max_lag = int_option("max_lag", max_lag, minimum=0, optional=True)
    self.lag_timeout = float_option("lag_timeout", lag_timeout)
    if on_lag not in ("raise", "log"):
      raise ConfigError(f"on_lag is 'raise' or 'log', got {on_lag!r}")
    self.on_lag = on_lag
    self.gone_seconds = float_option("gone_seconds", gone_seconds)
    self.retain_versions = int_option("retain_versions", retain_versions, minimum=0)
    self.retain_bytes = int_option("retain_bytes", retain_bytes, minimum=0, optional=True)
    self._warned: set = set()  # statuses ignored and warned about
    self._published = {sender.version: (sender.digest.hex(), time.time())}  # what it sent
    self.key = key_argument("key", key)
    if self.key is not None and not self.key.can_sign:
      raise ConfigError("Publisher: its key holds only a public key; give it the private key "
                        "(rollouts get the public one)")
    claim_run(sender, feed)
    self.run = sender.run_id.hex()
    self.ledger = Ledger(self.feed, self.key)
    self.generation = agreed_int(_on_process_0(lambda: self.ledger.claim_generation(self.run)))
    self.leftovers = 0  # failed publishes' entries still to remove (process 0's count)
    if jax.process_index() == 0:  # a previous trainer's failed publish: never to be committed
      _housekeeping("removing failed publishes' parts", lambda: self._clean([]))
    latest = agreed_int(_on_process_0(self._latest))
    self._resync = latest >= 0 and latest != sender.version
    # A new generation over versions of earlier ones: the rollouts that lag behind them need an
    # anchor of this generation (they follow only the newest).
    self._anchor_owed = latest >= 0
    self.bytes_put = 0  # by this process, over all publishes

  def _latest(self) -> int:
    """The newest version committed in this run, by any generation (-1: none)."""
    return max((c.entry.version for c in self.ledger.commits(self.run)), default=-1)

  def _check_fenced(self) -> None:
    """Raises :class:`FencedError` on every process if this publisher was replaced: the feed
    belongs to another run now, or a newer generation was claimed (read on process 0)."""
    def replaced() -> str:
      run = self.feed.run_id()
      if run is None or run.hex() != self.run:
        return (f"this feed now belongs to run {run.hex() if run else '(none: it was reset)'}, "
                f"not to this publisher's run {self.run}")
      newest = self.ledger.newest_generation(self.run)
      if newest != self.generation:
        return (f"generation {newest} of run {self.run} replaced this publisher's generation "
                f"{self.generation} (another trainer was started or restored on this feed)"
                if newest > self.generation else
                f"this publisher's claim of generation {self.generation} is gone from the feed")
      return ""
    error = None
    if jax.process_index() == 0:
      try:
        why = replaced()
        error = FencedError(f"{why}: this publisher must stop; nothing it publishes is "
                            "applied") if why else None
      except Exception as e:  # noqa: BLE001 - every process raises it below
        error = e
    raise_if_any_failed(error)

  def publish(self, params: PyTree, *, anchor: bool = False, with_anchor: bool = False
              ) -> list[Entry]:
    """Publishes ``params`` as the next version; returns the entries written (this process
    wrote its parts of each).

    Args:
      params: the trainer's new params.
      anchor: publish this version as an anchor only (e.g. when the rollouts hold other
        bits), as :meth:`~jsparse.Sender.send` does.
      with_anchor: also publish an anchor of this version next to its delta, whatever is due.

    Raises:
      whatever the sender or the feed raise while the version's parts (or its anchor's) are
      put, on every process of the trainer alike (a process whose puts succeeded raises
      :class:`~jsparse.engine.PartsLostError` naming the one that failed). If the version's
      own parts failed it is not committed, and the next publish is an anchor (the sender
      resyncs); if only its anchor's did, the anchor is owed to the next publish. Either way
      no rollout waits for what was lost. Failures of housekeeping after the commit (taking an
      anchor request, retention) are logged, not raised.
    """
    self._check_fenced()
    self._wait_for_fleet(self.sender.version + 1)
    if self._resync:
      version = max(agreed_int(self._latest() if jax.process_index() == 0 else 0),
                    self.sender.version) + 1
      stream = self.sender.send_stream(params, anchor=True, version=version,
                                       chunk_bytes=self.chunk_bytes)
    else:
      stream = self.sender.send_stream(params, anchor=anchor, chunk_bytes=self.chunk_bytes)
    written = [self._put_stream(stream)]
    self._resync = False
    requested = agreed_flag(jax.process_index() == 0 and bool(_housekeeping(
        "taking an anchor request", self.feed.take_anchor_request)))
    self._anchor_owed = self._anchor_owed or requested
    due = anchor_due(self.sender.version, self.anchor_every)
    if not stream.anchor and (with_anchor or self._anchor_owed or due):
      written.append(self._put_stream(self.sender.anchor_stream(chunk_bytes=self.chunk_bytes)))
    self._anchor_owed = False  # an anchor of this version is committed
    self._published[self.sender.version] = (self.sender.digest.hex(), time.time())
    while len(self._published) > _PUBLISHED_KEPT:
      del self._published[min(self._published)]
    if jax.process_index() == 0:
      _housekeeping("retention", lambda: self._retain(written))
    return written

  def fleet(self) -> list[RolloutInfo]:
    """Every rollout that reported into the feed (its status, see
    :class:`~jsparse.engine.Subscriber`): the version it holds, whether its digest is this
    trainer's digest of that version, how far and how long it lags, when it was last seen,
    why it stalls or refused a version, and whether it is gone. Read on process 0, the same
    on every process.

    >>> import tempfile, jax.numpy as jnp, jsparse
    >>> from jsparse._src.engine.feed import DirectoryFeed
    >>> from jsparse._src.engine.subscriber import Subscriber
    >>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
    >>> feed = DirectoryFeed(tempfile.mkdtemp())
    >>> publisher = Publisher(jsparse.Sender(plan, {'w': jnp.zeros(8)}), feed)
    >>> rollout = Subscriber(jsparse.Receiver(plan, plan.cast({'w': jnp.zeros(8)})), feed,
    ...                      rollout_id="rollout-a")
    >>> _ = publisher.publish({'w': jnp.ones(8)}); _ = rollout.poll()
    >>> _ = publisher.publish({'w': jnp.full(8, 2.0)})
    >>> [(r.rollout, r.version, r.digest_ok, r.lag_versions) for r in publisher.fleet()]
    [('rollout-a', 1, True, 1)]
    """
    return decode_rows(agreed_blob(_on_process_0(lambda: encode_rows(self._fleet_rows()))
                                   or b"[]"))

  def _fleet_rows(self) -> list[RolloutInfo]:
    return fleet_view(self.feed.statuses(), run=self.run, key=self.key,
                      published=self._published, latest=self.sender.version, now=time.time(),
                      gone_seconds=self.gone_seconds, warned=self._warned)

  def _wait_for_fleet(self, version: int) -> None:
    """Waits until every live rollout holds ``version - 1 - max_lag`` or later (see the class
    docstring); stalled ones are owed an anchor instead."""
    if self.max_lag is None:
      return
    floor, deadline = version - 1 - self.max_lag, time.monotonic() + self.lag_timeout
    while True:
      behind = [r for r in self.fleet() if r.live and (r.version is None or r.version < floor)]
      if any(r.stalled for r in behind):
        self._anchor_owed = True  # they wait for an anchor: this publish brings it
      behind = [r for r in behind if not r.stalled]
      if not behind:
        return
      if time.monotonic() > deadline:
        message = (f"{len(behind)} rollout(s) hold a version older than {floor} (max_lag "
                   f"{self.max_lag} before version {version}) after {self.lag_timeout:g} s: " +
                   "; ".join(f"{r.rollout} at {r.version}, seen {r.last_seen:.1f} s ago" +
                             (f", {r.refused}" if r.refused else "") for r in behind[:8]))
        if self.on_lag == "raise":
          raise StalenessError(message)
        logging.getLogger("jsparse").warning("jsparse: %s; publishing anyway", message)
        return
      time.sleep(0.02)

  def _put_stream(self, stream: Version) -> Entry:
    """Puts each part of a streamed version as it is produced, under the entry it really is;
    every process of the trainer returns, or all raise (see :meth:`publish`)."""
    entry = Entry(stream.version, "anchor" if stream.anchor else "delta",
                  stream.base_version, stream.parts, self.generation, self.run)
    error, metas = None, []
    try:
      for k, data in enumerate(stream):  # to the end: the sender counts the stream done
        self.feed.put(entry, stream.numbers[k], data)
        metas.append(part_meta(data))
        self.bytes_put += len(data)
    except Exception as e:  # noqa: BLE001 - agreed below, then raised
      error = e
    raise_if_any_failed(error)
    parts = gathered_parts(stream.numbers[:len(metas)], metas, entry.parts)
    self._check_fenced()  # a replaced publisher commits nothing more
    if jax.process_index() == 0:
      try:
        if parts is None:
          raise PartsLostError(f"version {entry.version}: not every part was put")
        self.ledger.commit(entry, parts)
      except Exception as e:  # noqa: BLE001 - every process raises it below
        error = e
    raise_if_any_failed(error)
    return entry

  def _clean(self, written: list[Entry]) -> None:
    """Removes up to ``cleanup_batch`` leftovers of failed publishes (never committed): those
    of earlier generations or other runs, and this publisher's up to its version."""
    leftovers = [e for e in self.feed.pending() if e not in written and (
        (e.run, e.generation) != (self.run, self.generation) or e.version <= self.sender.version)]
    for entry in leftovers[:self.cleanup_batch]:
      self.feed.remove(entry)
    self.leftovers = max(0, len(leftovers) - self.cleanup_batch)
    if self.leftovers:
      logging.getLogger("jsparse").info(
          "jsparse: %d leftovers of failed publishes remain in the feed (%d removed per "
          "publish)", self.leftovers, self.cleanup_batch)

  def _retain(self, written: list[Entry]) -> None:
    """Removes what the newest anchor of this generation replaces: older anchors and entries
    of earlier generations, and older deltas outside the last ``keep`` versions; and what
    failed publishes left (run by process 0). Only commits that verify count, and only this
    publisher's own anchors: no forged name can make it delete a real entry."""
    self._clean(written)
    commits = self.ledger.commits(self.run)
    entries = [c.entry for c in commits]
    anchors = [e.version for e in entries if e.kind == "anchor" and e.generation ==
               self.generation and e.version <= self.sender.version]
    if not anchors:
      return
    newest, latest = max(anchors), self.sender.version
    needed = self._needed(commits, latest) if self.retain_versions else set()
    for entry in entries:
      if entry in needed:
        continue
      if entry.version < newest and (entry.kind == "anchor" or entry.generation !=
                                     self.generation or entry.version <= latest - self.keep):
        self.feed.remove(entry)
      elif entry.generation < self.generation and entry.version >= newest:
        self.feed.remove(entry)  # a replaced publisher's: no rollout follows it any more

  def _needed(self, commits: list, latest: int) -> set[Entry]:
    """The deltas of this generation that bring the oldest live rollout to ``latest``, newest
    first, within ``retain_versions`` and ``retain_bytes`` (retention by need)."""
    held = [r.version for r in self._fleet_rows() if r.live and r.version is not None]
    if not held:
      return set()
    oldest = min(held)
    deltas = sorted((c for c in commits if c.entry.kind == "delta" and c.entry.generation ==
                     self.generation and oldest < c.entry.version <= latest - self.keep),
                    key=lambda c: -c.entry.version)
    kept, size = set(), 0
    for commit in deltas[:self.retain_versions]:
      size += sum(p.size for p in commit.parts)
      if self.retain_bytes is not None and size > self.retain_bytes:
        break
      kept.add(commit.entry)
    return kept


_PUBLISHED_KEPT = 4096  # versions whose digests the fleet view compares against


def _on_process_0(call):
  """``call()`` on process 0 (0 on the others); an error raises on every process."""
  value, error = 0, None
  if jax.process_index() == 0:
    try:
      value = call()
    except Exception as e:  # noqa: BLE001 - every process raises it below
      error = e
  raise_if_any_failed(error)
  return value


def _housekeeping(what: str, call):
  """``call()``, or None with a warning if it fails: work after a version is committed (or
  before the first) that must not fail the publish nor leave processes out of step."""
  try:
    return call()
  except Exception as e:  # noqa: BLE001 - logged: the next publish tries again
    logging.getLogger("jsparse").warning("jsparse: publisher %s failed: %r", what, e)
    return None


def claim_run(sender: Sender, feed: Feed) -> None:
  """Makes ``sender``'s run the feed's (every process agrees on process 0's run id), or raises
  :class:`ConfigError` if the feed belongs to another run."""
  sender.run_id = agreed_bytes(sender.run_id)
  error, owner = None, sender.run_id
  if jax.process_index() == 0:
    try:
      owner = feed.claim_run(sender.run_id)
    except Exception as e:  # noqa: BLE001 - every process raises it below
      error, owner = e, b""
  owner = agreed_bytes(owner)
  if not owner:
    raise error if error is not None else PartsLostError(
        "process 0 could not claim the feed for this run")
  if owner != sender.run_id:
    raise ConfigError(
        f"this feed belongs to run {owner.hex()} (another trainer publishes into it), not to "
        f"this sender's run {sender.run_id.hex()}: a feed has one publisher. To resume a run "
        "after a restart, restore the sender from its saved state (Sender.restore); to start "
        "a new run, use a new feed")
