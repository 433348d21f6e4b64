"""The trainer side of an engine: :class:`Publisher` puts every version's parts into a feed.

Each ``publish`` sends a delta from the previous version; every ``anchor_every`` versions, or
when a subscriber asked for one, it also puts an anchor of the same version (the dense state,
accepted on any older base). Retention keeps the newest anchor, the deltas after it and those of
the last ``keep`` versions, so a rollout that lags by up to ``keep`` versions catches up along
the deltas, one that lags more takes the anchor, and the feed never grows: a slow rollout never
blocks the trainer, and nothing is deleted that a rollout needs while no newer anchor exists.

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

import jax

from jsparse._src.engine.agreement import agreed_flag
from jsparse._src.engine.feed import Entry, Feed
from jsparse._src.options import int_option
from jsparse._src.pytree import PyTree
from jsparse._src.sync.sender import Sender


class Publisher:
  """Publishes a :class:`~jsparse.Sender`'s versions into a feed, in every trainer process.

  Args:
    sender: the trainer's sender (fresh, or restored from its saved state).
    feed: where parts go (:class:`~jsparse.engine.DirectoryFeed`, :class:`~jsparse.engine.RayFeed`).
    anchor_every: also publish an anchor every this many versions (None: only on request).
    keep: keep the deltas of the last ``keep`` versions even when an anchor is newer.
    chunk_bytes: each version is streamed (:meth:`~jsparse.Sender.send_stream`) in parts of at
      most this many bytes of rollout data, each put into the feed as soon as it is coded.

  A sender restored from a state older than what the feed already holds (the trainer died after
  publishing more) must not reuse those version numbers: its first publish is then an anchor
  newer than everything in the feed, which every rollout accepts.

  >>> import tempfile, jax.numpy as jnp, jsparse
  >>> from jsparse import engine
  >>> plan = jsparse.make_plan({'w': jnp.zeros(8)})
  >>> publisher = Publisher(jsparse.Sender(plan, {'w': jnp.zeros(8)}),
  ...                       engine.DirectoryFeed(tempfile.mkdtemp()), anchor_every=None)
  >>> [(e.version, e.kind) for e in publisher.publish({'w': jnp.ones(8)}, anchor=True)]
  [(1, 'delta'), (1, 'anchor')]
  """

  def __init__(self, sender: Sender, feed: Feed, *, anchor_every: int | None = 8,
               keep: int = 8, chunk_bytes: int = 64 << 20):
    self.sender = sender
    self.feed = feed
    self.chunk_bytes = int_option("chunk_bytes", chunk_bytes, minimum=1)
    self.anchor_every = int_option("anchor_every", anchor_every, minimum=1, optional=True)
    self.keep = int_option("keep", keep, minimum=0)
    latest = self._latest()
    self._resync = latest is not None and latest != sender.version
    self._since_anchor = 0
    self.bytes_put = 0  # by this process, over all publishes

  def _latest(self) -> int | None:
    entries = self.feed.entries()
    return max(e.version for e in entries) if entries else None

  def publish(self, params: PyTree, *, anchor: bool = False) -> list[Entry]:
    """Publishes ``params`` as the next version; returns the entries written (this process
    wrote its parts of each). ``anchor``: also an anchor of this version, whatever is due (e.g.
    the first version, for rollouts that start empty)."""
    parts = jax.process_count()
    if self._resync:
      version = max(self._latest() or 0, self.sender.version) + 1
      written = [self._put_stream("anchor", version - 1, self.sender.send_stream(
          params, full=True, version=version, chunk_bytes=self.chunk_bytes))]
      self._resync, self._since_anchor = False, 0
    else:
      base = self.sender.version
      written = [self._put_stream("delta", base, self.sender.send_stream(
          params, chunk_bytes=self.chunk_bytes))]
      self._since_anchor += 1
      requested = agreed_flag(jax.process_index() == 0 and self.feed.take_anchor_request())
      if anchor or requested or (self.anchor_every
                                 and self._since_anchor >= self.anchor_every):
        version = self.sender.version
        written.append(self._put(Entry(version, "anchor", version - 1, parts),
                                 self.sender.anchor_part()))
        self._since_anchor = 0
    self._retain()
    return written

  def _put_stream(self, kind: str, base: int, stream) -> Entry:
    """Puts each part of a streamed version as it is produced."""
    entry = Entry(self.sender.version, kind, base, stream.parts)
    for k, data in enumerate(stream):  # to the end: the sender counts the stream done
      self._put(entry, data, stream.numbers[k])
    return entry

  def _put(self, entry: Entry, data: bytes, part: int | None = None) -> Entry:
    """Puts part ``part`` of ``entry`` (default: this process's one part)."""
    self.feed.put(entry, jax.process_index() if part is None else part, data)
    self.bytes_put += len(data)
    return entry

  def _retain(self) -> None:
    """Removes what the newest anchor replaces: older anchors, and older deltas outside the
    last ``keep`` versions (process 0 only)."""
    if jax.process_index() != 0:
      return
    entries = self.feed.entries()
    anchors = [e.version for e in entries if e.kind == "anchor"]
    if not anchors:
      return
    newest, latest = max(anchors), max(e.version for e in entries)
    for entry in entries:
      if entry.version < newest and (entry.kind == "anchor"
                                     or entry.version <= latest - self.keep):
        self.feed.remove(entry)
