"""One publisher per feed, even across restores and resets; versions that verify before they
are trusted; signed versions; reads bounded by what the commit says; no request storms; linear
publishing. Every feed kind that stores files or objects (a directory, an object store)."""

import json
import logging
import os
import shutil

import jax.numpy as jnp
import pytest

import jsparse
from jsparse._src.engine.ledger import Ledger
from jsparse._src.engine.records import commit_record, part_meta
from jsparse.engine import (DirectoryFeed, Ed25519Key, Entry, FencedError, HmacKey,
                            ObjectStoreFeed, PartsLostError, Publisher, Subscriber)
from jsparse.testing import assert_trees_bitwise_equal
from tests.engine.fleet_states import nudged_states


def _states(count, seed=0):
  return nudged_states(count, seed, size=2048)


_PAIR = Ed25519Key.generate()
KEY_PAIRS = [(HmacKey(b"s" * 32), HmacKey(b"s" * 32)),
             (_PAIR, Ed25519Key(public_key=_PAIR.public_bytes()))]
STATES = _states(10)
PLAN = jsparse.make_plan(STATES[0], rollout_dtype=jnp.bfloat16, bucket_size=1024)


@pytest.fixture(params=["directory", "object"])
def make_feed(request, tmp_path):
  """Opens the feed at ``tmp_path`` (every call a new client of the same feed)."""
  if request.param == "directory":
    return lambda: DirectoryFeed(tmp_path / "feed")
  return lambda: ObjectStoreFeed(f"file://{tmp_path}/store", grace_seconds=0)


def _rollout(feed, **kwargs):
  return Subscriber(jsparse.Receiver(PLAN, PLAN.cast(STATES[0])), feed, **kwargs)


class _Witness:
  """Every (version -> bits) a rollout served: one version must never name two states."""

  def __init__(self):
    self.seen = {}

  def check(self, subscriber):
    if subscriber.version is not None:
      digest = subscriber.receiver.digest
      assert self.seen.setdefault(subscriber.version, digest) == digest, subscriber.version


def test_a_trainer_restored_twice_fences_its_zombie(make_feed):
  check_twin_publishers(make_feed)


def check_twin_publishers(make_feed):
  """A trainer restored twice from one state: the older is refused, rollouts follow the newer,
  and no version number names two states (also run on Ray and S3 feeds)."""
  first = Publisher(jsparse.Sender(PLAN, STATES[0]), make_feed(), anchor_every=None)
  first.publish(STATES[1])
  saved = first.sender.state()
  zombie = Publisher(jsparse.Sender.restore(PLAN, saved), make_feed(), anchor_every=None)
  rollouts, witness = [_rollout(make_feed()) for _ in range(2)], _Witness()
  zombie.publish(STATES[2])  # the zombie publishes before its replacement starts
  rollouts[0].poll()
  witness.check(rollouts[0])
  replacement = Publisher(jsparse.Sender.restore(PLAN, saved), make_feed(), anchor_every=None)
  assert replacement.generation > zombie.generation > first.generation
  with pytest.raises(FencedError, match=f"generation {replacement.generation} .* replaced"):
    zombie.publish(STATES[3])
  with pytest.raises(FencedError):
    first.publish(STATES[3])
  for step in (4, 5):
    replacement.publish(STATES[step])
    for rollout in rollouts:
      rollout.poll()
      witness.check(rollout)
  for rollout in rollouts:
    assert rollout.version == replacement.sender.version
    assert rollout.generation == replacement.generation
    assert_trees_bitwise_equal(rollout.params, PLAN.cast(STATES[5]))


def test_a_zombies_commit_after_it_was_replaced_is_never_applied(make_feed):
  """The race a fence check cannot close: the zombie checked, then was replaced, then
  committed. Rollouts that list its commit also see the newer generation and ignore it."""
  zombie = Publisher(jsparse.Sender(PLAN, STATES[0]), make_feed(), anchor_every=None)
  zombie.publish(STATES[1])
  rollout, witness = _rollout(make_feed()), _Witness()
  assert rollout.poll() == [1]
  witness.check(rollout)
  replacement = Publisher(jsparse.Sender.restore(PLAN, zombie.sender.state()), make_feed(),
                          anchor_every=None)
  zombie._check_fenced = lambda: None  # its check passed just before the replacement started
  zombie.publish(STATES[7])  # committed as version 2 of the zombie's generation
  assert rollout.poll() == []
  replacement.publish(STATES[2])
  assert rollout.poll() == [2]
  witness.check(rollout)
  assert_trees_bitwise_equal(rollout.params, PLAN.cast(STATES[2]))


