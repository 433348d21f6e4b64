"""End-to-end sync time per step over a simulated link: from the trainer's new params to the
rollout's params applied, with every byte the rollout reads passing through a token bucket of
the link's bandwidth (``engine/link.py``, real sleeps). Sparse (a delta per step) against dense
(the full bf16 weights per step: an anchor), side by side in one run.

>>> import jax.numpy as jnp, jsparse
>>> states = [{'w': jnp.linspace(-1, 1, 1 << 14) + i * 1e-3} for i in range(3)]
>>> plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16)
>>> rows = link_times(plan, states, rates_gbit=(1.0,))
>>> sorted(rows[1.0]), rows[1.0]['dense']['bytes'] > rows[1.0]['sparse']['bytes']
(['dense', 'sparse'], True)
>>> sorted(stream_times(plan, states, rates_gbit=(1.0,), chunk_bytes=8192)[1.0])
['anchor one-shot', 'anchor streamed', 'delta one-shot', 'delta streamed']

:func:`stream_times` compares a version sent whole (one part: encode all, send all, decode and
apply all) with the same version streamed (``Sender.send_stream``: each part crosses the link
while the next is coded, and the receiver decodes each on arrival).
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from typing import Sequence

import jax

import jsparse
from jsparse.benchmarks._internals import ThrottledFeed, TokenBucket
from jsparse.engine import DirectoryFeed, Publisher, Subscriber


def _one(plan, states: Sequence, rate_gbit: float, dense: bool) -> dict:
  """Mean seconds and bytes per step from the trainer's params to the rollout's, over
  ``states[2:]`` (the first step compiles the programs: not timed): the trainer sends a delta
  (sparse) or an anchor (dense) per step into a directory feed; the rollout reads it through
  the link and applies it."""
  with tempfile.TemporaryDirectory() as root:
    feed = DirectoryFeed(root)
    publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=None)
    sender = publisher.sender
    subscriber = Subscriber(jsparse.Receiver(plan, plan.cast(states[0])),
                            ThrottledFeed(feed, rate_gbit * 1e9))
    times, sizes = [], []
    for state in states[1:]:
      start = time.perf_counter()
      publisher.publish(state, anchor=dense)
      before = subscriber.stats.bytes_read
      subscriber.poll()
      jax.block_until_ready(jax.tree.leaves(subscriber.params))
      times.append(time.perf_counter() - start)
      sizes.append(subscriber.stats.bytes_read - before)
    assert subscriber.version == sender.version
  times, sizes = times[1:], sizes[1:]
  return {"seconds": sum(times) / len(times), "bytes": sum(sizes) / len(sizes)}


def link_times(plan, states: Sequence, rates_gbit: Sequence[float] = (1.0, 10.0)) -> dict:
  """Per link rate (Gbit/s), the sparse and dense rows: mean end-to-end seconds and bytes."""
  return {rate: {"sparse": _one(plan, states, rate, False), "dense": _one(plan, states, rate, True)}
          for rate in rates_gbit}


def print_link_times(rows: dict) -> None:
  print("end-to-end sync per step (publish -> link -> applied), mean over the steps")
  print(f"{'link':>10} {'method':>7} {'bytes':>12} {'ms':>9}")
  for rate, methods in rows.items():
    for name, row in methods.items():
      print(f"{rate:>6g} Gb/s {name:>7} {row['bytes']:>12,.0f} {row['seconds'] * 1e3:>9.1f}")
    ratio = methods["dense"]["seconds"] / methods["sparse"]["seconds"]
    print(f"{'':>10} sparse is {ratio:.1f}x faster end to end")


def _streamed(sender, receiver, state, bucket: TokenBucket, full: bool, chunk_bytes: int):
  """The trainer thread codes parts and pushes each through the link; the rollout adds each as
  it arrives, then commits."""
  arrived: queue.Queue = queue.Queue()

  def trainer():
    try:
      for part in sender.send_stream(state, anchor=full, chunk_bytes=chunk_bytes):
        bucket.transmit(len(part))
        arrived.put(part)
    finally:
      arrived.put(None)

  thread = threading.Thread(target=trainer)
  thread.start()
  stream = receiver.open_stream()
  while (part := arrived.get()) is not None:
    stream.add(part)
  thread.join()
  return stream.commit()


def _one_shot(sender, receiver, state, bucket: TokenBucket, full: bool):
  data = sender.send(state, anchor=full)
  bucket.transmit(len(data))
  return receiver.receive([data])


def stream_times(plan, states: Sequence, rates_gbit: Sequence[float] = (1.0, 10.0),
                 chunk_bytes: int = 4 << 20) -> dict:
  """Per link rate, mean seconds per version (after a first, compiling one) from the trainer's
  params to the rollout's applied params, for deltas and anchors, sent whole or streamed."""
  rows: dict = {}
  for rate in rates_gbit:
    rows[rate] = {}
    for kind, full in (("delta", False), ("anchor", True)):
      for mode in ("one-shot", "streamed"):
        sender = jsparse.Sender(plan, states[0])
        receiver = jsparse.Receiver(plan, plan.cast(states[0]))
        bucket = TokenBucket(rate * 1e9)
        times = []
        for state in states[1:]:
          start = time.perf_counter()
          if mode == "streamed":
            out = _streamed(sender, receiver, state, bucket, full, chunk_bytes)
          else:
            out = _one_shot(sender, receiver, state, bucket, full)
          jax.block_until_ready(jax.tree.leaves(out))
          times.append(time.perf_counter() - start)
        assert receiver.digest == sender.digest
        rows[rate][f"{kind} {mode}"] = sum(times[1:]) / max(1, len(times) - 1)
  return rows


