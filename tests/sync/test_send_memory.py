"""A whole ``send`` moves and codes the diff a segment at a time: the host never holds every
change."""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from jsparse._src.wire import compact
from tests import strategies


@pytest.mark.parametrize("coding", ["ranked", "positioned"])
def test_a_whole_send_holds_one_segments_changes_not_all(monkeypatch, coding):
  """On the host, every change of a version is 12 bytes (int32 position, two uint16 bit
  patterns, int32 rank): the send's peak stays under that (the coded streams, the payload and
  one segment's changes; random bits code to ~3 bytes a change), where moving every change to
  the host first took 1.3-1.6x it. Small coding blocks keep the per-block temporaries small."""
  monkeypatch.setattr(compact, "_BLOCK", 1024)
  rng = np.random.default_rng(4)
  params = {f"w{i:02d}": jnp.asarray(strategies.random_bits(rng, (1 << 16,), np.float32))
            for i in range(16)}
  perturb = lambda tree: jax.tree.map(
      lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), 0.2)), tree)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.3)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  new = perturb(params)
  receiver.receive(sender.send(new))  # compiles
  new = perturb(new)
  tracemalloc.start()
  data = sender.send(new)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert_trees_bitwise_equal(receiver.receive(data), plan.cast(new))
  changed = sender.last_stats.changed
  assert changed > 150_000
  assert peak < 12 * changed, (peak, changed)