def test_a_feed_reset_for_a_new_run_refuses_the_old_trainer(make_feed, tmp_path):
  old = Publisher(jsparse.Sender(PLAN, STATES[0]), make_feed(), anchor_every=None)
  old.publish(STATES[1])
  feed = make_feed()
  _remove_run_marker(feed, tmp_path)
  new_states = _states(4, seed=5)
  new = Publisher(jsparse.Sender(PLAN, new_states[0]), make_feed(), anchor_every=None)
  rollout = Subscriber(jsparse.Receiver(PLAN, PLAN.cast(new_states[0])), make_feed())
  with pytest.raises(FencedError, match="now belongs to run"):
    old.publish(STATES[2])
  assert rollout.poll() == []  # the old run's version 1 is not this run's
  new.publish(new_states[1])
  assert rollout.poll() == [1]
  assert_trees_bitwise_equal(rollout.params, PLAN.cast(new_states[1]))


def _remove_run_marker(feed, tmp_path):
  if isinstance(feed, DirectoryFeed):
    os.unlink(feed.root / "RUN")
  else:
    os.unlink(tmp_path / "store" / "RUN")


def test_a_new_run_on_old_entries_serves_none_of_them(make_feed, tmp_path):
  old = Publisher(jsparse.Sender(PLAN, STATES[0]), make_feed(), anchor_every=None)
  for step in (1, 2, 3):
    old.publish(STATES[step], with_anchor=step == 3)
  _remove_run_marker(make_feed(), tmp_path)
  new_states = _states(2, seed=6)
  new = Publisher(jsparse.Sender(PLAN, new_states[0]), make_feed(), anchor_every=None)
  fresh = _rollout(make_feed(), start_with_anchor=True)
  assert fresh.poll() == [] and fresh.version is None  # not the old run's anchor 3
  new.publish(new_states[1], anchor=True)
  assert fresh.poll() == [1]
  assert_trees_bitwise_equal(fresh.params, PLAN.cast(new_states[1]))


def test_another_runs_version_copied_into_the_feed_is_ignored(tmp_path):
  ours, theirs = DirectoryFeed(tmp_path / "ours"), DirectoryFeed(tmp_path / "theirs")
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), ours, anchor_every=None)
  publisher.publish(STATES[1])
  (anchor,) = Publisher(jsparse.Sender(PLAN, STATES[0]), theirs).publish(STATES[8], anchor=True)
  rollout = _rollout(ours)
  assert rollout.poll() == [1]
  shutil.copytree(theirs._dir(anchor), ours._dir(anchor))  # under its own name
  renamed = Entry(8, "anchor", 0, anchor.parts, publisher.generation, publisher.run)
  shutil.copytree(theirs._dir(anchor), ours._dir(renamed))  # under a name of this run
  assert rollout.poll() == []
  assert_trees_bitwise_equal(rollout.params, PLAN.cast(STATES[1]))
  publisher.publish(STATES[2])
  assert rollout.poll() == [2]


def test_forged_commit_names_delete_nothing_and_stall_nothing(make_feed, tmp_path):
  """An empty commit named 50 versions ahead, and names beyond int64: ignored for retention,
  numbering and catch-up."""
  feed = make_feed()
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=2, keep=1)
  rollout = _rollout(make_feed())
  publisher.publish(STATES[1])
  ahead = Entry(55, "anchor", 0, 1, publisher.generation, publisher.run)
  feed.put(ahead, 0, b"")
  feed.commit(ahead, b"")
  huge = ahead.name.replace(f"v{55:020d}", "v50000000000000000000")
  if isinstance(feed, DirectoryFeed):
    (feed.root / huge).mkdir()
    (feed.root / huge / "COMMITTED").write_bytes(b"")
  else:
    (tmp_path / "store" / "commits" / huge).write_bytes(b"")
  for step in range(2, 6):
    publisher.publish(STATES[step])
    assert rollout.poll() == [step] and rollout.stats.stalled is None
  restarted = Publisher(jsparse.Sender.restore(PLAN, publisher.sender.state()), make_feed())
  restarted.publish(STATES[6])
  assert rollout.poll() == [6]
  assert_trees_bitwise_equal(rollout.params, PLAN.cast(STATES[6]))
  kept = [e.version for e in make_feed().entries() if e.run == publisher.run]
  assert 6 in kept and 55 in kept  # the forged name stays: only this publisher's anchors count


