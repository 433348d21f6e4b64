"""Rollouts never stall and never serve another run's weights: failed publishes (a full disk, a
lost store), lost anchor requests, refused sends, a reset feed and a second publisher; anchors
streamed in bounded parts."""

import errno
import logging

import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.engine import DirectoryFeed, Publisher, Subscriber
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.engine.test_engine_fuzz import RolloutFeed

def _states(count, seed=0):
  rng = np.random.default_rng(seed)
  states = [{**{f"w{i}": rng.normal(size=1024).astype(np.float32) for i in range(4)},
             "b": rng.normal(size=64).astype(np.float32)}]
  for _ in range(count):
    states.append({k: strategies.nudge_leaf(rng, v, 0.02) for k, v in states[-1].items()})
  return [{k: jnp.asarray(v) for k, v in s.items()} for s in states]


@pytest.fixture
def states():
  return _states(14)


@pytest.fixture
def plan(states):
  return jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, bucket_size=1024)


class _FailingFeed:
  """A feed whose ``put`` fails (as on a full disk) for the versions in ``fail`` (optionally
  only for one kind), after ``after`` parts of the version went through."""

  def __init__(self, feed, fail=(), kind=None, after=0):
    self.feed, self.fail, self.kind, self.after = feed, set(fail), kind, after
    self._seen = {}

  def __getattr__(self, name):
    return getattr(self.feed, name)

  def put(self, entry, part, data):
    if entry.version in self.fail and self.kind in (None, entry.kind):
      seen = self._seen.setdefault(entry, 0)
      self._seen[entry] += 1
      if seen >= self.after:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    self.feed.put(entry, part, data)


def test_a_failed_publish_never_stalls_a_rollout(plan, states, tmp_path):
  """Every version whose write fails is lost; the next one is an anchor labelled as one, and
  every rollout follows the trainer within one publish, bit-exact."""
  feed = DirectoryFeed(tmp_path)
  publisher = Publisher(jsparse.Sender(plan, states[0]), _FailingFeed(feed, {3, 4, 9}, after=1),
                        anchor_every=None, chunk_bytes=2048)
  subscriber = Subscriber(jsparse.Receiver(plan, plan.cast(states[0])), feed)
  for step, state in enumerate(states[1:], start=1):
    try:
      entries = publisher.publish(state)
    except OSError:
      assert step in (3, 4, 9)
      assert feed.pending()  # the failed version's first part is there, uncommitted
      continue
    if step in (5, 10):  # the first version after a failure resyncs: an anchor, as labelled
      assert [(e.kind, e.version, e.base) for e in entries] == [("anchor", step, step - 1)]
    subscriber.poll()
    assert subscriber.version == step and subscriber.stats.stalled is None
    assert_trees_bitwise_equal(subscriber.params, plan.cast(state))
    assert not feed.pending()  # the failed publish's leftovers were removed
  assert subscriber.stats.anchors == 2 and subscriber.stats.skipped == 0


def test_an_anchor_request_is_owed_until_an_anchor_is_committed(plan, states, tmp_path):
  """A rollout holding other bits asks for an anchor; the publisher takes the request, but the
  anchor's write fails: the anchor is owed and published with the next version."""
  feed = DirectoryFeed(tmp_path)
  publisher = Publisher(jsparse.Sender(plan, states[0]), _FailingFeed(feed, {1}, "anchor"),
                        anchor_every=None)
  other = {k: v + 1 for k, v in plan.cast(states[0]).items()}
  subscriber = Subscriber(jsparse.Receiver(plan, other), feed, start_with_anchor=True)
  with pytest.raises(OSError):
    publisher.publish(states[1])  # the delta is committed, the anchor is not
  assert subscriber.poll() == []
  (delta, anchor) = publisher.publish(states[2])
  assert (anchor.kind, anchor.version) == ("anchor", 2)
  assert subscriber.poll() == [2]
  assert_trees_bitwise_equal(subscriber.params, plan.cast(states[2]))


def _deaf(feed, drop):
  """``feed`` as a rollout sees it when its first ``drop`` anchor requests are lost."""
  view = RolloutFeed(feed)
  view.drop = drop
  return view


