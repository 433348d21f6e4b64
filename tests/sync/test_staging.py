"""Records staged on the receiver's devices as they are decoded (``sync/staging.py``): whatever
the pieces, their order and the blocks they are cut into, the slots hold exactly the staged
changes, on the devices of the segment's leaves; and a receiving stream keeps no decoded
records on the host between parts."""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from jsparse._src.sync import programs, staging
from tests import strategies


def _plan(size=4000, capacity=0.02):
  params = {"w": jnp.zeros(size, jnp.float32), "b": jnp.zeros(100, jnp.float32)}
  return params, jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=capacity,
                                   bucket_size=size)


def test_pieces_in_any_order_fill_the_slots_with_exactly_their_changes(monkeypatch):
  monkeypatch.setattr(staging, "MAX_BLOCK", 16)  # so the pieces below span several blocks
  params, plan = _plan()
  seg = plan.segments[0]
  assert staging.block_size(seg) == 16
  rng = np.random.default_rng(0)
  keys = rng.choice(seg.size, 60, replace=False).astype(np.int32)
  values = rng.integers(0, 2**16, 60).astype(np.uint16)
  staged = staging.StagedRecords(plan, jax.tree.leaves(plan.cast(params)))
  for lo, hi in [(40, 60), (0, 7), (7, 40)]:  # out of order, of several blocks, one short
    staged.add(0, keys[lo:hi], values[lo:hi])
  inputs = staged.inputs(ranked=(False, False))
  n = programs.slots_needed(plan, [60, 0])[0]
  key, value = np.asarray(inputs.keys[0]), np.asarray(inputs.values[0])
  assert inputs.counts.tolist() == [60, 0] and key.shape == (n,)
  assert sorted(zip(key[:60].tolist(), value[:60].tolist())) == sorted(
      zip(keys.tolist(), values.tolist()))
  assert (key[60:] == seg.size).all() and (value[60:] == 0).all()
  assert (np.asarray(inputs.keys[1]) == plan.segments[1].size).all()


def test_slots_lie_replicated_on_the_mesh_of_the_segments_leaves():
  params, plan = _plan()
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  flat = [jax.device_put(x, NamedSharding(mesh, P("x"))) for x in
          jax.tree.leaves(plan.cast(params))]
  staged = staging.StagedRecords(plan, flat)
  staged.add(0, np.array([5, 3], np.int32), np.array([1, 2], np.uint16))
  inputs = staged.inputs(ranked=(False, False), slot_counts=[70, 0])
  for x in inputs.keys + inputs.values:
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)
  assert len(inputs.keys[0]) == programs.slots_needed(plan, [70, 0])[0]
  assert np.asarray(inputs.keys[0])[:2].tolist() == [5, 3]


def test_a_receiving_stream_holds_no_decoded_records_between_parts():
  """Decoded, the version's records are 6 bytes per change; staged, they are on the device:
  after every part is added, the host holds a small fraction of that."""
  rng = np.random.default_rng(2)
  params = {f"w{i}": jnp.asarray(strategies.random_bits(rng, (1 << 17,), np.float32))
            for i in range(4)}
  new = jax.tree.map(lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), 0.2)),
                     params)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.3)
  sender, receiver = jsparse.Sender(plan, params), jsparse.Receiver(plan, plan.cast(params))
  receiver.receive(list(sender.send_stream(new, chunk_bytes=1 << 18)))  # compiles
  new = jax.tree.map(lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), 0.2)), new)
  parts = list(sender.send_stream(new, chunk_bytes=1 << 18))
  decoded_bytes = 6 * sender.last_stats.changed
  stream = receiver.open_stream()
  assert programs.wait_for_slot_levels(timeout=600)  # (their compilations allocate too)
  tracemalloc.start()
  for part in parts:
    stream.add(part)
  held = tracemalloc.get_traced_memory()[0]
  tracemalloc.stop()
  assert_trees_bitwise_equal(stream.commit(), plan.cast(new))
  assert len(parts) == 4 and decoded_bytes > 500_000
  assert held < 0.1 * decoded_bytes, (held, decoded_bytes)
