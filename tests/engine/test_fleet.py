"""The trainer knows what every rollout holds: statuses in the feed, the fleet view, bounded
staleness (a synchronous and an asynchronous loop), retention by need, and weights that samples
can be stamped with. Processes of their own: test_fleet_processes.py."""

import logging
import threading
import time

import pytest

import jsparse
from jsparse._src.engine.records import Status, status_record
from jsparse.engine import DirectoryFeed, HmacKey, ObjectStoreFeed, Publisher, Subscriber
from jsparse.errors import StalenessError
from jsparse.testing import assert_trees_bitwise_equal


from tests.engine.fleet_states import PLAN, STATES


@pytest.fixture(params=["directory", "object"])
def feed(request, tmp_path):
  if request.param == "directory":
    return DirectoryFeed(tmp_path / "feed")
  return ObjectStoreFeed(f"file://{tmp_path}/store", grace_seconds=0)


def _rollout(feed, **kwargs):
  return Subscriber(jsparse.Receiver(PLAN, PLAN.cast(STATES[0])), feed, **kwargs)


def test_the_fleet_view_says_what_every_rollout_holds(feed):
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None)
  fast, slow = _rollout(feed, rollout_id="fast"), _rollout(feed, rollout_id="slow")
  assert publisher.fleet() == []
  for step in (1, 2, 3):
    publisher.publish(STATES[step])
    fast.poll()
    if step == 1:
      slow.poll()
  rows = {r.rollout: r for r in publisher.fleet()}
  assert sorted(rows) == ["fast", "slow"]
  assert (rows["fast"].version, rows["fast"].lag_versions, rows["fast"].lag_seconds) == (3, 0, 0)
  assert (rows["slow"].version, rows["slow"].lag_versions) == (1, 2)
  assert rows["slow"].lag_seconds > 0 and rows["fast"].digest_ok and rows["slow"].digest_ok
  assert all(r.live and r.stalled is None and r.refused is None for r in rows.values())
  assert fast.weights.version == 3 and fast.weights.digest == fast.receiver.digest.hex()
  assert fast.weights.generation == publisher.generation


def test_a_rollout_that_stops_reporting_is_gone_and_a_restarted_one_is_recognised(feed):
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None,
                        gone_seconds=0.3)
  rollout = _rollout(feed, rollout_id="r-0")
  publisher.publish(STATES[1])
  rollout.poll()
  saved = rollout.receiver.state()
  assert [r.gone for r in publisher.fleet()] == [False]
  time.sleep(0.4)
  assert [r.gone for r in publisher.fleet()] == [True]
  restarted = Subscriber(jsparse.Receiver.restore(PLAN, saved), feed, rollout_id="r-0")
  publisher.publish(STATES[2])
  assert restarted.poll() == [2]
  (row,) = publisher.fleet()
  assert (row.rollout, row.version, row.gone, row.digest_ok) == ("r-0", 2, False, True)


class _Deaf:
  """The rollout's view of a feed whose anchor requests are lost."""

  def __init__(self, feed):
    self.feed = feed

  def __getattr__(self, name):
    return getattr(self.feed, name)

  def request_anchor(self):
    pass


def test_refusals_and_stalls_are_reported(feed):
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None)
  other = {k: v + 1 for k, v in PLAN.cast(STATES[0]).items()}
  rollout = Subscriber(jsparse.Receiver(PLAN, other), _Deaf(feed), rollout_id="other-bits",
                       stall_versions=100)
  publisher.publish(STATES[1])
  rollout.poll()  # its bits are not version 0's: the delta is refused
  (row,) = publisher.fleet()
  assert (row.version, row.digest_ok) == (0, False) and "not applied" in row.refused
  publisher.publish(STATES[2])
  rollout.poll()
  (row,) = publisher.fleet()
  assert row.stalled and "no anchor newer" in row.stalled
  publisher.publish(STATES[3], with_anchor=True)
  rollout.poll()
  (row,) = publisher.fleet()
  assert (row.version, row.refused, row.stalled, row.digest_ok) == (3, None, None, True)


def test_forged_and_garbled_statuses_are_ignored_with_a_warning(feed, caplog):
  key = HmacKey(b"k" * 32)
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, key=key, anchor_every=None)
  rollout = _rollout(feed, key=key, rollout_id="real")
  publisher.publish(STATES[1])
  rollout.poll()
  forged = Status("forged", 1, publisher.generation, "00" * 8, time.time(), None, None, 1)
  feed.put_status("forged", status_record(publisher.run, forged, None))  # unsigned
  feed.put_status("garbled", b"[" * 3000)
  feed.put_status("other-run", status_record("cd" * 16, forged, key))
  with caplog.at_level(logging.WARNING, "jsparse"):
    assert [r.rollout for r in publisher.fleet()] == ["real"]
  assert sum("ignoring a status" in r.message for r in caplog.records) == 3