def test_a_stalled_rollout_says_why_and_asks_again_within_its_bound(plan, states, tmp_path,
                                                                     caplog):
  feed = DirectoryFeed(tmp_path)
  publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=None)
  other = {k: v + 1 for k, v in plan.cast(states[0]).items()}  # not the trainer's version 0
  subscriber = Subscriber(jsparse.Receiver(plan, other), _deaf(feed, drop=1),
                          stall_versions=2, stall_seconds=3600)
  publisher.publish(states[1])
  with caplog.at_level(logging.WARNING, "jsparse"):
    assert subscriber.poll() == []  # the delta does not fit its params: asks (lost)
    assert subscriber.stats.stalled and "holds version 1" in subscriber.stats.stalled
    publisher.publish(states[2])
    assert subscriber.poll() == [] and subscriber.stats.anchor_requests == 1
    publisher.publish(states[3])  # 2 versions on: it asks again, and is heard
    assert subscriber.poll() == [] and subscriber.stats.anchor_requests == 2
  assert any("stalled" in r.message and "the rollout asked the trainer for an anchor (its "
             "Publisher adds one at its next publish" in r.message for r in caplog.records)
  assert any("not applied" in r.message and "it is skipped and the rollout asked the trainer "
             "for an anchor" in r.message for r in caplog.records)
  assert not any("sender.send" in r.message for r in caplog.records)  # no advice for a trainer
  publisher.publish(states[4])
  assert subscriber.poll() == [4] and subscriber.stats.stalled is None
  assert_trees_bitwise_equal(subscriber.params, plan.cast(states[4]))


def test_a_stalled_rollout_asks_after_its_time_bound(plan, states, tmp_path):
  feed = DirectoryFeed(tmp_path)
  publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=None)
  other = {k: v + 1 for k, v in plan.cast(states[0]).items()}
  subscriber = Subscriber(jsparse.Receiver(plan, other), _deaf(feed, drop=1),
                          stall_versions=100, stall_seconds=0)
  publisher.publish(states[1])
  subscriber.poll()
  assert subscriber.stats.anchor_requests == 2  # the lost one, and one at once (0 s bound)
  publisher.publish(states[2])
  assert subscriber.poll() == [2]


def test_a_refused_send_changes_nothing_not_even_the_next_kind(plan, states):
  sender = jsparse.Sender(plan, states[0])
  receiver = jsparse.Receiver(plan, plan.cast(states[0]))
  other_tree = {"w0": states[1]["w0"]}
  refusals = [(jsparse.VersionError, lambda: sender.send(states[1], version=0)),
              (jsparse.PlanMismatchError, lambda: sender.send(other_tree)),
              (jsparse.PlanMismatchError, lambda: sender.send_stream(other_tree)),
              (jsparse.ConfigError, lambda: sender.send_stream(states[1], chunk_bytes=0))]
  sends = [sender.send, lambda p: list(sender.send_stream(p))]
  for step, send in enumerate(sends, start=1):
    for error, refused in refusals:
      with pytest.raises(error):
        refused()
    data = send(states[step])
    assert not sender.last_stats.anchor and sender.version == step
    assert sender.last_stats.payload_bytes < sender.last_stats.dense_bytes / 4
    receiver.receive(data)
    assert_trees_bitwise_equal(receiver.params, plan.cast(states[step]))


def test_anchors_are_streamed_in_parts_of_at_most_chunk_bytes(plan, states, tmp_path):
  feed = DirectoryFeed(tmp_path)
  chunk = 2048  # a 1,024-element leaf in bf16
  publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=2, chunk_bytes=chunk)
  publisher.publish(states[1])
  (delta, anchor) = publisher.publish(states[2])
  late = Subscriber(jsparse.Receiver(plan, {k: v + 1 for k, v in plan.cast(states[0]).items()}),
                    feed, start_with_anchor=True)
  assert anchor.kind == "anchor" and anchor.parts >= plan.rollout_bytes // chunk
  sizes = [len(bytes(p)) for p in feed.parts(anchor)]
  assert max(sizes) <= chunk + 512  # a part's data, plus its header and table
  assert late.poll() == [2]
  assert_trees_bitwise_equal(late.params, plan.cast(states[2]))


