"""Publisher -> DirectoryFeed -> Subscribers: lagging rollouts, retention, and faults (a
corrupt read, a corrupt or lost part, a rollout and a trainer restarted from Orbax state)."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jsparse
from jsparse.engine import DirectoryFeed, Publisher, Subscriber
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.meshes import place, trees


@pytest.fixture
def run(tmp_path):
  """A trainer tree on an 8-way FSDP mesh, its plan, and a stream of RL-like updates."""
  base, _ = trees(7, 0.0)
  plan = jsparse.make_plan(place(base, "fsdp8"), rollout_dtype=jnp.bfloat16, bucket_size=256)
  rng = np.random.default_rng(8)
  states = [base]
  for _ in range(12):
    states.append({k: strategies.nudge_leaf(rng, v, 0.03) for k, v in states[-1].items()})
  return plan, [place(s, "fsdp8") for s in states], DirectoryFeed(tmp_path / "feed")


def _rollout(plan, states, layout="dp2xtp4"):
  """A rollout that starts from the trainer's version 0 (e.g. the same initial checkpoint)."""
  start = jax.tree.map(np.asarray, plan.cast(states[0]))
  return jsparse.Receiver(plan, place(start, layout))


def test_rollouts_lagging_by_any_amount_catch_up_in_order(run):
  plan, states, feed = run
  publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=3, keep=3,
                        retain_versions=0)  # a fixed retention: only the last 3 deltas
  every, second, far = (Subscriber(_rollout(plan, states, layout), feed)
                        for layout in ("dp2xtp4", "fsdp4", "single"))
  applied = {id(s): [] for s in (every, second, far)}
  for step, state in enumerate(states[1:], start=1):
    publisher.publish(state)
    for sub, period in ((every, 1), (second, 2), (far, 5)):
      if step % period == 0:
        applied[id(sub)] += sub.poll()
    entries = feed.entries()
    anchors = [e.version for e in entries if e.kind == "anchor"]
    latest = publisher.sender.version
    assert len(anchors) == (step >= 3) and all(a > latest - 3 for a in anchors)  # one, recent
    assert all(e.version > latest - 3 or e.version >= max(anchors) for e in entries)  # bounded
  for sub in (every, second, far):
    sub.poll()
    assert sub.version == publisher.sender.version
    assert_trees_bitwise_equal(sub.params, plan.cast(states[-1]))
    seen = applied[id(sub)]
    assert seen == sorted(seen)
  assert every.stats.anchors == 0 and every.stats.deltas == len(states) - 1
  assert second.stats.anchors == 0  # lagged 2 < keep: the deltas
  assert far.stats.anchors >= 2  # lagged 5 > keep: anchors


class _DamagingFeed:
  """A feed whose next ``times`` reads of one version come back damaged in flight: a flipped
  bit, or the part cut short."""

  def __init__(self, feed, version, damage, times):
    self.feed, self.version, self.damage, self.times = feed, version, damage, times

  def __getattr__(self, name):
    return getattr(self.feed, name)

  def parts(self, entry, *args, **kwargs):
    parts = [bytes(p) for p in self.feed.parts(entry, *args, **kwargs)]
    if entry.version == self.version and entry.kind == "delta" and self.times:
      self.times -= 1
      if self.damage == "flip":
        damaged = bytearray(parts[0])
        damaged[len(damaged) // 2] ^= 0x08
        parts[0] = bytes(damaged)
      else:
        parts[0] = parts[0][:-7]
    return parts


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("times, recovered_by", [(1, "resend"), (2, "anchor")])
def test_a_part_damaged_in_flight_is_read_again_or_replaced_by_an_anchor(run, damage, times,
                                                                         recovered_by):
  plan, states, feed = run
  publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=None)
  subscriber = Subscriber(_rollout(plan, states), _DamagingFeed(feed, 2, damage, times))
  publisher.publish(states[1])
  publisher.publish(states[2])
  assert subscriber.poll() == ([1, 2] if recovered_by == "resend" else [1])
  assert subscriber.stats.retries == 1
  if recovered_by == "anchor":
    assert subscriber.stats.skipped == 1 and subscriber.stats.anchor_requests == 1
    publisher.publish(states[3])  # the request is honoured: a delta and an anchor of version 3
    assert subscriber.poll() == [3] and subscriber.stats.anchors == 1
  assert_trees_bitwise_equal(subscriber.params, plan.cast(states[subscriber.version]))


