"""Sender -> bytes -> Receiver: exact for any update, overflow fallback, refusals leave no trace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from jsparse._src import wire
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies


def _pair(params, **plan_options):
  plan = jsparse.make_plan(params, **plan_options)
  return plan, jsparse.Sender(plan, params), jsparse.Receiver(plan, plan.cast(params))


def _tree(rng, dtype=np.float32):
  return {"w": strategies.random_bits(rng, (200, 100), dtype),
          "b": strategies.random_bits(rng, (100,), dtype),
          "n": strategies.random_bits(rng, (7,), dtype)}


@settings(max_examples=40)
@given(strategies.trees_and_updates(), st.sampled_from([0.01, 0.3, 1.0]),
       st.sampled_from([0.01, 1.0]), st.sampled_from([1, 512]), st.sampled_from([1, 2]))
def test_any_update_roundtrips_exactly(pair, capacity, pooled_capacity, bucket_size,
                                       wire_format):
  base, new = pair
  plan = jsparse.make_plan(base, capacity=capacity, pooled_capacity=pooled_capacity,
                           bucket_size=bucket_size)
  sender = jsparse.Sender(plan, base, wire_format=wire_format)
  receiver = jsparse.Receiver(plan, plan.cast(base))
  out = receiver.receive(sender.send(new))
  assert_trees_bitwise_equal(out, new)
  assert_trees_bitwise_equal(sender.snapshot, new)
  assert receiver.version == sender.version == 1


@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.3, 1.0])
def test_multi_step_fp32_to_bf16_with_overflow_fallback(density):
  rng = np.random.default_rng(0)
  params = jax.tree.map(jnp.asarray, _tree(rng))
  plan, sender, receiver = _pair(params, rollout_dtype=jnp.bfloat16, capacity=0.01,
                                 pooled_capacity=0.05, bucket_size=1000)
  for _ in range(3):
    params = jax.tree.map(jnp.asarray, {k: strategies.perturb(rng, np.asarray(v), density)
                                        for k, v in params.items()})
    out = receiver.receive(sender.send(params))
    assert_trees_bitwise_equal(out, plan.cast(params))
  stats = sender.last_stats
  if density >= 0.3:
    assert stats["overflowed_segments"] == len(plan.segments)
  if density <= 0.001:
    assert stats["overflowed_segments"] == 0
  if density == 0.0:
    assert stats["changed"] == 0 and stats["payload_bytes"] < 200


def test_overflowed_segments_travel_densely_and_others_sparsely():
  rng = np.random.default_rng(1)
  params = _tree(rng)
  plan, sender, receiver = _pair(params, capacity=0.01, bucket_size=1000)
  new = dict(params, w=strategies.perturb(rng, params["w"], 0.5))
  data = sender.send(new)
  modes = [s.mode for s in wire.decode(plan, data).segments]
  w_segment = [i for i, s in enumerate(plan.segments) if s.size == 20000][0]
  assert modes[w_segment] == wire.DENSE and modes.count(wire.DENSE) == 1
  assert_trees_bitwise_equal(receiver.receive(data), new)


def test_payload_is_small_for_sparse_updates():
  params = {"w": jnp.zeros((1000, 1000), jnp.bfloat16)}
  plan, sender, receiver = _pair(params)
  new = {"w": params["w"].at[::10, ::10].set(1.0)}  # 1% of elements
  data = sender.send(new)
  assert sender.last_stats["changed"] == 10000
  assert len(data) < 10000 * 6 + 200  # int32 index + bf16 value at most, plus headers
  receiver.receive(data)


def test_anchor_resyncs_a_receiver_with_another_state():
  rng = np.random.default_rng(2)
  params = _tree(rng)
  plan = jsparse.make_plan(params)
  sender = jsparse.Sender(plan, params)
  stranger = jsparse.Receiver(plan, _tree(np.random.default_rng(99)))
  before = jax.tree.map(np.asarray, stranger.params)
  with pytest.raises(jsparse.IntegrityError, match="differ from the sender"):
    stranger.receive(sender.send(params))
  assert_trees_bitwise_equal(stranger.params, before) and stranger.version == 0
  anchor = sender.send(params, full=True)
  assert_trees_bitwise_equal(stranger.receive(anchor), params)
  assert stranger.version == sender.version == 2


def test_anchor_every():
  params = {"w": jnp.zeros(5000)}
  plan = jsparse.make_plan(params)
  sender = jsparse.Sender(plan, params, anchor_every=3)
  kinds = [wire.decode(plan, sender.send(params)).kind for _ in range(6)]
  assert kinds == [wire.DELTA, wire.DELTA, wire.ANCHOR] * 2


def test_version_gap_replay_and_reorder_are_refused_without_change():
  params = {"w": jnp.zeros(5000)}
  plan, sender, receiver = _pair(params)
  p1 = sender.send({"w": params["w"].at[1].set(1.0)})
  p2 = sender.send({"w": params["w"].at[2].set(2.0)})
  with pytest.raises(jsparse.VersionError, match="version 1 into 2.*holds version 0"):
    receiver.receive(p2)  # gap / reorder
  receiver.receive(p1)
  with pytest.raises(jsparse.VersionError, match="holds version 1"):
    receiver.receive(p1)  # replay
  out = receiver.receive(p2)
  assert float(out["w"][1]) == 0.0 and float(out["w"][2]) == 2.0


def test_corrupted_truncated_or_foreign_bytes_change_nothing():
  rng = np.random.default_rng(3)
  params = _tree(rng)
  plan, sender, receiver = _pair(params)
  data = sender.send(dict(params, w=strategies.perturb(rng, params["w"], 0.05)))
  before = jax.tree.map(np.asarray, receiver.params)
  other_plan = jsparse.make_plan(params, capacity=0.5, bucket_size=10)
  foreign = jsparse.Sender(other_plan, params).send(params)
  flipped = bytearray(data)
  flipped[len(data) // 2] ^= 0x10
  for bad, message in [(bytes(flipped), "checksum"), (data[:-7], "checksum"),
                       (data[:10], "truncated"), (b"", "truncated"), (b"x" * 100, "magic"),
                       (foreign, "another plan"), ("not bytes", "must be bytes")]:
    with pytest.raises(jsparse.PayloadError, match=message):
      receiver.receive(bad)
    assert_trees_bitwise_equal(receiver.params, before)
    assert receiver.version == 0
  assert_trees_bitwise_equal(receiver.receive(data), sender.snapshot)


def test_receiver_refuses_params_that_do_not_match_the_plan():
  plan = jsparse.make_plan({"w": jnp.zeros(4)}, rollout_dtype=jnp.bfloat16)
  with pytest.raises(jsparse.PlanMismatchError, match=r"\['w'\] has dtype float32"):
    jsparse.Receiver(plan, {"w": jnp.zeros(4)})


@pytest.mark.parametrize("wire_format", [1, 2])
def test_compilations_per_plan_are_bounded_whatever_the_density(wire_format):
  """One compilation per program and plan; the compact path's per-change programs take slots
  sized to each step's changes, at most 4 variants (see ``sync_steps.slots_needed``)."""
  from jsparse._src import sync_steps
  rng = np.random.default_rng(5)
  params = jax.tree.map(jnp.asarray, _tree(rng))
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, bucket_size=1000, capacity=0.2)
  once = (sync_steps.sender_step, sync_steps.digest)
  per_slots = (sync_steps.ranks, sync_steps.positions, sync_steps.apply_steps[True],
               sync_steps.apply_bits[True])
  before = [f._cache_size() for f in once + per_slots]
  sender = jsparse.Sender(plan, params, wire_format=wire_format)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  for density in [0.0, 0.001, 0.01, 0.05, 0.1, 0.15, 0.3, 0.02, 0.0, 0.12]:
    params = jax.tree.map(lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), density)),
                          params)
    receiver.receive(sender.send(params))
  grown = [f._cache_size() - b for f, b in zip(once + per_slots, before)]
  assert all(g <= 1 for g in grown[:2]), grown
  assert all(g <= 4 for g in grown[2:]), grown