@pytest.mark.parametrize("raw", [b"[" * 2000, b"{" * 5000, b'{"record": ' * 1000, b"\xff" * 10,
                                 json.dumps({"record": {"format": "jsparse-commit/1"},
                                             "signed": None}).encode()])
def test_a_malformed_commit_is_the_feeds_typed_error(tmp_path, raw):
  feed = DirectoryFeed(tmp_path)
  entry = Entry(1, "delta", 0, 200, 1, "ab" * 16)  # a commit of 200 parts may take 13 kB
  for k in range(entry.parts):
    feed.put(entry, k, b"part")
  feed.commit(entry, raw)
  with pytest.raises(PartsLostError, match="not a commit of this entry"):
    Ledger(feed, None).commit_of(entry)
  assert Ledger(feed, None).commits("ab" * 16) == []


@pytest.mark.parametrize("trainer_key, rollout_key", KEY_PAIRS, ids=["hmac", "ed25519"])
def test_signed_versions_refuse_forged_replayed_and_unsigned_commits(make_feed, trainer_key,
                                                                     rollout_key):
  check_signed_versions(make_feed, trainer_key, rollout_key)


def check_signed_versions(make_feed, trainer_key, rollout_key):
  """Unsigned, wrongly signed and replayed commits are not applied by a keyed rollout (also
  run on Ray and S3 feeds)."""
  feed = make_feed()
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, key=trainer_key,
                        anchor_every=None)
  rollout, unkeyed = _rollout(make_feed(), key=rollout_key), _rollout(make_feed())
  (entry,) = publisher.publish(STATES[1])
  assert rollout.poll() == [1] and unkeyed.poll() == [1]
  # A forger who can write to the feed but holds no key: an unsigned anchor, an anchor signed
  # by another key, and a real signed commit replayed under another version's name.
  sender = jsparse.Sender(PLAN, STATES[0])
  for version, key in ((5, None), (6, HmacKey(b"x" * 32))):
    forged_entry = Entry(version, "anchor", 0, 1, publisher.generation, publisher.run)
    data = next(iter(sender.send_stream(STATES[9], anchor=True, version=version,
                                        chunk_bytes=1 << 30)))
    feed.put(forged_entry, 0, data)
    feed.commit(forged_entry, commit_record(forged_entry, [part_meta(data)], key))
  replayed = Entry(7, "delta", 1, entry.parts, publisher.generation, publisher.run)
  for k, part in enumerate(feed.parts(entry, Ledger(feed, None).commit_of(entry).parts)):
    feed.put(replayed, k, bytes(part))
  feed.commit(replayed, feed.read_commit(entry))
  assert rollout.poll() == []
  assert_trees_bitwise_equal(rollout.params, PLAN.cast(STATES[1]))
  assert unkeyed.poll() == [6]  # without a key, anyone who can write can forge
  publisher.publish(STATES[2])
  assert rollout.poll() == [2]
  assert_trees_bitwise_equal(rollout.params, PLAN.cast(STATES[2]))
  if not rollout_key.can_sign:
    with pytest.raises(jsparse.ConfigError, match="only a public key"):
      Publisher(jsparse.Sender(PLAN, STATES[0]), make_feed(), key=rollout_key)


def test_reads_are_bounded_by_what_the_commit_says(tmp_path):
  feed = ObjectStoreFeed(f"file://{tmp_path}/store")
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None)
  (entry,) = publisher.publish(STATES[1])
  root = tmp_path / "store"
  (root / "RUN").write_bytes(b"0" * (1 << 20))
  with pytest.raises(PartsLostError, match="more than the 33 expected: not read"):
    feed.run_id()
  part = root / "parts" / entry.name / "part-00000.bin"
  committed = Ledger(feed, None).commit_of(entry).parts
  part.write_bytes(part.read_bytes() + b"\0" * (1 << 20))
  with pytest.raises(PartsLostError, match=f"more than the {committed[0].size} expected"):
    feed.parts(entry, committed)
  (root / "commits" / entry.name).write_bytes(b" " * (1 << 20))
  with pytest.raises(PartsLostError, match="expected: not read"):
    feed.read_commit(entry)


