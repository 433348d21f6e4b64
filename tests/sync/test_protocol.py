"""The protocol, Sender -> bytes -> Receiver: exact for any update, overflow fallback, versions,
anchors, catching up, refusals that leave no trace, the end-to-end digest, compilations."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from jsparse._src.sync import sender as sender_module
from jsparse._src.wire.payload import Kind, Mode, SegmentPayload
from tests.helpers import compilations
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.part_bytes import kind_of, modes_of, read_part, recoded


def _pair(params, max_capacity=None, **plan_options):
  plan = jsparse.make_plan(params, **plan_options)
  options = {} if max_capacity is None else {"max_capacity": max_capacity}
  return (plan, jsparse.Sender(plan, params, **options),
          jsparse.Receiver(plan, plan.cast(params)))


def _mixed_tree(seed):
  return strategies.mixed_tree(np.random.default_rng(seed))


def _mixed_plan():
  return jsparse.make_plan(_mixed_tree(0), capacity=0.2, **strategies.mixed_plan_options())


def _tree(rng, dtype=np.float32):
  return {"w": strategies.random_bits(rng, (200, 100), dtype),
          "b": strategies.random_bits(rng, (100,), dtype),
          "n": strategies.random_bits(rng, (7,), dtype)}


@settings(max_examples=15)
@given(strategies.trees_and_updates(), st.sampled_from([0.01, 0.3, 1.0]),
       st.sampled_from([0.01, 1.0]), st.sampled_from([1, 512]),
       st.sampled_from(list(jsparse.Coding)))
def test_any_update_roundtrips_exactly(pair, capacity, pooled_capacity, bucket_size, coding):
  base, new = pair
  plan = jsparse.make_plan(base, capacity=capacity, pooled_capacity=pooled_capacity,
                           bucket_size=bucket_size)
  sender = jsparse.Sender(plan, base, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(base))
  out = receiver.receive(sender.send(new))
  assert_trees_bitwise_equal(out, new)
  assert_trees_bitwise_equal(sender.snapshot, new)
  assert receiver.version == sender.version == 1


@pytest.mark.parametrize("widening", [True, False], ids=["widening", "static"])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.3, 1.0])
def test_multi_step_fp32_to_bf16_with_overflow_fallback(density, widening):
  """Exact at any density; with static slots (``max_capacity=0``) a segment past its capacity
  goes dense, and by default its slots widen and it stays sparse up to ``max_capacity``."""
  rng = np.random.default_rng(0)
  params = jax.tree.map(jnp.asarray, _tree(rng))
  plan, sender, receiver = _pair(params, None if widening else 0.0,
                                 rollout_dtype=jnp.bfloat16, capacity=0.01,
                                 pooled_capacity=0.05, bucket_size=1000)
  for _ in range(3):
    params = jax.tree.map(jnp.asarray, {k: strategies.perturb(rng, np.asarray(v), density)
                                        for k, v in params.items()})
    out = receiver.receive(sender.send(params))
    assert_trees_bitwise_equal(out, plan.cast(params))
    stats = sender.last_stats
    if widening:  # sparse up to max_capacity (0.8), then dense: never more than dense
      assert density > 0.8 or stats.overflowed_segments == 0
      assert stats.payload_bytes <= stats.dense_bytes + 1024
  stats = sender.last_stats
  if density >= 0.3 and not widening:
    assert stats.overflowed_segments == len(plan.segments)
  if density <= 0.001:
    assert stats.overflowed_segments == 0
  if density == 0.0:
    assert stats.changed == 0 and stats.payload_bytes < 200


def test_overflowed_segments_travel_densely_and_others_sparsely():
  rng = np.random.default_rng(1)
  params = _tree(rng)
  plan, sender, receiver = _pair(params, 0.0, capacity=0.01, bucket_size=1000)  # static slots
  new = dict(params, w=strategies.perturb(rng, params["w"], 0.5))
  data = sender.send(new)
  modes = modes_of(plan, data)
  w_segment = [i for i, s in enumerate(plan.segments) if s.size == 20000][0]
  assert modes[w_segment] == Mode.DENSE and modes.count(Mode.DENSE) == 1
  assert_trees_bitwise_equal(receiver.receive(data), new)


def test_payload_is_small_for_sparse_updates():
  params = {"w": jnp.zeros((1000, 1000), jnp.bfloat16)}
  plan, sender, receiver = _pair(params)
  new = {"w": params["w"].at[::10, ::10].set(1.0)}  # 1% of elements
  data = sender.send(new)
  assert sender.last_stats.changed == 10000
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
  anchor = sender.send(params, anchor=True)
  assert_trees_bitwise_equal(stranger.receive(anchor), params)
  assert stranger.version == sender.version == 2


def test_anchor_every():
  params = {"w": jnp.zeros(5000)}
  plan = jsparse.make_plan(params)
  sender = jsparse.Sender(plan, params, anchor_every=3)
  kinds = [kind_of(plan, sender.send(params)) for _ in range(6)]
  assert kinds == [Kind.DELTA, Kind.DELTA, Kind.ANCHOR] * 2


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


def test_refusals_say_what_to_do_next_on_the_receiving_side():
  params = {"w": jnp.zeros(5000)}
  plan, sender, receiver = _pair(params)
  p1 = sender.send({"w": params["w"].at[1].set(1.0)})
  p2 = sender.send({"w": params["w"].at[2].set(2.0)})
  with pytest.raises(jsparse.VersionError) as gap:
    receiver.receive(p2)
  message = str(gap.value)
  assert "nothing was applied" in message and "missed the versions after 0" in message
  assert "needs an anchor: a Subscriber asks for one by itself; with a bare Receiver, have the " \
      "trainer send one (sender.send(params, anchor=True))" in message
  receiver.receive(p1)
  with pytest.raises(jsparse.VersionError, match="replayed or reordered: drop it, this receiver "
                     "is past it"):
    receiver.receive(p1)
  anchor = sender.send(params, anchor=True)
  receiver.receive(anchor)
  with pytest.raises(jsparse.VersionError, match="drop it, this receiver is ahead of it"):
    receiver.receive(anchor)
  stranger = jsparse.Receiver(plan, {"w": jnp.ones(5000)}, version=sender.version)
  with pytest.raises(jsparse.IntegrityError, match="nothing was applied; this receiver needs an "
                     "anchor: a Subscriber asks"):
    stranger.receive(sender.send(params))
  _, sender, receiver = _pair(params)
  stream = receiver.open_stream()
  stream.add(sender.send({"w": jnp.ones(5000)}))
  stream.commit()
  with pytest.raises(jsparse.VersionError, match=r"open a new one \(receiver.open_stream\(\)\)"):
    stream.commit()


def test_sync_state_refusals_say_what_to_do():
  params = {"w": jnp.zeros(50), "b": {"c": jnp.zeros(3)}}
  plan, sender, receiver = _pair(params)
  other = jsparse.make_plan({"w": jnp.zeros(51), "b": {"c": jnp.zeros(3)}})
  with pytest.raises(jsparse.PlanMismatchError, match="another plan.*restore it with the plan it "
                     "was saved with.*or start from fresh params and take an anchor"):
    jsparse.Receiver.restore(other, receiver.state())
  with pytest.raises(jsparse.PlanMismatchError, match=r"from \.state\(\) of a Sender or Receiver"):
    jsparse.Receiver.restore(plan, {"w": 1})
  state = receiver.state()._replace(params={"w": params["w"], "b": {}})
  with pytest.raises(jsparse.PlanMismatchError, match=r"sync state params: tree structure differs "
                     r"from the plan at \['b'\]\['c'\]: the plan has a leaf there"):
    jsparse.Receiver.restore(plan, state)
  damaged = receiver.state()._replace(params={"w": jnp.ones(50), "b": {"c": jnp.zeros(3)}})
  with pytest.raises(jsparse.IntegrityError, match="restore another step, or start from fresh "
                     "params and take an anchor"):
    jsparse.Receiver.restore(plan, jax.tree.map(lambda x: x, damaged))


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
  for bad, message in [(bytes(flipped), "checksum"), (data[:-7], "truncated"),
                       (data[:10], "truncated"), (b"", "truncated"), (b"x" * 100, "magic"),
                       (foreign, "another plan"), ("not bytes", "must be the bytes of")]:
    error = jsparse.ArgumentError if isinstance(bad, str) else jsparse.PayloadError
    with pytest.raises(error, match=message):
      receiver.receive(bad)
    assert_trees_bitwise_equal(receiver.params, before)
    assert receiver.version == 0
  assert_trees_bitwise_equal(receiver.receive(data), sender.snapshot)


def test_receiver_refuses_params_that_do_not_match_the_plan():
  plan = jsparse.make_plan({"w": jnp.zeros(4)}, rollout_dtype=jnp.bfloat16)
  with pytest.raises(jsparse.PlanMismatchError, match=r"\['w'\] has dtype float32"):
    jsparse.Receiver(plan, {"w": jnp.zeros(4)})


@pytest.mark.compile_ahead  # counts the compilations of the default
@pytest.mark.parametrize("coding", ["ranked", "packed"])  # positioned: ranked minus ranks
def test_compilations_follow_the_distinct_chunks_not_the_leaves_or_the_density(coding):
  """One compilation per program and chunk structure: twelve layers of the same shapes compile
  as one layer does; the per-change programs take slots sized to each step's changes, at most
  ``programs.NUM_LEVELS`` variants (see ``programs.slots_needed``)."""
  from jsparse._src.core.chunks import chunks_of
  from jsparse._src.sync import programs
  rng = np.random.default_rng(5)
  params = {f"layer{i:02d}": jax.tree.map(jnp.asarray, _tree(rng)) for i in range(12)}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, bucket_size=1000, capacity=0.2)
  distinct = len({c.plan for c in chunks_of(plan)})
  assert len(plan.segments) == 14 and distinct == 2  # 12 matrices by 4; two pools, mixed
  once = (programs.diff_program, programs.digest_program)
  per_slots = (programs.sparse_program, programs.positions_program,
               programs.apply_program(True))
  before = [compilations(f) for f in once + per_slots]
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  for density in [0.0, 0.001, 0.01, 0.05, 0.1, 0.15, 0.3, 0.02, 0.0, 0.12]:
    params = jax.tree.map(lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), density)),
                          params)
    assert_trees_bitwise_equal(receiver.receive(sender.send(params)), plan.cast(params))
  grown = [compilations(f) - b for f, b in zip(once + per_slots, before)]
  assert all(g <= distinct for g in grown[:2]), grown
  assert all(g <= programs.NUM_LEVELS * distinct for g in grown[2:]), grown


def test_slots_follow_each_chunks_changes_not_the_fullest_chunk():
  """A pool (every element a slot) is not padded to its capacity because a matrix in another
  chunk needs all of its slots: each chunk scales down its own slots, and a sync through them
  is exact."""
  from jsparse._src.core.chunks import chunks_of
  from jsparse._src.sync import programs
  rng = np.random.default_rng(11)
  params = {**_tree(rng), "w2": strategies.random_bits(rng, (200, 100), np.float32)}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, bucket_size=1000, capacity=0.1)
  (m1, m2), (pool,) = sorted((c.segment_ids for c in chunks_of(plan)),
                             key=lambda ids: -plan.segments[ids[0]].size)
  assert plan.segments[pool].capacity == plan.segments[pool].size == 107
  counts = np.zeros(len(plan.segments), np.int32)
  counts[m1], counts[pool] = plan.segments[m1].capacity, 3
  slots = programs.slots_needed(plan, counts)
  assert slots[m1] == slots[m2] == 2000 and slots[pool] == 14  # 107 / 8
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  new = {**params, "w": strategies.perturb(rng, params["w"], 0.1), "n": params["n"].copy()}
  new["n"][2] = -new["n"][2]
  assert_trees_bitwise_equal(receiver.receive(sender.send(new)), plan.cast(new))


def test_decoded_but_wrong_payload_is_caught_end_to_end_and_applies_nothing():
  plan, tree = _mixed_plan(), _mixed_tree(0)
  sender = jsparse.Sender(plan, tree, coding="ranked")
  data = sender.send(strategies.nudge(np.random.default_rng(2), tree, 0.03))
  index, records = read_part(plan, data)
  s = next(i for i, r in enumerate(records) if r.mode == Mode.BY_RANK)
  bad_values = records[s].values.copy()
  bad_values[0] += 1  # one step more than the sender meant: structurally valid
  records[s] = SegmentPayload(Mode.BY_RANK, records[s].indices, bad_values)
  bad = recoded(plan, index, records)
  careful = jsparse.Receiver(plan, plan.cast(tree), donate=False)
  with pytest.raises(jsparse.IntegrityError, match="nothing was applied"):
    careful.receive(bad)
  assert_trees_bitwise_equal(careful.params, plan.cast(tree))
  assert careful.version == 0
  assert_trees_bitwise_equal(careful.receive(data), sender.snapshot)
  fast = jsparse.Receiver(plan, plan.cast(tree))  # donating: out of sync until an anchor
  with pytest.raises(jsparse.IntegrityError, match="is out of sync: this receiver needs an anchor"):
    fast.receive(bad)
  with pytest.raises(jsparse.IntegrityError, match="differ from the sender"):
    fast.receive(data)
  assert_trees_bitwise_equal(fast.receive(sender.send(sender.snapshot, anchor=True)),
                             sender.snapshot)


@pytest.mark.parametrize("coding", ["packed", "ranked"])
def test_lagging_receiver_catches_up_by_chain_or_anchor(coding):
  tree = _mixed_tree(5)
  plan = _mixed_plan()
  sender = jsparse.Sender(plan, tree, coding=coding, anchor_every=5)
  behind = jsparse.Receiver(plan, plan.cast(tree))
  other = jsparse.Receiver(plan, plan.cast(tree))
  rng = np.random.default_rng(6)
  sent, kinds = [], []
  for _ in range(6):
    tree = strategies.nudge(rng, tree, 0.02)
    sent.append(sender.send(tree))
    kinds.append(kind_of(plan, sent[-1]))
  assert kinds == [Kind.DELTA] * 4 + [Kind.ANCHOR, Kind.DELTA]  # version 5 is an anchor
  with pytest.raises(jsparse.VersionError):
    behind.receive(sent[2])  # missed versions 1 and 2
  for data in sent[:4]:  # the chain of missed payloads, in order
    behind.receive(data)
  assert behind.version == 4
  other.receive(sent[0])
  other.receive(sent[4])  # the anchor, from any base
  for data in sent[4:]:
    behind.receive(data)
  other.receive(sent[5])
  for receiver in (behind, other):
    assert_trees_bitwise_equal(receiver.params, plan.cast(tree))
    assert receiver.version == 6


@pytest.mark.parametrize("options, message", [
    ({"anchor_every": True}, "anchor_every must be an int >= 1"),
    ({"anchor_every": 0}, "anchor_every must be an int >= 1"),
    ({"anchor_every": 2.0}, "anchor_every must be an int >= 1"),
    ({"coding": "bogus"}, "coding must be one of"),
    ({"coding": 2}, "coding must be one of"),
])
def test_bad_options_are_config_errors_that_are_value_errors(options, message):
  plan = jsparse.make_plan({"w": jnp.zeros(4)})
  for error in (jsparse.ConfigError, ValueError, jsparse.JsparseError):
    with pytest.raises(error, match=message):
      jsparse.Sender(plan, {"w": jnp.zeros(4)}, **options)


def test_numpy_ints_are_valid_int_options():
  plan = jsparse.make_plan({"w": jnp.zeros(4)}, bucket_size=np.int64(2))
  sender = jsparse.Sender(plan, {"w": jnp.zeros(4)}, anchor_every=np.int32(2))
  assert sender.anchor_every == 2 and type(sender.anchor_every) is int


# --- 64-bit leaves (x64): ulp codes of any width -------------------------------------------------

@settings(max_examples=15)
@given(st.sampled_from([np.float64, np.int64, np.uint64]), st.integers(0, 2**32 - 1),
       st.sampled_from(list(jsparse.Coding)))
def test_64_bit_leaves_with_arbitrary_bit_jumps_roundtrip(dtype, seed, coding):
  rng = np.random.default_rng(seed)
  with jax.enable_x64(True):
    base = {"w": strategies.random_bits(rng, (300,), dtype),
            "small": strategies.random_bits(rng, (5,), dtype)}
    base["w"][:3] = np.array([0, 1, 2]).astype(dtype)  # 1.0 -> 2.0, 0 -> 2**40 below
    plan = jsparse.make_plan(base, capacity=0.5, bucket_size=100)
    sender = jsparse.Sender(plan, base, coding=coding)
    receiver = jsparse.Receiver(plan, base)
    for density in (0.01, 0.3):
      new = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
      new["w"][0] = np.array(2**40 if dtype != np.float64 else 2.0).astype(dtype)
      assert_trees_bitwise_equal(receiver.receive(sender.send(new)), new)
      base = new


# --- versions ------------------------------------------------------------------------------------

def test_a_replayed_older_anchor_is_refused_and_changes_nothing():
  params = {"w": jnp.zeros(100)}
  plan, sender, receiver = _pair(params)
  anchor = sender.send({"w": jnp.ones(100)}, anchor=True)
  receiver.receive(anchor)
  receiver.receive(sender.send({"w": jnp.full(100, 2.0)}))
  newer = sender.send({"w": jnp.full(100, 2.0)}, anchor=True)
  with pytest.raises(jsparse.VersionError, match="not newer"):
    receiver.receive(anchor)
  assert receiver.version == 2 and float(receiver.params["w"][0]) == 2.0
  receiver.receive(newer)  # a newer anchor is fine
  assert receiver.version == 3


@pytest.mark.parametrize("base_version, version", [(5, 5), (6, 5), (0, 2**64 - 1), (0, 2**63)])
def test_forged_header_versions_are_refused(base_version, version):
  params = {"w": jnp.zeros(100)}
  plan, sender, receiver = _pair(params)
  index, records = read_part(plan, sender.send({"w": jnp.ones(100)}))
  forged = recoded(plan, index, records, base_version=base_version, version=version)
  with pytest.raises(jsparse.PayloadError, match="versions must increase"):
    receiver.receive(forged)
  assert receiver.version == 0


def test_a_sender_refuses_a_version_past_int64():
  plan = jsparse.make_plan({"w": jnp.zeros(4)})
  sender = jsparse.Sender(plan, {"w": jnp.zeros(4)}, version=2**63 - 1)
  with pytest.raises(jsparse.VersionError, match="2\\*\\*63"):
    sender.send({"w": jnp.ones(4)})
  assert sender.version == 2**63 - 1


@pytest.mark.parametrize("stage", ["part_records", "encode_part"])  # the records; their bytes
def test_a_failed_encode_leaves_the_sender_on_an_anchor(monkeypatch, stage):
  params = {"w": jnp.zeros(100)}
  plan, sender, receiver = _pair(params)

  def broken(*args, **kwargs):
    raise RuntimeError("disk full")
  monkeypatch.setattr(sender_module, stage, broken)
  with pytest.raises(RuntimeError):
    sender.send({"w": jnp.ones(100)})
  monkeypatch.undo()
  data = sender.send({"w": jnp.full(100, 3.0)})
  assert kind_of(plan, data) == Kind.ANCHOR  # the receiver never saw the lost one
  assert_trees_bitwise_equal(receiver.receive(data), {"w": jnp.full(100, 3.0)})


# --- donation never deletes what the caller holds ----------------------------------------------

def test_a_donating_receiver_keeps_the_callers_arrays_alive():
  params = {"w": jnp.zeros(1000, jnp.bfloat16), "i": jnp.arange(10), "f": jnp.zeros(10)}
  plan = jsparse.make_plan(params)  # rollout_dtype=None: plan.cast returns the same arrays
  sender = jsparse.Sender(plan, params)
  receivers = [jsparse.Receiver(plan, plan.cast(params)), jsparse.Receiver(plan, sender.snapshot),
               jsparse.Receiver.restore(plan, sender.state())]
  new = {"w": params["w"].at[3].set(1.0), "i": params["i"] + 1, "f": params["f"]}
  data = sender.send(new)
  for receiver in receivers:
    assert_trees_bitwise_equal(receiver.receive(data), new)
  assert float(params["w"][3] + 1) == 1.0 and int(params["i"][0]) == 0  # all alive
  assert_trees_bitwise_equal(sender.snapshot, new)


def test_tied_weights_sync_and_apply_with_donation():
  w = jnp.zeros(500)
  tied = {"embed": w, "unembed": w}  # one array at two leaves
  plan = jsparse.make_plan(tied)
  sender, receiver = jsparse.Sender(plan, tied), jsparse.Receiver(plan, tied)
  new = {"embed": w.at[1].set(1.0), "unembed": w.at[1].set(1.0)}
  assert_trees_bitwise_equal(receiver.receive(sender.send(new)), new)
  out = jsparse.apply(plan, tied, jsparse.diff(plan, tied, new), donate=True)
  assert_trees_bitwise_equal(out, new)


# --- plans travel between processes ---------------------------------------------------------------

def test_plans_pickle_in_process_and_to_a_process_without_the_devices():
  import pickle
  import subprocess
  import sys
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("fsdp",))
  params = {"w": jax.device_put(jnp.zeros((64, 8)), NamedSharding(mesh, P("fsdp"))),
            "b": jnp.zeros(8)}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  again = pickle.loads(pickle.dumps(plan))
  assert again == plan and hash(again) == hash(plan) and again.fingerprint == plan.fingerprint
  sender = jsparse.Sender(again, params)  # the same devices: a working plan
  code = ("import pickle, sys, jax; plan = pickle.loads(sys.stdin.buffer.read()); "
          "print(jax.device_count(), plan.fingerprint.hex(), type(plan.leaves[1].layout.mesh)"
          ".__name__)")
  out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(plan),
                       capture_output=True, timeout=120, env={**os.environ, "XLA_FLAGS": ""})
  assert out.returncode == 0, out.stderr.decode()[-2000:]
  assert out.stdout.decode().split() == ["1", plan.fingerprint.hex(), "AbstractMesh"]
  assert sender.send(params)


def test_a_rollout_builds_the_trainers_plan_from_abstract_shapes():
  """No arrays shipped: ShapeDtypeStructs with shardings on an AbstractMesh give the trainer's
  fingerprint, and that plan serves a receiver."""
  from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("fsdp",))
  params = {"w": jax.device_put(jnp.zeros((64, 8)), NamedSharding(mesh, P("fsdp"))),
            "b": jnp.zeros(8)}
  trainer_plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  abstract_mesh = AbstractMesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  shapes = {"w": jax.ShapeDtypeStruct((64, 8), jnp.float32,
                                      sharding=NamedSharding(abstract_mesh, P("fsdp"))),
            "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
  rollout_plan = jsparse.make_plan(shapes, rollout_dtype=jnp.bfloat16)
  assert rollout_plan.fingerprint == trainer_plan.fingerprint
  receiver = jsparse.Receiver(rollout_plan, trainer_plan.cast(params))
  new = {"w": params["w"] + 1, "b": params["b"]}
  out = receiver.receive(jsparse.Sender(trainer_plan, params).send(new))
  assert_trees_bitwise_equal(out, trainer_plan.cast(new))