def test_a_lost_part_is_replaced_by_an_anchor(run):
  plan, states, feed = run
  publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=None)
  subscriber = Subscriber(_rollout(plan, states), feed)
  publisher.publish(states[1])
  subscriber.poll()
  (entry,) = publisher.publish(states[2])
  next(feed._dir(entry).glob("part-*.bin")).unlink()  # the storage lost it
  assert subscriber.poll() == [] and subscriber.stats.skipped == 1
  publisher.publish(states[3])
  assert subscriber.poll() == [3]
  assert_trees_bitwise_equal(subscriber.params, plan.cast(states[3]))


def _save(path, state):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)


def _load(path, plan, shardings):
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, jsparse.abstract_sync_state(plan, shardings))


def test_restarted_rollout_and_trainer_resume_from_orbax_state(run, tmp_path):
  plan, states, feed = run
  sender = jsparse.Sender(plan, states[0])
  publisher = Publisher(sender, feed, anchor_every=None)
  subscriber = Subscriber(_rollout(plan, states), feed)
  for state in states[1:4]:
    publisher.publish(state)
  subscriber.poll()
  _save(tmp_path / "rollout", subscriber.receiver.state())
  _save(tmp_path / "trainer", sender.state())  # the trainer's state at version 3
  for state in states[4:6]:
    publisher.publish(state)  # versions 4, 5: then the trainer dies
  shardings = jax.tree.map(lambda x: x.sharding, subscriber.params)
  del subscriber  # the rollout dies too; it restarts from its state of version 3
  subscriber = Subscriber(jsparse.Receiver.restore(plan, _load(tmp_path / "rollout", plan,
                                                               shardings)), feed)
  assert subscriber.poll() == [4, 5]
  trainer_shardings = jax.tree.map(lambda x: x.sharding, states[0])
  restarted = Publisher(jsparse.Sender.restore(plan, _load(tmp_path / "trainer", plan,
                                                           trainer_shardings)), feed)
  (anchor,) = restarted.publish(states[6])  # not version 4 again: an anchor newer than all
  assert (anchor.version, anchor.kind) == (6, "anchor")
  restarted.publish(states[7])
  assert subscriber.poll() == [6, 7]
  assert_trees_bitwise_equal(subscriber.params, plan.cast(states[7]))


def test_anchor_every_names_the_same_versions_on_a_sender_and_on_a_publisher(tmp_path):
  """``anchor_every=3``: versions 3 and 6 carry anchors, on a sender (sent as anchors) and on a
  publisher (published next to their deltas) alike; an anchor asked for in between (version 2)
  does not move them."""
  params = {"w": jnp.zeros(64)}
  plan = jsparse.make_plan(params)
  states = [{"w": jnp.full(64, float(v))} for v in range(1, 8)]
  sender, sent = jsparse.Sender(plan, params, anchor_every=3), []
  for version, state in enumerate(states, start=1):
    sender.send(state, anchor=version == 2)
    sent.append(sender.last_stats.anchor)
  publisher = Publisher(jsparse.Sender(plan, params), DirectoryFeed(tmp_path / "feed"),
                        anchor_every=3)
  published = [any(e.kind == "anchor" for e in publisher.publish(state, with_anchor=version == 2))
               for version, state in enumerate(states, start=1)]
  assert [v for v, a in enumerate(sent, start=1) if a] == [2, 3, 6]
  assert [v for v, a in enumerate(published, start=1) if a] == [2, 3, 6]