def test_a_forged_commit_of_many_parts_starts_no_request_storm(tmp_path, caplog):
  feed = ObjectStoreFeed(f"file://{tmp_path}/store", max_concurrency=4)
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None)
  rollout = _rollout(ObjectStoreFeed(f"file://{tmp_path}/store"))
  forged = Entry(9, "anchor", 0, 99_999, publisher.generation, publisher.run)
  feed.put(forged, 0, b"x")
  (tmp_path / "store" / "commits").mkdir(parents=True, exist_ok=True)
  (tmp_path / "store" / "commits" / forged.name).write_bytes(b"{}")
  read = []
  real_get = ObjectStoreFeed._get
  rollout.feed._get = lambda key, cap: read.append(key) or real_get(rollout.feed, key, cap)
  with caplog.at_level(logging.WARNING, "jsparse"):
    assert rollout.poll() == []
  assert not any(forged.name in key for key in read)  # ignored unread: more parts than a plan
  started = []
  real_part = feed._part
  feed._part = lambda e, k, size: started.append(k) or real_part(e, k + 1, size)
  with pytest.raises(PartsLostError, match="part [0-9]+ is gone"):
    feed.parts(forged, [part_meta(b"x")] * forged.parts)
  assert len(started) <= 8  # the first failure stopped the rest
  publisher.publish(STATES[1])
  assert rollout.poll() == [1]


@pytest.mark.parametrize("kind", ["directory", "object"])
def test_publishing_n_parts_costs_n_puts_and_one_listing(tmp_path, kind):
  counts = {}
  for parts in (60, 240, 960):
    entry = Entry(1, "anchor", 0, parts, 1, "ab" * 16)
    if kind == "object":
      feed = ObjectStoreFeed(f"file://{tmp_path}/{parts}")
      calls = []
      real_call = feed._call
      feed._call = lambda what, fn, *a, **k: calls.append(what.split()[0]) or real_call(
          what, fn, *a, **k)
    else:
      feed, calls = DirectoryFeed(tmp_path / str(parts)), []
      real_scandir = os.scandir
      os.scandir = lambda *a: calls.append("listing") or real_scandir(*a)
    try:
      for k in range(parts):
        feed.put(entry, k, b"p")
      Ledger(feed, None).commit(entry, [part_meta(b"p")] * parts)
    finally:
      os.scandir = real_scandir if kind == "directory" else os.scandir
    counts[parts] = calls.count("listing")
  assert counts == {60: 1, 240: 1, 960: 1}


def test_restart_clean_up_of_many_leftovers_is_bounded_and_reported(tmp_path):
  feed = DirectoryFeed(tmp_path)
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None)
  for k in range(40):
    feed.put(Entry(1 + k, "delta", k, 2, publisher.generation, publisher.run), 0, b"half")
  restarted = Publisher(jsparse.Sender.restore(PLAN, publisher.sender.state()), feed,
                        cleanup_batch=16)
  assert restarted.leftovers == 24 and len(feed.pending()) == 24
  restarted.publish(STATES[1])
  restarted.publish(STATES[2])
  assert restarted.leftovers == 0 and feed.pending() == []


def test_a_forged_commit_squatting_the_next_name_does_not_stop_publishing(make_feed):
  feed = make_feed()
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None)
  rollout = _rollout(make_feed())
  (entry,) = publisher.publish(STATES[1])
  squatted = Entry(2, "delta", 1, entry.parts, publisher.generation, publisher.run)
  for k in range(squatted.parts):
    feed.put(squatted, k, b"forged")
  feed.commit(squatted, b"[" * 500)
  assert rollout.poll() == [1]
  assert publisher.publish(STATES[2]) == [squatted]  # its own commit replaced the forged one
  rollout.ledger.recheck_seconds = 0  # as if its time to read refused commits again had come
  assert rollout.poll() == [2]
  assert_trees_bitwise_equal(rollout.params, PLAN.cast(STATES[2]))