def test_a_synchronous_loop_never_runs_ahead_of_its_rollouts(feed):
  """Train, sync, generate: version v is published only once every rollout holds v - 1."""
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None, max_lag=0,
                        lag_timeout=30)
  rollouts = [_rollout(feed, rollout_id=f"gen-{i}") for i in range(2)]
  for r in rollouts:
    r.poll()  # reported: the trainer waits for them
  seen, stop = [], threading.Event()

  def generate(rollout):
    version = 1
    while not stop.is_set() and version <= 6:
      rollout.wait_for(version, timeout=30)
      seen.append((version, rollout.weights.version))
      version += 1

  threads = [threading.Thread(target=generate, args=(r,)) for r in rollouts]
  for t in threads:
    t.start()
  try:
    for step in range(1, 7):
      publisher.publish(STATES[step])
      held = [r.version for r in publisher.fleet()]
      assert all(v >= step - 1 for v in held), (step, held)
  finally:
    stop.set()
    for t in threads:
      t.join(timeout=60)
  assert all(r.version == 6 for r in rollouts)
  assert_trees_bitwise_equal(rollouts[0].params, PLAN.cast(STATES[6]))


def test_an_asynchronous_loop_is_off_policy_by_at_most_k(feed, caplog):
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=None, max_lag=2,
                        lag_timeout=0.3)
  rollout = _rollout(feed, rollout_id="slow")
  rollout.poll()
  for step in (1, 2, 3):
    publisher.publish(STATES[step])  # the rollout holds 0: within 2 of 1, 2 and 3 - 1
  with pytest.raises(StalenessError, match="slow at 0"):
    publisher.publish(STATES[4])
  rollout.poll()
  publisher.publish(STATES[4])
  lenient = Publisher(jsparse.Sender.restore(PLAN, publisher.sender.state()), feed,
                      anchor_every=None, max_lag=0, lag_timeout=0.2, on_lag="log")
  with caplog.at_level(logging.WARNING, "jsparse"):
    lenient.publish(STATES[5])
  assert any("publishing anyway" in r.message for r in caplog.records)
  with pytest.raises(StalenessError, match="holds version"):
    Subscriber(jsparse.Receiver(PLAN, PLAN.cast(STATES[0])), feed).wait_for(99, timeout=0.2)


@pytest.mark.parametrize("retain_versions, anchors", [(64, 0), (0, 1)])
def test_retention_follows_the_slowest_live_rollout(feed, retain_versions, anchors):
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=3, keep=2,
                        retain_versions=retain_versions, gone_seconds=30)
  steady, slow = _rollout(feed, rollout_id="steady"), _rollout(feed, rollout_id="slow")
  slow.poll()
  for step in range(1, 11):
    publisher.publish(STATES[step])
    steady.poll()
  deltas = sorted(e.version for e in feed.entries() if e.kind == "delta")
  if retain_versions:
    assert deltas == list(range(1, 11))  # back to the version the slow rollout holds
  assert slow.poll() == ([9, 10] if anchors else list(range(1, 11)))
  assert (slow.stats.anchors, slow.stats.deltas > 0) == (anchors, True)
  assert_trees_bitwise_equal(slow.params, PLAN.cast(STATES[10]))


def test_a_gone_rollout_holds_nothing_back(feed):
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=3, keep=2,
                        gone_seconds=0.2)
  steady, dead = _rollout(feed, rollout_id="steady"), _rollout(feed, rollout_id="dead")
  dead.poll()
  time.sleep(0.3)
  for step in range(1, 8):
    publisher.publish(STATES[step])
    steady.poll()
  deltas = sorted(e.version for e in feed.entries() if e.kind == "delta")
  assert deltas[0] > 1  # nothing kept for the rollout that is gone
  assert {r.rollout: r.gone for r in publisher.fleet()} == {"steady": False, "dead": True}


def test_a_trainer_and_two_rollout_processes_on_a_directory(tmp_path, caplog):
  from tests.engine.fleet_scenario import check, feed_spec, run_scenario
  feed = DirectoryFeed(tmp_path / "feed")
  check(run_scenario(feed, feed_spec(feed, tmp_path), tmp_path, caplog))
