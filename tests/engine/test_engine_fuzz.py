"""A fuzz of the engine in the loop: a trainer publishing into a DirectoryFeed and rollouts
following it while random faults strike: failed writes (a full disk) at any part of a delta or
an anchor, parts lost, truncated or corrupted in place, anchor requests lost, rollouts and the
trainer restarted from states saved earlier, a restored twin of the trainer started while the
old one still publishes (its publishes refused, or its commit landing just after it was
replaced), forged, garbled, oversized and copied commits planted under real or future names,
the feed reset for a new run while the old trainer still runs (directory feeds), rollouts that
lag or join late with other bits.

Invariants: a rollout never holds wrong bits for the version it states (checked after every
poll); the trainer keeps publishing through every fault; once the faults stop, every rollout
reaches the trainer's newest version within ``_BOUND`` publishes, bit-exact.

The suite runs a few cases (``--fuzz-examples N`` runs N; each case reuses one plan's
compiled programs). ``JSPARSE_ENGINE_FUZZ_REPORT=path`` appends each case's outcome as a JSON
line: faults injected, polls, the longest stall (in publishes) observed.
"""

import errno
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.engine.feed import commit_bytes_cap
from jsparse.engine import DirectoryFeed, Entry, FencedError, Publisher, Subscriber
from jsparse.testing import bitwise_mismatches
from tests import strategies

_CASES = int(os.environ.get("JSPARSE_FUZZ_EXAMPLES", "6"))
_FAULT_STEPS, _CLEAN_STEPS, _BOUND = 14, 6, 3
_FAULTS = ("put_fail", "lose_part", "truncate", "flip", "drop_request", "restart_rollout",
           "restart_trainer", "twin_trainer", "forge", "reset", "none", "none")


class _FaultyFeed:
  """The trainer's view of the feed: ``fail_at`` makes the put of that many more parts fail
  (as a full disk would), counting every part of every entry."""

  def __init__(self, feed):
    self.feed, self.fail_at = feed, None

  def __getattr__(self, name):
    return getattr(self.feed, name)

  def put(self, entry, part, data):
    if self.fail_at is not None:
      if self.fail_at == 0:
        self.fail_at = None
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
      self.fail_at -= 1
    self.feed.put(entry, part, data)


class RolloutFeed:
  """A rollout's view of the feed: ``drop`` anchor requests are lost; the reads of the
  entries in ``damaged`` come back damaged (``"truncate"`` or ``"flip"``) once."""

  def __init__(self, feed):
    self.feed, self.drop, self.damaged = feed, 0, {}

  def __getattr__(self, name):
    return getattr(self.feed, name)

  def request_anchor(self):
    if self.drop:
      self.drop -= 1
      return
    self.feed.request_anchor()

  def parts(self, entry, *args, **kwargs):
    parts = self.feed.parts(entry, *args, **kwargs)
    how = self.damaged.pop(entry, None)
    if how is None:
      return parts
    parts = [bytes(p) for p in parts]
    data = bytearray(parts[-1])
    if how == "truncate":
      del data[len(data) // 2:]
    elif data:
      data[len(data) // 3] ^= 0x20
    parts[-1] = bytes(data)
    return parts


def _tree(rng):
  return {"w0": rng.normal(size=(32, 48)).astype(np.float32),
          "w1": rng.normal(size=1500).astype(np.float32),
          "b": rng.normal(size=40).astype(np.float32)}


def fuzz_plan() -> jsparse.Plan:
  tree = {k: jnp.asarray(v) for k, v in _tree(np.random.default_rng(0)).items()}
  return jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, bucket_size=512, capacity=0.1)


@pytest.fixture(scope="module")
def plan():
  return fuzz_plan()


def forge_commit(rng, feed, publisher) -> None:
  """Plants a commit the publisher did not write under this run's and generation's names: the
  next version's own name (squatted), or one far ahead; empty, garbled, oversized, or a real
  commit copied from another entry."""
  base = publisher.sender.version
  version = base + (1 if rng.random() < 0.5 else int(rng.integers(2, 60)))
  entry = Entry(version, ["delta", "anchor"][int(rng.integers(2))], base, 1,
                publisher.generation, publisher.run)
  real = [e for e in feed.entries() if e.run == publisher.run]
  try:
    record = [b"", b"[" * 900, b" " * (commit_bytes_cap(1) + 1),
              feed.read_commit(real[0]) if real else b"{}"][int(rng.integers(4))]
    feed.put(entry, 0, b"forged")
    feed.commit(entry, record)
  except Exception:  # noqa: BLE001 - a name the real publisher holds already: nothing planted
    pass


def _host_copy(state):
  return jsparse.SyncState(*[np.array(x) if i != 3 else {k: np.array(v) for k, v in x.items()}
                             for i, x in enumerate(state)])


def damage_files(root: Path):
  """Damages one part file of a committed entry of the DirectoryFeed at ``root`` in place;
  whether there was one."""
  def damage(rng, feed, rollouts, how: str) -> bool:
    files = sorted(root.glob("v*/part-*.bin"))
    if not files:
      return False
    path = files[int(rng.integers(len(files)))]
    if how == "lose_part":
      path.unlink()
    elif how == "truncate":
      os.truncate(path, int(rng.integers(0, max(1, path.stat().st_size))))
    else:
      data = bytearray(path.read_bytes())
      if data:
        data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(data))
    return True
  return damage


