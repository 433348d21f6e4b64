"""``coding="auto"``: its choice follows the workload (not the first delta), is re-decided when
the density or the link moves, and is made on every path (payloads, parts, streams)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.sync import auto
from jsparse._src.wire import parts as parts_wire
from jsparse._src.wire.payload import Coding
from jsparse.benchmarks.scale import layered_tree, rl_like_update
from jsparse.testing import assert_trees_bitwise_equal

FIXED = tuple(c for c in Coding if c is not Coding.AUTO)


@pytest.fixture(autouse=True)
def own_calibrations(monkeypatch):
  """Each test starts with no calibration of any plan, and leaves none to other tests."""
  monkeypatch.setattr(auto, "_RATES", {})


@pytest.fixture(scope="module")
def run():
  """A tree, its plan, and the updates of a run: an RL step after each of the first two."""
  tree = layered_tree(8, 128)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, capacity=0.05)
  steps = [tree]
  for seed in range(3, 7):
    steps.append(rl_like_update(steps[-1], seed=seed))
  return plan, steps


def _jolt(tree):
  """Every element changed: every segment overflows."""
  return jax.tree.map(lambda x: np.asarray(x) * 1.5 + 1.0, tree)


# 10 kbit/s: there a few kB more outweigh how much the codings' compute differs on a CPU (at
# 1 Mbit/s, under XLA's -O0 or on a loaded machine, packed's 2.3 kB fewer, 19 ms, can weigh
# less than its slower device passes, and auto rightly takes another coding; 184 ms at
# 100 kbit/s, and a loaded machine's timings vary several-fold).
SLOW_LINK_GBIT = 1e-5


def _bytes_per_step(plan, updates, coding, link_gbit=SLOW_LINK_GBIT):
  sender = jsparse.Sender(plan, updates[0], coding=coding, link_gbit=link_gbit)
  receiver = jsparse.Receiver(plan, plan.cast(updates[0]))
  sizes, chosen = [], []
  for params in updates[1:]:
    data = sender.send(params)
    receiver.receive(data)
    assert_trees_bitwise_equal(receiver.params, plan.cast(params))
    sizes.append(len(data))
    chosen.append(sender.last_stats.coding)
  return sizes, chosen, sender


@pytest.mark.parametrize("first", ["empty", "jolt"])
def test_auto_follows_the_workload_not_a_degenerate_first_delta(run, first):
  """Calibrated on an empty first delta or a jolt in which every segment overflows, then fed
  RL steps over a 10 kbit/s link (bytes decide), auto sends within 1.1x of the smallest coding
  at every RL step."""
  plan, steps = run
  start = steps[0] if first == "empty" else _jolt(steps[0])
  # The run: the start, the degenerate delta to steps[0], then RL steps from there.
  updates = [start, steps[0], *steps[1:]]
  if first == "empty":
    updates = [steps[0], steps[0], *steps[1:]]
  sizes, chosen, sender = _bytes_per_step(plan, updates, Coding.AUTO)
  fixed = {c: _bytes_per_step(plan, updates, c)[0] for c in FIXED}
  for step in range(1, len(sizes)):  # the RL steps
    smallest = min(fixed[c][step] for c in FIXED)
    assert sizes[step] <= 1.1 * smallest, (step, chosen, sizes, fixed)
  assert chosen[0] == "ranked"  # nothing measured tells the codings apart yet
  assert sender._auto.calibrations == 2  # the degenerate delta, then the first RL step
  assert sender._auto.calibration.update.representative
  assert sender.last_stats.coding_rates is not None
  assert set(sender.last_stats.coding_rates) == {c.value for c in auto.CANDIDATES}


def _calibration(bytes_per_change: dict, update: auto.Update, seconds: dict | None = None):
  seconds = seconds or {c: 0.01 for c in bytes_per_change}
  return auto.Calibration({c: auto.CodingRate(seconds[c], b)
                           for c, b in bytes_per_change.items()}, update)


def test_auto_decides_again_when_the_density_or_the_link_moves():
  n = 10**7
  calls = []

  def measure(update, bpc):
    def calibrate():
      calls.append(update)
      return _calibration(bpc, update, {Coding.RANKED: 0.05, Coding.POSITIONED: 0.01})
    return calibrate

  bpc = {Coding.RANKED: 1.0, Coding.POSITIONED: 4.0}
  policy = auto.AutoCoding(link_gbit=1e-3, drift=4.0)
  one_percent = auto.Update(n // 100, n)
  assert policy.choose(None, measure(one_percent, bpc)) is Coding.RANKED
  assert len(calls) == 1
  # Steps at about the calibrated density: no new calibration, whatever the link.
  assert policy.choose(auto.Update(n // 80, n), measure(one_percent, bpc)) is Coding.RANKED
  policy.link_gbit = 1e4  # a fast link: the least work wins, decided again at once
  assert policy.choose(auto.Update(n // 80, n), measure(one_percent, bpc)) is Coding.POSITIONED
  assert len(calls) == 1
  # The density falls 10x (beyond drift): measured again on the next update.
  sparse = auto.Update(n // 1000, n)
  policy.choose(sparse, measure(sparse, bpc))
  assert len(calls) == 2 and policy.calibration.update is sparse
  # A degenerate update (empty, or mostly overflowed) never triggers a calibration.
  policy.choose(auto.Update(0, n), measure(auto.Update(0, n), bpc))
  policy.choose(auto.Update(n // 2, n, n // 2), measure(auto.Update(0, n), bpc))
  assert len(calls) == 2
  # What the chosen coding's sends really carry replaces its calibrated bytes per change.
  policy.link_gbit = 1e-3
  policy.observe(Coding.RANKED, sparse, 10 * sparse.changes)  # 10 B/change after all
  assert policy.choose(sparse, measure(sparse, bpc)) is Coding.POSITIONED
  assert policy.rates_used[Coding.RANKED].bytes_per_change == 10.0


def test_a_degenerate_calibration_sends_the_fewest_bytes_until_a_representative_one():
  n = 10**6
  policy = auto.AutoCoding(link_gbit=1e4)
  empty = _calibration({Coding.RANKED: 50.0, Coding.POSITIONED: 50.0}, auto.Update(0, n))
  assert policy.choose(None, lambda: empty) is auto.FEWEST_BYTES
  assert policy.rates_used is None
  rl = _calibration({Coding.RANKED: 1.0, Coding.POSITIONED: 4.0}, auto.Update(n // 100, n),
                    {Coding.RANKED: 0.05, Coding.POSITIONED: 0.01})
  assert policy.choose(auto.Update(n // 100, n), lambda: rl) is Coding.POSITIONED  # measured now
  assert policy.calibrations == 2


def test_auto_chooses_on_parts_and_streams(run):
  """Parts and streams carry the coding auto chose (their headers say so), exactly: versions
  sent whole and streamed by turns, in one run per link rate."""
  plan, steps = run
  seen = set()
  for first, link_gbit in enumerate((1e-6, 1e6)):
    sender = jsparse.Sender(plan, steps[0], coding="auto", link_gbit=link_gbit)
    receiver = jsparse.Receiver(plan, plan.cast(steps[0]))
    for k, params in enumerate(steps[1:4]):
      if (first + k) % 2 == 0:
        parts = [sender.send(params)]
        receiver.receive(parts)
      else:
        stream, parts = receiver.open_stream(), []
        for part in sender.send_stream(params, chunk_bytes=1 << 16):
          stream.add(part)
          parts.append(part)
        stream.commit()
      assert_trees_bitwise_equal(receiver.params, plan.cast(params))
      stats = sender.last_stats
      chosen = Coding(stats.coding)
      assert chosen in auto.CANDIDATES and stats.payload_bytes == sum(map(len, parts))
      for part in parts:
        header = parts_wire.read_index(plan, part).header
        assert (header.format, header.ranked) == (chosen.format, chosen.ranked)
      if stats.coding_rates is not None:
        rates = {Coding(c): auto.CodingRate(*r) for c, r in stats.coding_rates.items()}
        fewest = min(rates, key=lambda c: rates[c].bytes_per_change)
        if link_gbit == 1e-6:  # 1 kbit/s: the bytes decide
          assert rates[chosen].bytes_per_change <= 1.05 * rates[fewest].bytes_per_change
      seen.add(chosen)
  assert len(seen) >= 1