def test_a_rollout_restored_from_another_run_is_not_served_as_current(plan, tmp_path, caplog):
  old_run, new_run = _states(8, seed=1), _states(4, seed=2)
  feed = DirectoryFeed(tmp_path / "feed")
  old = Publisher(jsparse.Sender(plan, old_run[0]), feed, anchor_every=None)
  subscriber = Subscriber(jsparse.Receiver(plan, plan.cast(old_run[0])), feed)
  for state in old_run[1:]:
    old.publish(state)
  subscriber.poll()
  assert subscriber.version == 8
  saved = subscriber.receiver.state()
  assert saved.run is not None and bytes(saved.run) == old.sender.run_id

  feed = DirectoryFeed(tmp_path / "reset")  # the feed is reset (emptied) for a new run
  restored = Subscriber(jsparse.Receiver.restore(plan, saved), feed)
  new = Publisher(jsparse.Sender(plan, new_run[0]), feed, anchor_every=None)
  with caplog.at_level(logging.WARNING, "jsparse"):
    new.publish(new_run[1])
    assert restored.poll() == [] and restored.version is None  # no version of this run
  assert any("belongs to run" in r.message for r in caplog.records)
  new.publish(new_run[2])
  assert restored.poll() == [2]
  assert_trees_bitwise_equal(restored.params, plan.cast(new_run[2]))
  assert bytes(restored.receiver.state().run) == new.sender.run_id


def test_a_second_publisher_is_refused_and_a_restored_one_resumes(plan, states, tmp_path):
  feed = DirectoryFeed(tmp_path)
  first = Publisher(jsparse.Sender(plan, states[0]), feed)
  first.publish(states[1])
  with pytest.raises(jsparse.ConfigError, match="belongs to run"):
    Publisher(jsparse.Sender(plan, states[0]), feed)
  resumed = Publisher(jsparse.Sender.restore(plan, first.sender.state()), feed)
  assert resumed.generation == first.generation + 1
  # The delta continues the run; the anchor serves rollouts that lag behind the restart (they
  # follow only the newest generation).
  assert [(e.version, e.kind) for e in resumed.publish(states[2])] == [(2, "delta"),
                                                                       (2, "anchor")]
  with pytest.raises(jsparse.errors.FencedError, match="replaced"):
    first.publish(states[3])


def test_a_send_whose_coding_fails_after_the_diff_resyncs_with_an_anchor(plan, states,
                                                                          monkeypatch):
  from jsparse._src.sync import sender as sender_module
  sender = jsparse.Sender(plan, states[0])
  receiver = jsparse.Receiver(plan, plan.cast(states[0]))

  def broken(*args, **kwargs):
    raise RuntimeError("coding failed (injected)")

  with monkeypatch.context() as patch:
    patch.setattr(sender_module, "part_records", broken)
    with pytest.raises(RuntimeError):
      sender.send(states[1])
  restored = jsparse.Sender.restore(plan, sender.state())  # its state is consistent
  assert restored.version == sender.version == 1
  part = sender.send(states[2])
  assert sender.last_stats.anchor
  receiver.receive([part])
  assert_trees_bitwise_equal(receiver.params, plan.cast(states[2]))


def test_a_diff_that_fails_after_consuming_the_snapshot_resyncs_with_an_anchor(plan, states,
                                                                                monkeypatch):
  from jsparse._src.sync import programs
  sender = jsparse.Sender(plan, states[0])
  receiver = jsparse.Receiver(plan, plan.cast(states[0]))

  def consuming(plan, coding, snapshot, new, **kwargs):
    for x in snapshot:
      x.delete()  # as a donated program that failed on the device would leave it
    raise RuntimeError("device failure (injected)")

  with monkeypatch.context() as patch:
    patch.setattr(programs, "sender_changes", consuming)
    with pytest.raises(RuntimeError):
      sender.send(states[1])
  with pytest.raises(jsparse.VersionError, match="consumed"):
    sender.state()
  data = sender.send(states[2])
  assert sender.last_stats.anchor and sender.version == 1
  receiver.receive(data)
  assert_trees_bitwise_equal(receiver.params, plan.cast(states[2]))
  assert jsparse.Sender.restore(plan, sender.state()).digest == sender.digest