def damage_reads(rng, feed, rollouts, how: str) -> bool:
  """For feeds whose objects cannot be changed in place (Ray): an entry is lost (removed from
  the feed), or one rollout's next read of it comes back damaged."""
  entries = feed.entries()
  if not entries:
    return False
  entry = entries[int(rng.integers(len(entries)))]
  if how == "lose_part":
    feed.remove(entry)
  else:
    rollouts[int(rng.integers(len(rollouts)))]["view"].damaged[entry] = how
  return True


@pytest.mark.parametrize("seed", range(_CASES))
def test_rollouts_stay_exact_and_catch_up_once_faults_stop(plan, seed, tmp_path):
  run_case(plan, seed, DirectoryFeed(tmp_path / "feed"), damage_files(tmp_path / "feed"))


def run_case(plan, seed: int, feed, damage) -> dict:
  """One fuzz case on ``feed``, faults of stored parts made by ``damage``; returns its
  outcome (also appended to ``JSPARSE_ENGINE_FUZZ_REPORT``, if set)."""
  rng = np.random.default_rng(1000 + seed)
  trainer_feed = _FaultyFeed(feed)
  params = {k: jnp.asarray(v) for k, v in _tree(np.random.default_rng(0)).items()}
  history = {}  # (run, version) -> the rollout bits it stands for
  options = dict(anchor_every=[None, 3, 5][int(rng.integers(3))],
                 keep=[0, 2, 8][int(rng.integers(3))], chunk_bytes=int(rng.choice([800, 4000])))
  publisher = Publisher(jsparse.Sender(plan, params), trainer_feed, **options)
  history[(publisher.run, 0)] = plan.cast(params)
  initial = history[(publisher.run, 0)]
  trainer_saves = [_host_copy(publisher.sender.state())]

  def rollout(start, **kwargs):
    view = RolloutFeed(feed)
    return {"sub": Subscriber(start, view, stall_versions=2, stall_seconds=3600, **kwargs),
            "view": view, "period": int(rng.integers(1, 4)), "saves": [], "lag": 0,
            "longest": 0}

  rollouts = [rollout(jsparse.Receiver(plan, initial))]
  late_join = int(rng.integers(1, _FAULT_STEPS))
  faults: dict[str, int] = {}
  polls = 0
  for step in range(1, _FAULT_STEPS + _CLEAN_STEPS + 1):
    faulty = step <= _FAULT_STEPS
    fault = _FAULTS[int(rng.integers(len(_FAULTS)))] if faulty else "none"
    if fault == "put_fail":
      trainer_feed.fail_at = int(rng.integers(0, 6))
    elif fault == "drop_request":
      rollouts[int(rng.integers(len(rollouts)))]["view"].drop += 1
    elif fault == "restart_trainer":
      saved = trainer_saves[int(rng.integers(len(trainer_saves)))]
      publisher = Publisher(jsparse.Sender.restore(plan, saved), trainer_feed, **options)
    elif fault == "twin_trainer":  # restored again while the old one still runs
      zombie = publisher
      publisher = Publisher(jsparse.Sender.restore(plan, trainer_saves[-1]), trainer_feed,
                            **options)
      other = {k: v + 0.5 for k, v in params.items()}  # bits no rollout may ever hold
      if rng.random() < 0.5:
        with pytest.raises(FencedError):
          zombie.publish(other)
      else:  # it checked just before it was replaced: its commit lands
        zombie._check_fenced = lambda: None
        try:
          zombie.publish(other)
        except OSError:
          pass
    elif fault == "forge":
      forge_commit(rng, feed, publisher)
    elif fault == "reset" and not isinstance(feed, DirectoryFeed):
      fault = "none"  # a Ray feed's run cannot be reset from outside
    elif fault == "reset":  # a new run on the same feed while the old trainer still runs
      old = publisher
      os.unlink(feed.root / "RUN")
      publisher = Publisher(jsparse.Sender(plan, params), trainer_feed, **options)
      history[(publisher.run, 0)] = plan.cast(params)
      trainer_saves = [_host_copy(publisher.sender.state())]
      with pytest.raises(FencedError, match="now belongs to run"):
        old.publish(params)
    elif fault == "restart_rollout":
      r = rollouts[int(rng.integers(len(rollouts)))]
      if r["saves"]:
        saved = r["saves"][int(rng.integers(len(r["saves"])))]
        fresh = rollout(jsparse.Receiver.restore(plan, saved))
        r.update(sub=fresh["sub"], view=fresh["view"], lag=0)
    if step == late_join:  # joins with other bits: takes only anchors until one applies
      other = {k: v + 1 for k, v in initial.items()}
      rollouts.append(rollout(jsparse.Receiver(plan, other), start_with_anchor=True))

    params = {k: jnp.asarray(strategies.nudge_leaf(rng, np.asarray(v), 0.02))
              for k, v in params.items()}
    before = publisher.sender.version
    try:
      publisher.publish(params)
    except OSError:
      assert fault == "put_fail"
      trainer_feed.fail_at = None
    if publisher.sender.version != before:  # also when the delta went in and the anchor failed
      history[(publisher.run, publisher.sender.version)] = plan.cast(params)
    if fault == "put_fail" and trainer_feed.fail_at is not None:
      trainer_feed.fail_at = None  # the version had fewer parts than the failure's index
    if rng.random() < 0.5:
      trainer_saves.append(_host_copy(publisher.sender.state()))
    if fault in ("lose_part", "truncate", "flip") and not damage(rng, feed, rollouts, fault):
      fault = "none"
    faults[fault] = faults.get(fault, 0) + 1

    for r in rollouts:
      if faulty and step % r["period"]:
        continue
      sub = r["sub"]
      sub.poll()
      polls += 1
      if sub.version:  # the bits it serves are the version it states, exactly
        held = (sub.receiver.run_id.hex(), sub.version)
        assert not bitwise_mismatches(sub.params, history[held]), (seed, step)
      r["lag"] = r["lag"] + 1 if (sub.version or 0) < publisher.sender.version else 0
      r["longest"] = max(r["longest"], r["lag"])
      if rng.random() < 0.3 and sub.version:
        r["saves"].append(_host_copy(sub.receiver.state()))
    if not faulty and step - _FAULT_STEPS >= _BOUND:
      for r in rollouts:  # liveness: within _BOUND publishes after the faults stopped
        assert r["sub"].version == publisher.sender.version, (seed, step, r["sub"].stats)
        assert r["sub"].stats.stalled is None
  outcome = {"feed": type(feed).__name__, "seed": seed, "options": options, "faults": faults,
             "polls": polls, "rollouts": len(rollouts),
             "longest_stall_publishes": max(r["longest"] for r in rollouts),
             "anchors": sum(r["sub"].stats.anchors for r in rollouts),
             "skipped": sum(r["sub"].stats.skipped for r in rollouts)}
  report = os.environ.get("JSPARSE_ENGINE_FUZZ_REPORT")
  if report:
    with open(report, "a") as out:
      out.write(json.dumps(outcome) + "\n")
  return outcome
