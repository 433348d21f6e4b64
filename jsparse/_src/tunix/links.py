"""How a Tunix sync travels from the trainer's params to the rollout's: in this process
(:class:`InProcessLink`: payload bytes from a Sender straight to a Receiver) or through an engine
feed (:class:`FeedLink`: a Publisher puts each version into a DirectoryFeed or RayFeed, and this
process's Subscriber takes it like any other rollout job does)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jsparse._src.engine.feed import Feed
from jsparse._src.engine.publisher import Publisher
from jsparse._src.engine.signing import SigningKey
from jsparse._src.engine.subscriber import Subscriber
from jsparse._src.errors import VersionError
from jsparse._src.pytree import PyTree
from jsparse._src.sync.receiver import Receiver
from jsparse._src.sync.sender import Sender


@dataclasses.dataclass(frozen=True)
class Moved:
  """What one sync moved: the new version, its changed elements and the payload bytes."""
  version: int
  changed: int
  payload_bytes: int


class Link(Protocol):
  sender: Sender
  receiver: Receiver

  def sync(self, params: PyTree) -> Moved:
    """Sends ``params`` as the next version and applies it on the receiver."""


class InProcessLink:
  """Sender and receiver in one process: each sync is one payload, sent and received.

  ``anchor_first``: the receiver does not hold the sender's base (digests differ), so the first
  sync is a dense anchor.
  """

  def __init__(self, sender: Sender, receiver: Receiver, *, anchor_first: bool = False):
    self.sender, self.receiver = sender, receiver
    self._anchor = anchor_first

  def sync(self, params: PyTree) -> Moved:
    data = self.sender.send(params, anchor=self._anchor)
    self.receiver.receive(data)
    self._anchor = False
    return Moved(self.sender.version, self.sender.last_stats.changed, len(data))


class FeedLink:
  """Sender and receiver joined by an engine feed, as a trainer and a rollout job are: each sync
  publishes a version (streamed in parts of at most ``chunk_bytes``) and the subscriber applies
  it. Other rollout jobs may subscribe to the same feed. With ``key``, versions are signed
  and only versions it verifies are applied."""

  def __init__(self, sender: Sender, receiver: Receiver, feed: Feed, *,
               anchor_first: bool = False, chunk_bytes: int = 64 << 20,
               key: SigningKey | None = None):
    self.sender, self.receiver = sender, receiver
    self.publisher = Publisher(sender, feed, chunk_bytes=chunk_bytes, key=key)
    self.subscriber = Subscriber(receiver, feed, key=key)
    self._anchor = anchor_first

  def sync(self, params: PyTree) -> Moved:
    before = self.publisher.bytes_put
    self.publisher.publish(params, anchor=self._anchor)  # other bits: the version as an anchor
    self._anchor = False
    self.subscriber.poll()
    if self.subscriber.version != self.sender.version:
      raise VersionError(f"jsparse.tunix: the rollout is at version {self.subscriber.version} "
                         f"after publishing version {self.sender.version}: it could not apply "
                         "the version (the warnings logged above say why) and asked for an "
                         "anchor, which the next sync publishes; if this repeats, check the feed")
    return Moved(self.sender.version, self.sender.last_stats.changed,
                 self.publisher.bytes_put - before)
