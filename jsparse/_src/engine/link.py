"""A simulated network link: a token bucket that lets ``rate`` bytes per second through (with a
burst of ``burst`` bytes), really sleeping, and a feed whose reads pass through it. Used by
the link benchmark to measure end-to-end sync time at a given bandwidth.

>>> bucket = TokenBucket(bits_per_second=8e6)  # 1 MB/s
>>> bucket.transmit(10_000) >= 0.0  # the seconds it waited
True
>>> part = ThrottledPart(b"0123456789", bucket)
>>> len(part), part[2:5]
(10, b'234')
"""

from __future__ import annotations

import time

from jsparse._src.engine.feed import Entry, Feed


class TokenBucket:
  """``bits_per_second`` of bandwidth, ``burst`` bytes of tokens at most (default: 64 KiB)."""

  def __init__(self, bits_per_second: float, burst: int = 1 << 16):
    self.rate = bits_per_second / 8.0
    self.burst = float(burst)
    self._tokens = self.burst
    self._last = time.monotonic()

  def transmit(self, size: int) -> float:
    """Waits until ``size`` bytes have passed; returns the seconds waited."""
    now = time.monotonic()
    self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
    self._last = now
    self._tokens -= size
    wait = max(0.0, -self._tokens / self.rate)
    if wait:
      time.sleep(wait)
    return wait


class ThrottledPart:
  """A part whose slices pass through ``bucket`` as they are read."""

  def __init__(self, data, bucket: TokenBucket):
    self._data, self._bucket = data, bucket

  def __len__(self) -> int:
    return len(self._data)

  def __getitem__(self, index: slice) -> bytes:
    chunk = bytes(self._data[index])
    self._bucket.transmit(len(chunk))
    return chunk


class ThrottledFeed:
  """``feed`` as seen from the far end of a link of ``bits_per_second``: every byte a rollout
  reads passes through one token bucket."""

  def __init__(self, feed: Feed, bits_per_second: float):
    self.feed = feed
    self.bucket = TokenBucket(bits_per_second)

  def __getattr__(self, name: str):
    return getattr(self.feed, name)

  def parts(self, entry: Entry, *args, **kwargs) -> list[ThrottledPart]:
    return [ThrottledPart(p, self.bucket) for p in self.feed.parts(entry, *args, **kwargs)]