def print_stream_times(rows: dict, chunk_bytes: int = 4 << 20) -> None:
  print(f"a version sent whole against streamed in parts of {chunk_bytes / 2**20:g} MiB of "
        "rollout data (ms per version, mean)")
  for rate, methods in rows.items():
    line = "  ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in methods.items())
    print(f"{rate:>6g} Gb/s  {line}")


def lagging_rollout(plan, states: Sequence, lag: int = 4, keep: int = 1) -> dict:
  """Bytes a rollout lagging ``lag`` versions reads to catch up, with retention by need (the
  deltas back to the version it holds are kept while it is live) against a fixed ``keep``
  (it then takes the newest anchor and the deltas after it); and the bytes the feed holds."""
  lag = min(lag, len(states) - 1)
  rows = {}
  for name, retain in (("by need", 64), (f"keep {keep}", 0)):
    with tempfile.TemporaryDirectory() as root:
      feed = DirectoryFeed(root)
      publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=2, keep=keep,
                            retain_versions=retain)
      steady, lagging = (Subscriber(jsparse.Receiver(plan, plan.cast(states[0])), feed,
                                    rollout_id=rollout) for rollout in ("steady", "lagging"))
      lagging.poll()  # reports version 0, then lags
      for state in states[1:lag + 1]:
        publisher.publish(state)
        steady.poll()
      held = sum(feed.part_bytes(e) for e in feed.entries())
      lagging.poll()
      assert lagging.version == publisher.sender.version
      rows[name] = {"bytes_read": lagging.stats.bytes_read, "anchors": lagging.stats.anchors,
                    "deltas": lagging.stats.deltas, "feed_bytes": held, "lag": lag}
  return rows


def print_lagging_rollout(rows: dict) -> None:
  print("a rollout lagging behind the trainer catches up (bytes it reads, what the feed holds)")
  print(f"{'retention':>10} {'lag':>4} {'read':>12} {'anchors':>8} {'deltas':>7} {'feed':>12}")
  for name, x in rows.items():
    print(f"{name:>10} {x['lag']:>4} {x['bytes_read']:>12,} {x['anchors']:>8} {x['deltas']:>7} "
          f"{x['feed_bytes']:>12,}")
