"""diff / apply: bit-exactness, static shapes, overflow flags, errors, one compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from jsparse._src.core import bits as bits_lib
from jsparse._src.core import delta as delta_lib
from jsparse.testing import assert_trees_bitwise_equal, special_values
from tests import strategies
from tests.helpers import compilations


def _bits(x):
  return bits_lib.np_to_bits(np.asarray(x))


def _roundtrip(plan, base, new):
  delta = jsparse.diff(plan, base, new)
  return delta, jsparse.apply(plan, plan.cast(base), delta)


@pytest.mark.parametrize("dtype", strategies.FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_special_values_are_changes_and_roundtrip(dtype):
  specials = special_values(dtype)
  base = {"x": jnp.asarray(np.concatenate([specials, specials]))}
  # Each special value replaced by the next one: every flip (+0 <-> -0, NaN payloads) counts.
  new = {"x": jnp.asarray(np.concatenate([np.roll(specials, 1), specials]))}
  plan = jsparse.make_plan(base)
  delta, out = _roundtrip(plan, base, new)
  expected = int(np.sum(_bits(base["x"]) != _bits(new["x"])))
  assert expected == len(specials)
  assert int(delta.counts.sum()) == expected
  assert_trees_bitwise_equal(out, new)


def test_negative_zero_is_a_change_that_float_compare_misses():
  base, new = {"x": jnp.zeros(4)}, {"x": jnp.array([0.0, -0.0, 0.0, 0.0])}
  assert bool(jnp.all(base["x"] == new["x"]))  # float == says equal ...
  plan = jsparse.make_plan(base)
  delta, out = _roundtrip(plan, base, new)
  assert delta.counts.tolist() == [1]  # ... jsparse sees the sign bit
  assert _bits(out["x"]).tolist() == [0, 2**31, 0, 0]


@pytest.mark.parametrize("dtype", strategies.ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_each_dtype_roundtrips_at_any_density(dtype, density):
  rng = np.random.default_rng(0)
  base = {"big": strategies.random_bits(rng, (300, 257), dtype),
          "small": strategies.random_bits(rng, (5,), dtype),
          "scalar": strategies.random_bits(rng, (), dtype)}
  new = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
  plan = jsparse.make_plan(base, capacity=1.0, bucket_size=1024)
  delta, out = _roundtrip(plan, base, new)
  assert not bool(delta.overflow.any())
  assert_trees_bitwise_equal(out, new)


def test_fp32_masters_are_cast_to_bf16_inside_diff():
  rng = np.random.default_rng(1)
  base = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)}
  new = {"w": base["w"] + jnp.asarray(rng.normal(size=(64, 64)) * 1e-3, jnp.float32)}
  plan = jsparse.make_plan(base, rollout_dtype=jnp.bfloat16, capacity=1.0)
  delta, out = _roundtrip(plan, base, new)
  assert out["w"].dtype == jnp.bfloat16 and delta.values[0].dtype == jnp.uint16
  assert_trees_bitwise_equal(out, plan.cast(new))
  changed = int(np.sum(_bits(plan.cast(base)["w"]) != _bits(plan.cast(new)["w"])))
  assert int(delta.counts[0]) == changed < 64 * 64  # updates below half an ulp vanish


def test_float64_with_x64():
  with jax.enable_x64(True):
    rng = np.random.default_rng(2)
    base = {"w": strategies.random_bits(rng, (100,), np.float64)}
    new = {"w": strategies.perturb(rng, base["w"], 0.3)}
    plan = jsparse.make_plan(base)
    delta, out = _roundtrip(plan, base, new)
    assert delta.values[0].dtype == jnp.uint64
    assert_trees_bitwise_equal(out, new)


def test_zero_size_leaves_and_empty_tree():
  base = {"empty": jnp.zeros((0, 3)), "w": jnp.zeros(3)}
  new = {"empty": jnp.zeros((0, 3)), "w": jnp.ones(3)}
  plan = jsparse.make_plan(base)
  _, out = _roundtrip(plan, base, new)
  assert_trees_bitwise_equal(out, new)
  empty_plan = jsparse.make_plan({})
  assert jsparse.apply(empty_plan, {}, jsparse.diff(empty_plan, {}, {})) == {}


def test_delta_shapes_depend_only_on_the_plan():
  rng = np.random.default_rng(3)
  base = {"a": strategies.random_bits(rng, (1000,), np.float32),
          "b": strategies.random_bits(rng, (10,), np.float16)}
  plan = jsparse.make_plan(base, capacity=0.1, bucket_size=100)
  def shapes(density):
    new = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
    return jax.tree.map(lambda x: (x.shape, x.dtype), jsparse.diff(plan, base, new))

  assert shapes(0.0) == shapes(0.05) == shapes(1.0)


def test_overflow_is_flagged_with_the_true_count_and_first_positions():
  base = {"w": jnp.zeros(1000)}
  new = {"w": jnp.ones(1000).at[::2].set(0.0)}  # 500 changes
  plan = jsparse.make_plan(base, capacity=0.1, bucket_size=100)  # 100 slots
  delta = jsparse.diff(plan, base, new)
  assert delta.overflow.tolist() == [True] and delta.counts.tolist() == [500]
  assert delta.indices[0].tolist() == list(range(1, 200, 2))
  under = jsparse.diff(plan, base, {"w": jnp.zeros(1000).at[:100].set(1.0)})
  assert under.overflow.tolist() == [False] and under.counts.tolist() == [100]


@settings(max_examples=25)
@given(strategies.trees_and_updates(),
       st.sampled_from([{"capacity": c} for c in (1.0, 0.5, 0.05)] + [{"capacity_slots": 3}]),
       st.sampled_from([1, 64, 4096]))
def test_random_trees_roundtrip_exactly_unless_flagged(pair, capacity, bucket_size):
  base, new = pair
  plan = jsparse.make_plan(base, bucket_size=bucket_size, **capacity)
  delta = jsparse.diff(plan, base, new)
  out, exact = jsparse.apply(plan, plan.cast(base), delta, return_exact=True)
  expected_counts = []
  for seg in plan.segments:
    old = np.concatenate([_bits(base[plan.leaves[i].path[2:-2]]).reshape(-1)
                          for i in seg.leaf_ids])
    now = np.concatenate([_bits(new[plan.leaves[i].path[2:-2]]).reshape(-1)
                          for i in seg.leaf_ids])
    expected_counts.append(int(np.sum(old != now)))
  assert delta.counts.tolist() == expected_counts
  caps = [s.capacity for s in plan.segments]
  assert delta.overflow.tolist() == [c > k for c, k in zip(expected_counts, caps)]
  assert bool(exact) == (not any(delta.overflow.tolist()))
  if bool(exact):
    assert_trees_bitwise_equal(out, new)
  else:  # never silently inexact
    with pytest.raises(jsparse.errors.OverflowedDeltaError):
      jsparse.apply(plan, plan.cast(base), delta)


def test_structure_shape_and_dtype_errors_name_the_leaf():
  plan = jsparse.make_plan({"layer": {"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}},
                           rollout_dtype=jnp.bfloat16)
  good = {"layer": {"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}}
  with pytest.raises(jsparse.PlanMismatchError, match=r"differs from the plan at \['layer'\]\['b'\]"
                     r": the plan has a leaf there, the tree has none"):
    jsparse.diff(plan, good, {"layer": {"w": jnp.zeros((4, 4))}})
  with pytest.raises(jsparse.PlanMismatchError, match=r"\['layer'\]\['w'\] has shape \(4, 5\).*"
                     "the plan was made from another tree; make it from this model's params"):
    jsparse.diff(plan, good, {"layer": {"w": jnp.zeros((4, 5)), "b": jnp.zeros(4)}})
  with pytest.raises(jsparse.PlanMismatchError, match=r"\['layer'\]\['b'\] has dtype int32"):
    jsparse.diff(plan, good, {"layer": {"w": jnp.zeros((4, 4)), "b": jnp.zeros(4, jnp.int32)}})
  delta = jsparse.diff(plan, good, good)
  with pytest.raises(jsparse.PlanMismatchError, match=r"expects bfloat16: a rollout tree holds "
                     r"the rollout dtypes: plan.cast\(params\) makes one"):
    jsparse.apply(plan, good, delta)  # apply needs rollout dtypes
  bad = delta._replace(values=(delta.values[0].astype(jnp.uint32),))
  with pytest.raises(jsparse.PlanMismatchError, match="segment 0.*values.*diff and apply with "
                     "the same plan"):
    jsparse.apply(plan, plan.cast(good), bad)


def test_one_compilation_per_plan():
  rng = np.random.default_rng(4)
  base = {"w": jnp.asarray(rng.normal(size=(128, 128)), jnp.float32), "b": jnp.zeros(128)}
  plan = jsparse.make_plan(base, rollout_dtype=jnp.bfloat16, capacity=0.2)
  rollout = plan.cast(base)
  diffs = compilations(delta_lib.diff_program)
  applies = compilations(delta_lib.apply_program(False))
  for step in range(4):
    new = jax.tree.map(lambda x: x + 1e-2 * step, base)
    rollout = jsparse.apply(plan, rollout, jsparse.diff(plan, base, new))
  assert compilations(delta_lib.diff_program) == diffs + 1
  assert compilations(delta_lib.apply_program(False)) == applies + 1


def test_apply_with_donation_updates_in_place():
  base = {"w": jnp.zeros(10000, jnp.bfloat16)}
  new = {"w": base["w"].at[5].set(3.0)}
  plan = jsparse.make_plan(base)
  delta = jsparse.diff(plan, base, new)
  rollout = {"w": jnp.zeros(10000, jnp.bfloat16)}
  out = jsparse.apply(plan, rollout, delta, donate=True)
  assert rollout["w"].is_deleted()
  assert_trees_bitwise_equal(out, new)


# --- diff and apply traced by the caller ---------------------------------------------------------

def test_diff_and_apply_inside_the_callers_jit():
  base = {"w": jnp.zeros(300), "b": jnp.zeros(7, jnp.bfloat16)}
  new = {"w": base["w"].at[5].set(-0.0), "b": base["b"].at[2].set(1.0)}
  plan = jsparse.make_plan(base)

  @jax.jit
  def sync(rollout, new):
    return jsparse.apply(plan, rollout, jsparse.diff(plan, rollout, new), return_exact=True)

  out, exact = sync(base, new)
  assert bool(exact)
  assert_trees_bitwise_equal(out, new)
  delta = jsparse.diff(plan, base, new)
  out, exact = jax.jit(lambda r, d: jsparse.apply(plan, r, d, return_exact=True))(base, delta)
  assert bool(exact)
  assert_trees_bitwise_equal(out, new)
  assert_trees_bitwise_equal(jax.jit(lambda r: jsparse.apply(plan, r, delta))(base), new)
  with pytest.raises(jsparse.ConfigError, match="return_exact=True"):  # flags unknown in a trace
    jax.jit(lambda r, d: jsparse.apply(plan, r, d))(base, delta)


def test_diff_and_apply_on_local_blocks_inside_the_callers_shard_map():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("fsdp",))
  spec = NamedSharding(mesh, P("fsdp"))
  base = jax.device_put(jnp.zeros((64, 4)), spec)
  new = jax.device_put(jnp.zeros((64, 4)).at[::9].set(1.0), spec)

  def local(old, new):  # a plan of the local block, made inside
    plan = jsparse.make_plan({"w": jax.ShapeDtypeStruct(old.shape, old.dtype)})
    out, exact = jsparse.apply(plan, {"w": old}, jsparse.diff(plan, {"w": old}, {"w": new}),
                               return_exact=True)
    return jnp.where(exact, out["w"], jnp.nan)

  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"),) * 2,
                              out_specs=P("fsdp")))(base, new)
  assert np.array_equal(np.asarray(out), np.asarray(new))


def test_diff_apply_and_sync_under_any_context_mesh():
  from jax.sharding import NamedSharding, PartitionSpec as P
  trainer = jax.make_mesh((8,), ("fsdp",))
  other = jax.make_mesh((2, 4), ("a", "b"))
  w = jax.device_put(jnp.zeros((64, 8)), NamedSharding(trainer, P("fsdp")))
  params, new = {"w": w, "b": jnp.zeros(8)}, {"w": w + 1, "b": jnp.ones(8)}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=1.0)
  for context in (trainer, other):
    with jax.set_mesh(context):
      out = jsparse.apply(plan, plan.cast(params), jsparse.diff(plan, params, new))
      assert_trees_bitwise_equal(out, plan.cast(new))
      sender, receiver = jsparse.Sender(plan, params), jsparse.Receiver(plan, plan.cast(params))
      assert_trees_bitwise_equal(receiver.receive(sender.send(new)), plan.cast(new))


# --- overflow is never silent ---------------------------------------------------------------------

def test_apply_of_an_overflowed_delta_raises_naming_the_segment_and_the_capacity_that_fits():
  base = {"w": jnp.zeros(1000), "b": jnp.zeros(10)}
  new = {"w": jnp.ones(1000).at[::2].set(0.0), "b": jnp.ones(10)}  # 500 changes in w
  plan = jsparse.make_plan(base, capacity_slots=100, bucket_size=100)
  rollout = plan.cast(base)
  delta = jsparse.diff(plan, base, new)
  with pytest.raises(jsparse.errors.OverflowedDeltaError) as caught:
    jsparse.apply(plan, rollout, delta, donate=True)
  message = str(caught.value)
  w = next(s for s, seg in enumerate(plan.segments) if seg.size == 1000)
  assert f"segment {w} (leaves [\"['w']\"])" in message and "500 changes for 100 slots" in message
  assert "capacity=0.5 or capacity_slots=500" in message and "Sender and Receiver" in message
  assert "return_exact=True" in message
  assert not rollout["w"].is_deleted()  # refused before anything was donated
  fits = jsparse.make_plan(base, capacity=0.5, bucket_size=100)  # what the message proposes
  assert_trees_bitwise_equal(jsparse.apply(fits, rollout, jsparse.diff(fits, base, new)),
                             fits.cast(new))
  out, exact = jsparse.apply(plan, rollout, delta, return_exact=True)
  assert not bool(exact) and out["w"].shape == (1000,)


def test_overflow_of_a_leaf_split_into_blocks_names_its_blocks():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("fsdp",))
  base = {"w": jax.device_put(jnp.zeros((64, 8)), NamedSharding(mesh, P("fsdp")))}
  plan = jsparse.make_plan(base, capacity_slots=2, bucket_size=512)  # a large leaf: capacity
  with pytest.raises(jsparse.errors.OverflowedDeltaError, match="512 changes for 8 blocks of 2 "
                     "slots.*capacity=1.0 or capacity_slots=512"):
    jsparse.apply(plan, plan.cast(base), jsparse.diff(plan, base, {"w": base["w"] + 1}))


def test_plan_and_delta_reprs_are_short_and_say_what_matters():
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(256, 256, rngs=rngs) for _ in range(4)])
      self.norm = nnx.LayerNorm(256, rngs=rngs)

  params = nnx.state(MLP(nnx.Rngs(0)), nnx.Param)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity_slots=100)
  text = repr(plan)
  assert len(text) < 200, text
  assert text.startswith("Plan(10 leaves, 264K elements, 5 segments, capacity ") and "bf16" in text
  assert plan.fingerprint.hex()[:8] in text
  new = jax.tree.map(lambda x: x + 1, params)
  delta = jsparse.diff(plan, params, new)
  text = repr(delta)
  assert len(text) < 200, text
  assert text.startswith("Delta(changed 264K in 5 segments of ")
  assert "overflowed: segments 0, 1, 2, 3" in text
  quiet = jsparse.diff(plan, params, params)
  assert repr(quiet).endswith("overflowed: none)") and "changed 0 in" in repr(quiet)
  seen = []
  jax.jit(lambda a, b: seen.append(repr(jsparse.diff(plan, a, b))))(params, new)
  assert seen[0].endswith("not concrete)") and len(seen[0]) < 200


# --- clear errors --------------------------------------------------------------------------------

def test_trainer_arrays_laid_out_otherwise_than_the_plan_are_resharded_with_a_warning(caplog):
  """A jitted train step may return a leaf laid out otherwise than the plan recorded (XLA split
  a bias, or gathered a matrix), and host arrays have no layout: jsparse reshards them, exactly,
  and the sender says so once per leaf."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("fsdp",))
  w = np.arange(512, dtype=np.float32).reshape(64, 8)
  split = NamedSharding(mesh, P("fsdp"))
  plan = jsparse.make_plan({"w": jax.device_put(w, split)})
  sender = jsparse.Sender(plan, {"w": w})  # host arrays at the start are placed on the plan
  assert sender.snapshot["w"].sharding.is_equivalent_to(split, 2)
  receiver = jsparse.Receiver(plan, {"w": w})
  for step, place in enumerate([np.asarray, lambda x: jax.device_put(x, NamedSharding(mesh, P())),
                                lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "fsdp")))]):
    new = {"w": place(w + step + 1)}
    with caplog.at_level("WARNING", logger="jsparse"):
      assert_trees_bitwise_equal(receiver.receive(sender.send(new)), {"w": w + step + 1})
    assert jsparse.diff(plan, {"w": place(w)}, new).counts.tolist() == [512]
  assert sum("laid out otherwise" in r.message for r in caplog.records) == 1  # once per leaf
  whole = jsparse.make_plan({"w": w})  # a leaf split where the plan holds it whole
  assert_trees_bitwise_equal(
      jsparse.Receiver(whole, {"w": w}).receive(
          jsparse.Sender(whole, {"w": w}).send({"w": jax.device_put(w + 1, split)})),
      {"w": w + 1})


def test_numpy_float64_leaves_without_x64_are_float32_leaves():
  plan = jsparse.make_plan({"x": np.zeros(4, np.float64)})
  assert plan.leaves[0].dtype == np.float32
  out = jsparse.apply(plan, {"x": np.zeros(4)}, jsparse.diff(plan, {"x": np.zeros(4)},
                                                             {"x": np.ones(4)}))
  assert out["x"].dtype == jnp.float32 and out["x"].tolist() == [1.0] * 4
