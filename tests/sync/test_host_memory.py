"""A whole ``send`` and a whole ``receive`` work a segment at a time: neither side's host holds
every change of a version. Sixteen segments of random bits, 20% changed; small coding blocks
keep the per-block temporaries small, so what is measured grows with the changes."""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.sync import programs
from jsparse._src.wire import compact
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.part_bytes import read_part


def _synced_pair(monkeypatch, seed: int, coding: str = "ranked"):
  """(plan, sender, receiver, the next params): one version already synced, and the slot
  levels it asked for compiled."""
  monkeypatch.setattr(compact, "_BLOCK", 1024)
  rng = np.random.default_rng(seed)
  params = {f"w{i:02d}": jnp.asarray(strategies.random_bits(rng, (1 << 16,), np.float32))
            for i in range(16)}
  perturb = lambda tree: jax.tree.map(
      lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), 0.2)), tree)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.3)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  new = perturb(params)
  receiver.receive(sender.send(new))
  assert programs.wait_for_slot_levels(timeout=600)  # the steady state: none compiling
  return plan, sender, receiver, perturb(new)


def _peak(fn):
  """(``fn()``, the peak of traced host allocations while it ran)."""
  tracemalloc.start()
  out = fn()
  top = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return out, top


@pytest.mark.parametrize("coding", ["ranked", "positioned"])
def test_a_whole_send_holds_one_segments_changes_not_all(monkeypatch, coding):
  """On the host, every change of a version is 12 bytes (int32 position, two uint16 bit
  patterns, int32 rank): the send's peak stays under that (the coded streams, the payload and
  one segment's changes; random bits code to ~3 bytes a change), where moving every change to
  the host first took 1.3-1.6x it."""
  plan, sender, receiver, new = _synced_pair(monkeypatch, 4, coding)
  data, peak = _peak(lambda: sender.send(new))
  assert_trees_bitwise_equal(receiver.receive(data), plan.cast(new))
  changed = sender.last_stats.changed
  assert changed > 150_000
  assert peak < 12 * changed, (peak, changed)


def test_a_receive_stages_each_unit_as_it_is_decoded(monkeypatch):
  """The host's peak is the decompressed streams and a few units' records, well under what
  decoding every record of the part takes."""
  plan, sender, receiver, new = _synced_pair(monkeypatch, 3)
  data = sender.send(new)
  _, decode_peak = _peak(lambda: read_part(plan, data))
  out, receive_peak = _peak(lambda: receiver.receive(data))
  assert_trees_bitwise_equal(out, plan.cast(new))
  assert sender.last_stats.changed > 150_000
  assert receive_peak < 0.7 * decode_peak, (receive_peak, decode_peak)
