"""make_plan: segments, capacities, rollout dtypes and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jsparse


def test_large_leaves_get_own_segments_small_ones_are_pooled():
  tree = {"big": jnp.zeros((300, 300)), **{f"b{i:02d}": jnp.zeros((100,)) for i in range(43)}}
  plan = jsparse.make_plan(tree, bucket_size=1000, capacity=0.01)
  sizes = sorted((s.size, len(s.leaf_ids)) for s in plan.segments)
  assert sizes == [(300, 3)] + [(1000, 10)] * 4 + [(90000, 1)]
  big = [s for s in plan.segments if s.size == 90000][0]
  assert big.capacity == 900
  assert all(s.capacity == s.size for s in plan.segments if s.pooled)


def test_pools_are_per_dtype_and_cover_every_leaf_once():
  tree = {"a": jnp.zeros(3, jnp.int8), "b": jnp.zeros(3, jnp.float32), "c": jnp.zeros(3, bool),
          "d": jnp.zeros((), jnp.float16), "e": jnp.zeros((0, 4)), "f": jnp.zeros(5, jnp.int8)}
  plan = jsparse.make_plan(tree)
  pools = {str(s.dtype): (len(s.leaf_ids), s.ordered) for s in plan.segments}
  assert pools == {"int8": (2, False), "float32": (1, True), "bool": (1, False),
                   "float16": (1, True)}
  covered = sorted(i for s in plan.segments for i in s.leaf_ids)
  assert covered == [0, 1, 2, 3, 5]  # the zero-size leaf needs no segment


def test_float_leaves_the_trainer_does_not_split_are_ordered_whatever_the_rollout():
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  tree = {"trainer_split": jax.device_put(jnp.zeros(8), split), "whole": jnp.zeros(8),
          "ints": jnp.zeros(8, jnp.int32)}
  plan = jsparse.make_plan(tree, bucket_size=1)
  ordered = {plan.leaves[s.leaf_ids[0]].path: s.ordered for s in plan.segments}
  assert ordered == {"['trainer_split']": False, "['whole']": True, "['ints']": False}
  with pytest.raises(TypeError, match="rollout_shardings"):  # the plan knows no rollout layout
    jsparse.make_plan(tree, rollout_shardings={})


@pytest.mark.parametrize("options, expected", [
    ({"capacity": 0.5}, 50), ({"capacity": 1.0}, 100), ({"capacity": 1e-9}, 1), ({}, 5),
    ({"capacity_slots": 7}, 7), ({"capacity_slots": np.int64(1)}, 1),
    ({"capacity_slots": 10**6}, 100)])
def test_capacity_fraction_or_count(options, expected):
  plan = jsparse.make_plan({"w": jnp.zeros(100)}, bucket_size=10, **options)
  assert plan.segments[0].capacity == expected


@pytest.mark.parametrize("capacity", [0.0, 1.5, -0.1, "0.1", True, float("nan")])
def test_capacity_out_of_range_is_refused(capacity):
  with pytest.raises(jsparse.ConfigError, match="capacity"):
    jsparse.make_plan({"w": jnp.zeros(100)}, capacity=capacity)


@pytest.mark.parametrize("name", ["capacity", "pooled_capacity"])
@pytest.mark.parametrize("count", [1, 5, np.int32(5), 0, -1])
def test_an_int_capacity_is_refused_and_points_to_slots(name, count):
  """``capacity=1`` could mean one slot or every element: an int is never a fraction."""
  with pytest.raises(jsparse.ConfigError) as caught:
    jsparse.make_plan({"w": jnp.zeros(100)}, **{name: count})
  message = str(caught.value)
  assert f"{name}={int(count)}:" in message and f"{name}_slots={int(count)}" in message
  assert "fraction" in message and f"{name}=1.0" in message


@pytest.mark.parametrize("options, words", [
    ({"capacity_slots": 0}, "capacity_slots must be an int >= 1"),
    ({"capacity_slots": 0.5}, "capacity_slots must be an int >= 1"),
    ({"pooled_capacity_slots": True}, "pooled_capacity_slots must be an int >= 1"),
    ({"capacity": 0.1, "capacity_slots": 5}, "not both"),
    ({"pooled_capacity": 0.1, "pooled_capacity_slots": 5}, "not both")])
def test_bad_slot_counts_are_refused(options, words):
  with pytest.raises(jsparse.ConfigError, match=words):
    jsparse.make_plan({"w": jnp.zeros(100)}, **options)


def test_pooled_capacity_slots_apply_to_pools_only():
  tree = {"w": jnp.zeros(1000), "b": jnp.zeros(10), "c": jnp.zeros(10)}
  plan = jsparse.make_plan(tree, bucket_size=100, capacity_slots=30, pooled_capacity_slots=4)
  assert sorted((s.size, s.capacity) for s in plan.segments) == [(20, 4), (1000, 30)]


def test_a_small_leaf_split_over_a_mesh_takes_the_small_leaves_capacity_per_block():
  """Not pooled (its blocks live apart), but a small leaf all the same (e.g. a weight's scales,
  which every step moves): pooled_capacity per block; a large split leaf keeps capacity."""
  from jsparse._src.core.delta import capacity_that_fits
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  tree = {"small": jax.device_put(jnp.zeros(80), split),
          "large": jax.device_put(jnp.zeros(400), split)}
  plan = jsparse.make_plan(tree, bucket_size=100, capacity=0.1, pooled_capacity_slots=30)
  segments = {plan.leaves[s.leaf_ids[0]].path: s for s in plan.segments}
  assert {p: (s.blocks, s.capacity) for p, s in segments.items()} == {
      "['small']": (2, 60), "['large']": (2, 40)}
  small, large = (plan.segments.index(segments[p]) for p in ("['small']", "['large']"))
  assert capacity_that_fits(plan, small, 70).startswith("pooled_capacity=")
  assert capacity_that_fits(plan, large, 70).startswith("capacity=")


def test_rollout_dtype_applies_to_floats_only_or_per_leaf():
  tree = {"w": jnp.zeros(4), "step": jnp.zeros((), jnp.int32), "norm": jnp.zeros(4)}
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16)
  by_path = {l.path: str(l.rollout_dtype) for l in plan.leaves}
  assert by_path == {"['norm']": "bfloat16", "['step']": "int32", "['w']": "bfloat16"}
  keep_norms = jsparse.make_plan(
      tree, rollout_dtype=lambda path, x: None if "norm" in path else jnp.float16)
  by_path = {l.path: str(l.rollout_dtype) for l in keep_norms.leaves}
  assert by_path == {"['norm']": "float32", "['step']": "float16", "['w']": "float16"}


def test_plan_from_shape_structs_equals_plan_from_arrays_and_is_hashable():
  tree = {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}
  structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  a, b = jsparse.make_plan(tree, bucket_size=16), jsparse.make_plan(structs, bucket_size=16)
  assert a == b and hash(a) == hash(b) and a.fingerprint == b.fingerprint
  assert jsparse.make_plan(tree, capacity=0.1, bucket_size=16).fingerprint != a.fingerprint


def test_plan_from_nnx_state():
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  plan = jsparse.make_plan(nnx.state(model, nnx.Param), rollout_dtype=jnp.bfloat16)
  assert sorted(l.shape for l in plan.leaves) == [(3,), (4, 3)]


def test_huge_leaf_is_refused_clearly():
  with pytest.raises(jsparse.PlanError, match=r"\['emb'\].*2147483647"):
    jsparse.make_plan({"emb": jax.ShapeDtypeStruct((2**16, 2**15), jnp.bfloat16)})


def test_typed_prng_key_is_refused_with_advice():
  with pytest.raises(jsparse.PlanError, match="key_data"):
    jsparse.make_plan({"rng": jax.random.key(0)})


def test_unsupported_dtype_is_refused():
  with pytest.raises(jsparse.PlanError, match=r"\['c'\].*complex64"):
    jsparse.make_plan({"c": jnp.zeros(3, jnp.complex64)})


def test_bucket_size_must_be_positive():
  with pytest.raises(jsparse.ConfigError, match="bucket_size"):
    jsparse.make_plan({"w": jnp.zeros(3)}, bucket_size=0)


@pytest.mark.parametrize("dtype", ["int4", "uint4", "float4_e2m1fn", "int2"])
def test_sub_byte_dtypes_are_refused_at_make_plan(dtype):
  import ml_dtypes
  with pytest.raises(jsparse.PlanError, match=rf"\['x'\] has unsupported dtype {dtype}"):
    jsparse.make_plan({"x": jnp.zeros(4, getattr(ml_dtypes, dtype))})


def test_numpy_scalars_are_valid_options_and_bucket_size_is_capped():
  plan = jsparse.make_plan({"x": jnp.zeros(70000)}, capacity=np.float16(0.5),
                           bucket_size=np.int64(64))
  assert plan.segments[0].capacity == 35000
  with pytest.raises(jsparse.ConfigError, match="at most 2147483647"):
    jsparse.make_plan({"x": jnp.zeros(4)}, bucket_size=2**31)


def test_a_tree_of_other_containers_names_the_first_difference_in_a_few_lines():
  """A plan made from an ``nnx.State`` given a dict (or a model without a leaf) says where and
  what, not two tree definitions of a kilobyte each."""

  class MLP(nnx.Module):
    def __init__(self, rngs, bias=True):
      self.layers = nnx.List([nnx.Linear(64, 64, rngs=rngs) for _ in range(4)])
      self.norm = nnx.LayerNorm(64, use_bias=bias, rngs=rngs)

  state = nnx.state(MLP(nnx.Rngs(0)), nnx.Param)
  plan = jsparse.make_plan(state)
  with pytest.raises(jsparse.PlanMismatchError) as caught:
    jsparse.diff(plan, state, nnx.to_pure_dict(state))
  message = str(caught.value)
  assert message.startswith("new: tree structure differs from the plan at the root: the plan "
                            "has a flax.nnx.statelib.State there, the tree has a dict")
  assert "same structure and container types" in message and len(message) < 400
  other = nnx.state(MLP(nnx.Rngs(0), bias=False), nnx.Param)
  with pytest.raises(jsparse.PlanMismatchError, match=r"at \['norm'\]\['bias'\]: the plan has a "
                     r"flax.nnx.variablelib.Param there, the tree has none \(plan has 10 leaves, "
                     r"got 9\)"):
    jsparse.Receiver(plan, other)
  one = jax.sharding.make_single_device_sharding(jax.devices()[0])
  plan = jsparse.make_plan({"a": jnp.zeros(2), "b": {"c": jnp.zeros(2)}})
  with pytest.raises(jsparse.PlanMismatchError, match=r"shardings: .* at \['b'\]\['c'\]: the plan "
                     r"has a leaf there, the tree has none"):
    plan.rollout_shapes({"a": one, "b": {}})
