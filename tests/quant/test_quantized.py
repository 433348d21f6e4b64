"""Quantized rollouts (``make_plan(..., quantize=...)``): the receiver's codes and scales equal
qwix's quantizer on the trainer's masters, bit for bit, every step and on every path (codings,
overflow, anchors, meshes, parts, streams, checkpoints, resumed senders); bad specs are refused
naming the leaf. The reference is always qwix's own ``quantize`` on the whole master."""

import dataclasses
import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from qwix._src.core import qarray as qa

import jsparse
from jsparse import quantized
from jsparse._src.core.bits import np_to_bits
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies

SHAPES = {"w": (256, 512), "emb": (128, 256), "stack": (2, 64, 128), "b": (512,)}
F8 = jnp.float8_e4m3fn


def masters(seed=0, specials=False):
  rng = np.random.default_rng(seed)
  tree = {k: (rng.normal(size=s) * 0.05).astype(np.float32) for k, s in SHAPES.items()}
  if specials:
    tree["emb"] = strategies.with_specials(rng, tree["emb"])
  return tree


def rl_step(tree, seed, lr=2e-3):
  """An update of relative size ``lr`` (what an RL step does to fp32 masters)."""
  rng = np.random.default_rng(100 + seed)
  with np.errstate(all="ignore"):  # special values stay special
    return {k: (np.asarray(v) * (1 + lr * rng.normal(size=v.shape))).astype(np.float32)
            for k, v in tree.items()}


def jolt(tree, seed=0):
  """A large update: most codes change (scaling alone would not: codes are scale-invariant)."""
  rng = np.random.default_rng(200 + seed)
  with np.errstate(all="ignore"):
    return {k: (v + 0.05 * rng.normal(size=v.shape)).astype(np.float32) for k, v in tree.items()}


def qwix_quantize(master, how):
  """The reference: qwix's quantizer under ``jax.jit``, as a rollout runs it. (Eager qwix may
  differ by one ulp in the scale: under jit, XLA divides by the type's bound as a multiplication
  by its reciprocal.)"""
  if repr(how) not in _QWIX_QUANTIZERS:  # one jitted quantizer per how (compiled per shape)
    _QWIX_QUANTIZERS[repr(how)] = jax.jit(lambda m: qa.quantize(m, how))
  return _QWIX_QUANTIZERS[repr(how)](jnp.asarray(master))


_QWIX_QUANTIZERS: dict = {}  # HowToQuantize is not hashable: by its repr, which names every field


# The presets' documented meaning for (in, out) kernels and (layers, in, out) stacks, written out
# as qwix HowToQuantize: the test's own reading, not the library's.
def expected_how(preset, shape):
  lead = tuple(range(len(shape) - 2))
  last, contraction = len(shape) - 1, len(shape) - 2
  hows = {
      "fp8 per tensor": dict(qtype=F8, channelwise_axes=lead),
      "fp8 per channel": dict(qtype=F8, channelwise_axes=lead + (last,)),
      "fp8 128x128 tiles": dict(qtype=F8, channelwise_axes=lead,
                                tiled_axes={contraction: 128, last: 128}),
      "mxfp8": dict(qtype="mxfp8", channelwise_axes=lead + (last,), tiled_axes={contraction: 32}),
      "mxfp4": dict(qtype="mxfp4", channelwise_axes=lead + (last,), tiled_axes={contraction: 32}),
      "nvfp4": dict(qtype="nvfp4", channelwise_axes=lead + (last,), tiled_axes={contraction: 16}),
      "int8 per channel": dict(qtype=jnp.int8, channelwise_axes=lead + (last,)),
      "int4 128 tiles": dict(qtype=jnp.int4, channelwise_axes=lead + (last,),
                             tiled_axes={contraction: 128}),
  }[preset]
  tiles = hows.get("tiled_axes", {})
  if len(shape) < 2 or any(shape[a] % t for a, t in tiles.items()):
    return None
  return qa.HowToQuantize(**hows)


def to_bits(x):
  """Bit patterns of ``x``, on the host (no program to compile per shape and dtype)."""
  return np_to_bits(np.asarray(x))


def widened(codes):
  """Codes of any width on the host, 4-bit codes widened exactly (to int8, float32)."""
  codes = np.asarray(codes)
  if codes.dtype == jnp.int4:
    return codes.astype(np.int8)
  if codes.dtype == jnp.float4_e2m1fn:
    return codes.astype(np.float32)
  return codes


def code_bits(codes):
  """Bit patterns of codes of any width (4-bit codes widened exactly first)."""
  return np.asarray(to_bits(widened(codes)))


def assert_same_bits_unless_nan(got, want, name, nan_groups=None):
  """Bit for bit, except where a NaN is involved, which XLA leaves undefined: the sign and
  payload of a NaN result, and whether a max reduction over a NaN returns NaN (it differs
  between compilations: qwix's quantizer compiled whole, or over the trainer's blocks). So a
  NaN may be any NaN, and ``nan_groups`` (where the master's scale group holds a NaN) is not
  compared. The sync itself is checked bit for bit against the trainer's own quantization."""
  got, want = widened(got), widened(want)
  differ = np.asarray(to_bits(got)) != np.asarray(to_bits(want))
  if jnp.issubdtype(want.dtype, jnp.floating):
    differ &= ~(np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
  if nan_groups is not None:
    differ &= ~nan_groups
  assert not differ.any(), f"{name}: {int(differ.sum())} differ, first at {np.argwhere(differ)[0]}"


def nan_groups(master, how):
  """Per scale, and per element, whether the master's scale group holds a NaN (None for a fixed
  range: its scale does not depend on the master)."""
  if how.calibration_method.startswith("fixed"):
    return None, None
  master = jnp.asarray(master)
  flags = qa.calibrate(jnp.isnan(master).astype(jnp.float32),
                       dataclasses.replace(how, calibration_method="absmax"))["absmax"] > 0
  per_element = qa.call_with_generic_broadcast(jnp.logical_or, jnp.zeros(master.shape, bool),
                                               flags)
  return np.asarray(flags), np.asarray(per_element)


def assert_matches_qwix(held, master_tree, how_of, rollout_dtype=jnp.bfloat16):
  """Every leaf of the receiver's tree ``held`` against qwix on ``master_tree``."""
  held = quantized.unpack(held)
  for name, master in master_tree.items():
    how = how_of(name)
    got = held[name]
    if how is None:
      want = jnp.asarray(master).astype(rollout_dtype if master.ndim else master.dtype)
      np.testing.assert_array_equal(np.asarray(to_bits(got)), np.asarray(to_bits(want)), name)
      continue
    want = qwix_quantize(master, how)
    assert isinstance(got, qa.QArray), name
    scale_nan, element_nan = nan_groups(master, how)
    assert_same_bits_unless_nan(got.qvalue, want.qvalue, name, element_nan)
    assert_same_bits_unless_nan(got.scale, want.scale.astype(got.scale.dtype), name, scale_nan)
    if want.zero_point is not None:
      np.testing.assert_array_equal(code_bits(got.zero_point), code_bits(want.zero_point))


def sync_steps(plan, tree, steps, *, coding="ranked", check, anchor_every=None):
  sender = jsparse.Sender(plan, tree, coding=coding, anchor_every=anchor_every)
  receiver = jsparse.Receiver(plan, plan.cast(tree))
  for i, new in enumerate(steps):
    receiver.receive(sender.send(new))
    assert_trees_bitwise_equal(receiver.params, plan.cast(new))  # the trainer's bits, exactly
    assert sender.last_stats.anchor == (anchor_every is not None and (i + 1) % anchor_every == 0)
    check(receiver.params, new)
    assert receiver.version == i + 1
  return sender


@pytest.mark.parametrize("preset", list(quantized.PRESETS))
def test_presets_sync_the_qwix_codes_and_scales_every_step(preset):
  tree = masters(1, specials=True)
  steps = [rl_step(tree, 0)]
  steps += [rl_step(steps[-1], 1), jolt(steps[-1])]  # most codes change: overflow
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, capacity=0.05,
                           quantize=quantized.PRESETS[preset]())
  quantized_paths = {l.path.split("]")[0] + "]" for l in plan.leaves if "." in l.path}
  assert quantized_paths == {f"['{k}']" for k, s in SHAPES.items()
                             if expected_how(preset, s) is not None}
  check = lambda held, new: assert_matches_qwix(  # noqa: E731
      held, new, lambda k: expected_how(preset, SHAPES[k]))
  sender = sync_steps(plan, tree, steps, check=check)
  assert sender.last_stats.overflowed_segments > 0  # the jolt overflows: dense, exact


@pytest.mark.parametrize("coding", ["ranked", "positioned", "packed"])
def test_every_coding_carries_quantized_leaves(coding):
  tree = masters(2)
  steps = [rl_step(tree, 0)]
  steps += [rl_step(steps[-1], 1), rl_step(steps[-1], 2)]
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, quantize=quantized.mxfp4())
  sync_steps(plan, tree, steps, coding=coding, anchor_every=2,  # version 2 is an anchor
             check=lambda held, new: assert_matches_qwix(
                 held, new, lambda k: expected_how("mxfp4", SHAPES[k])))


def test_codes_change_rarely_under_rl_steps_and_scales_travel_small():
  """Why it is sparse: a code flips only when its value crosses a rounding boundary."""
  tree = masters(3)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, quantize=quantized.fp8_tiles())
  sender = jsparse.Sender(plan, tree)
  new = rl_step(tree, 0, lr=1e-4)
  sender.send(new)
  stats = sender.last_stats
  assert 0 < stats.changed < 0.05 * stats.elements
  assert stats.payload_bytes < 0.1 * stats.dense_bytes


@settings(max_examples=12)
@given(qtype=st.sampled_from(["float8_e4m3fn", "float8_e5m2", "int8", "int4", "mxfp8", "nvfp4"]),
       rows=st.sampled_from([32, 64, 96]), cols=st.sampled_from([32, 48, 64]),
       tile_rows=st.sampled_from([None, 16, 32]), per_channel=st.booleans(),
       scale_dtype=st.sampled_from([None, jnp.bfloat16]), seed=st.integers(0, 2**16))
def test_random_specs_are_exact(qtype, rows, cols, tile_rows, per_channel, scale_dtype, seed):
  if qtype in ("mxfp8", "nvfp4"):
    tile_rows = 32 if qtype == "mxfp8" else 16
  if tile_rows and rows % tile_rows:
    tile_rows = None if qtype not in ("mxfp8", "nvfp4") else tile_rows
  if tile_rows and rows % tile_rows:
    return
  how = qa.HowToQuantize(qtype=qtype if qtype in ("mxfp8", "nvfp4") else jnp.dtype(qtype),
                         channelwise_axes=(1,) if per_channel else (),
                         tiled_axes={0: tile_rows} if tile_rows else {})
  rng = np.random.default_rng(seed)
  tree = {"w": strategies.with_specials(rng, rng.normal(size=(rows, cols)).astype(np.float32)),
          "b": rng.normal(size=cols).astype(np.float32)}
  spec = quantized.Quantization.of(how, scale_dtype=scale_dtype)
  plan = jsparse.make_plan(tree, capacity=0.1, quantize=lambda path, s: spec if s.ndim == 2
                           else None)

  def check(held, new):
    want = qwix_quantize(new["w"], how)
    if scale_dtype is not None:
      want = qa.QArray(want.qvalue, want.scale.astype(scale_dtype), None, want.qtype)
    got = quantized.unpack(held)["w"]
    np.testing.assert_array_equal(code_bits(got.qvalue), code_bits(want.qvalue))
    np.testing.assert_array_equal(np.asarray(to_bits(got.scale)), np.asarray(to_bits(want.scale)))

  steps = [rl_step(tree, seed), strategies_perturb(rng, tree, 0.3)]
  sync_steps(plan, tree, steps, check=check)


def strategies_perturb(rng, tree, density):
  return {k: strategies.perturb(rng, v, density) for k, v in tree.items()}


# --- meshes ------------------------------------------------------------------------------------

def _mesh(shape, names):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n])


@pytest.mark.parametrize("preset", ["fp8 per tensor", "fp8 128x128 tiles", "mxfp8",
                                    "int8 per channel", "int4 128 tiles"])
def test_sharded_trainer_quantizes_its_blocks_with_qwix_bits(preset):
  """The trainer splits w over 2x4 devices (per-tensor scales: a pmax across them); the rollout
  holds codes split over 8 devices another way; the bits are qwix's on the whole master."""
  trainer, rollout = _mesh((2, 4), ("data", "model")), _mesh((8,), ("x",))
  specs = {"w": P("data", "model"), "emb": P(None, "data"), "stack": P(None, "data", None)}

  def place(tree):
    return {k: jax.device_put(v, NamedSharding(trainer, specs.get(k, P())))
            for k, v in tree.items()}

  tree = masters(4, specials=True)
  plan = jsparse.make_plan(place(tree), rollout_dtype=jnp.bfloat16,
                           quantize=quantized.PRESETS[preset]())
  shardings = jax.tree.map(
      lambda s: NamedSharding(rollout, P("x") if s.ndim and s.shape[0] % 8 == 0 else P()),
      plan.rollout_shapes())
  sender = jsparse.Sender(plan, place(tree))
  receiver = jsparse.Receiver(plan, jax.device_put(plan.cast(place(tree)), shardings))
  steps = [rl_step(tree, 0), jolt(tree), rl_step(tree, 2)]
  for new in steps:
    held = receiver.receive(sender.send(place(new)))
    assert_trees_bitwise_equal(held, plan.cast(place(new)))
    assert_matches_qwix(held, new, lambda k: expected_how(preset, SHAPES[k]))
    for leaf, s in zip(jax.tree.leaves(held), jax.tree.leaves(shardings)):
      assert leaf.sharding.is_equivalent_to(s, leaf.ndim)


@settings(max_examples=8)
@given(mesh_shape=st.sampled_from([(2,), (4,), (2, 2), (8,)]),
       rows=st.sampled_from([64, 128, 192]), cols=st.sampled_from([32, 64, 128]),
       qtype=st.sampled_from(["float8_e4m3fn", "int8", "int4", "mxfp4"]),
       tile=st.sampled_from([16, 32, 64, None]), seed=st.integers(0, 2**16))
def test_random_meshes_either_sync_exactly_or_refuse_a_split_tile(mesh_shape, rows, cols, qtype,
                                                                  tile, seed):
  """Rows split over the first mesh axis, columns over the second (if any); tiles along rows
  and a scale per column, or (tile None) one scale per tensor, whose absmax is finished across
  the devices. Exact when each device's rows hold whole tiles, else refused."""
  tile = 32 if qtype == "mxfp4" else tile
  names = ("a", "b")[:len(mesh_shape)]
  mesh = _mesh(mesh_shape, names)
  spec = P(*names)
  block_rows = rows // mesh_shape[0]
  how = qa.HowToQuantize(qtype=qtype if qtype == "mxfp4" else jnp.dtype(qtype),
                         channelwise_axes=(1,) if tile else (),
                         tiled_axes={0: tile} if tile else {})
  rng = np.random.default_rng(seed)
  tree = {"w": strategies.with_specials(rng, rng.normal(size=(rows, cols)).astype(np.float32))}
  place = lambda t: {"w": jax.device_put(t["w"], NamedSharding(mesh, spec))}  # noqa: E731
  rule = lambda path, s: how  # noqa: E731
  if tile and block_rows % tile:
    with pytest.raises(jsparse.ConfigError, match=rf"\['w'\]: a tile of {tile} along axis 0"):
      jsparse.make_plan(place(tree), quantize=rule)
    return
  plan = jsparse.make_plan(place(tree), capacity=0.1, quantize=rule)
  sender = jsparse.Sender(plan, place(tree))
  receiver = jsparse.Receiver(plan, plan.cast(place(tree)))
  for new in (rl_step(tree, seed), jolt(tree, seed)):
    held = receiver.receive(sender.send(place(new)))
    assert_trees_bitwise_equal(held, plan.cast(place(new)))
    assert_matches_qwix(held, new, lambda k: how)


@pytest.mark.parametrize("sharded", [False, True])
def test_asymmetric_int8_syncs_zero_points_too(sharded):
  """minmax calibration: scales and zero points per channel (min and max finished across the
  devices that split the reduced axis)."""
  mesh = _mesh((4,), ("x",))
  how = qa.HowToQuantize(qtype=jnp.int8, channelwise_axes=(1,), calibration_method="minmax")
  tree = {"w": masters(10)["w"]}
  def place(t):
    return {"w": jax.device_put(t["w"], NamedSharding(mesh, P("x", None)))} if sharded else t

  plan = jsparse.make_plan(place(tree), quantize=lambda path, s: how)
  sender = jsparse.Sender(plan, place(tree))
  receiver = jsparse.Receiver(plan, plan.cast(place(tree)))
  for new in (rl_step(tree, 0), jolt(tree)):
    held = receiver.receive(sender.send(place(new)))
    assert held["w"].zero_point is not None
    assert_matches_qwix(held, new, lambda k: how)


def test_a_tile_split_across_devices_is_refused_naming_the_leaf_and_tile():
  mesh = _mesh((4,), ("x",))
  tree = {"w": jax.device_put(jnp.zeros((256, 128)), NamedSharding(mesh, P("x", None)))}
  with pytest.raises(jsparse.ConfigError, match=r"\['w'\].*tile of 128 along axis 0.*64"):
    jsparse.make_plan(tree, quantize=quantized.fp8_tiles(128))


def test_trainer_leaves_laid_out_otherwise_are_placed_on_the_plan_first():
  """A train step may return a leaf laid out otherwise than the plan recorded (or on the
  host): it is moved to the plan's blocks before it is quantized, as an unquantized plan does."""
  mesh = _mesh((4,), ("x",))
  how = qa.HowToQuantize(qtype=F8, channelwise_axes=(1,))
  tree = {"w": masters(11)["w"]}
  split = lambda t, spec: {"w": jax.device_put(t["w"], NamedSharding(mesh, spec))}  # noqa: E731
  plan = jsparse.make_plan(split(tree, P("x", None)), quantize=lambda path, s: how)
  sender = jsparse.Sender(plan, split(tree, P("x", None)))
  receiver = jsparse.Receiver(plan, plan.cast(split(tree, P("x", None))))
  for i, place in enumerate((lambda t: split(t, P(None, "x")), lambda t: split(t, P()),
                             lambda t: t)):  # other blocks, replicated, numpy on the host
    new = rl_step(tree, i)
    assert_matches_qwix(receiver.receive(sender.send(place(new))), new, lambda k: how)


def test_fixed_ranges_and_bf16_masters():
  """A fixed range gives one scale per tensor (also when the leaf is split over devices); bf16
  masters are quantized as the presets promise."""
  mesh = _mesh((4,), ("x",))
  tree = {"w": masters(12)["w"]}
  for calibration in ("fixed,-0.2,0.2", "fixed,-0.1,0.3"):
    how = qa.HowToQuantize(qtype=jnp.int8, channelwise_axes=(1,), calibration_method=calibration)
    place = lambda t: {"w": jax.device_put(t["w"], NamedSharding(mesh, P(None, "x")))}  # noqa
    plan = jsparse.make_plan(place(tree), quantize=lambda path, s, how=how: how)
    sender = jsparse.Sender(plan, place(tree))
    receiver = jsparse.Receiver(plan, plan.cast(place(tree)))
    new = rl_step(tree, 0)
    held = receiver.receive(sender.send(place(new)))
    assert held["w"].scale.shape == (1, 1)
    assert_matches_qwix(held, new, lambda k, how=how: how)
  bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in masters(13).items()}
  plan = jsparse.make_plan(bf16, quantize=quantized.fp8_tiles())
  assert {l.rollout_dtype.name for l in plan.leaves} >= {"float8_e4m3fn", "bfloat16"}
  sender, receiver = jsparse.Sender(plan, bf16), jsparse.Receiver(plan, plan.cast(bf16))
  new = {k: v * jnp.bfloat16(1.01) for k, v in bf16.items()}
  assert_matches_qwix(receiver.receive(sender.send(new)), new,
                      lambda k: expected_how("fp8 128x128 tiles", SHAPES[k]))


def test_unpacked_4bit_nodes_are_qwix_qarrays_of_the_same_structure():
  tree = {"w": masters(14)["w"]}
  plan = jsparse.make_plan(tree, quantize=quantized.int4_tiles(64))
  held = quantized.unpack(plan.cast(tree))["w"]
  want = qwix_quantize(tree["w"], qa.HowToQuantize(qtype=jnp.int4, channelwise_axes=(1,),
                                                   tiled_axes={0: 64}))
  assert jax.tree.structure(held) == jax.tree.structure(want)


# --- parts, streams, checkpoints, resumed senders ----------------------------------------------

@pytest.mark.parametrize("coding", ["ranked", "packed"])
def test_parts_and_streams_carry_quantized_leaves(coding):
  mesh = _mesh((4,), ("x",))

  def place(tree):
    return {k: jax.device_put(v, NamedSharding(mesh, P(*[None] * (v.ndim - 1), "x")
                                               if v.ndim >= 2 else P()))
            for k, v in tree.items()}

  tree = masters(5)
  plan = jsparse.make_plan(place(tree), rollout_dtype=jnp.bfloat16, bucket_size=4096,
                           quantize=quantized.int4_tiles(64))
  def how(k):  # int4 tiles of 64 inputs, a scale per output channel (and layer)
    n = len(SHAPES[k])
    return qa.HowToQuantize(qtype=jnp.int4, channelwise_axes=tuple(range(n - 2)) + (n - 1,),
                            tiled_axes={n - 2: 64}) if n >= 2 else None

  sender = jsparse.Sender(plan, place(tree), coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(place(tree)))
  new = rl_step(tree, 0)
  assert_matches_qwix(receiver.receive([sender.send(place(new))]), new, how)
  for new in (rl_step(new, 1), {k: -v for k, v in new.items()}):
    stream = receiver.open_stream()
    for part in sender.send_stream(place(new), chunk_bytes=2000):
      stream.add(part)
    assert_matches_qwix(stream.commit(), new, how)


@pytest.mark.parametrize("coding", ["positioned", "packed"])
def test_checkpoint_chains_and_resumed_senders(tmp_path, coding):
  tree = masters(6)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, quantize=quantized.fp8_per_channel())
  how = lambda k: expected_how("fp8 per channel", SHAPES[k])  # noqa: E731
  states = [tree]
  for i in range(4):
    states.append(rl_step(states[-1], i))
  with jsparse.DeltaCheckpointManager(tmp_path, plan, rebase_every=3, coding=coding) as chain:
    for step, state in enumerate(states):
      chain.save(step, state)
  with jsparse.DeltaCheckpointManager(tmp_path, plan, coding=coding) as chain:
    for step, state in enumerate(states):
      assert_matches_qwix(chain.restore(step), state, how)

  sender = jsparse.Sender(plan, tree)
  receiver = jsparse.Receiver(plan, plan.cast(tree))
  receiver.receive(sender.send(states[1]))
  resumed = jsparse.Sender.restore(plan, sender.state())
  assert_matches_qwix(receiver.receive(resumed.send(states[2])), states[2], how)


def test_a_feed_carries_quantized_versions_to_a_lagging_rollout(tmp_path):
  from jsparse.engine import DirectoryFeed, Publisher, Subscriber
  tree = masters(9)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, quantize=quantized.mxfp8())
  feed = DirectoryFeed(tmp_path / "feed")
  publisher = Publisher(jsparse.Sender(plan, tree), feed, anchor_every=3, keep=2,
                        retain_versions=0)  # a fixed retention: the lagging rollout's anchor
  subscriber = Subscriber(jsparse.Receiver(plan, plan.cast(tree)), feed)
  states = [tree]
  for step in range(5):
    states.append(rl_step(states[-1], step))
    publisher.publish(states[-1])
    if step in (0, 4):  # lags 4 versions in between: catches up through an anchor
      subscriber.poll()
      assert_matches_qwix(subscriber.params, states[-1],
                          lambda k: expected_how("mxfp8", SHAPES[k]))
  assert subscriber.version == 5 and subscriber.stats.anchors >= 1


# --- bad input -----------------------------------------------------------------------------------

def test_bad_specs_are_refused_naming_the_leaf():
  tree = {"w": jnp.zeros((96, 64)), "v": jnp.zeros((64, 33))}
  with pytest.raises(jsparse.ConfigError, match=r"\['w'\].*tile size 128 does not divide"):
    jsparse.make_plan(tree, quantize=lambda path, s: qa.HowToQuantize(
        qtype=F8, tiled_axes={0: 128}) if path == "['w']" else None)
  with pytest.raises(jsparse.ConfigError, match=r"\['v'\].*unsupported qtype 'nf4'"):
    jsparse.make_plan(tree, quantize=qa.HowToQuantize(qtype="nf4"))
  with pytest.raises(jsparse.ConfigError, match=r"\['v'\].*last axis, which must be even"):
    jsparse.make_plan(tree, quantize=quantized.Quantization("int4"))
  with pytest.raises(jsparse.ConfigError, match=r"\['v'\].*axis 2 out of range"):
    jsparse.make_plan(tree, quantize=quantized.Quantization("int8", channelwise_axes=(2,)))
  with pytest.raises(jsparse.ConfigError, match=r"\['v'\].*noise_fn"):
    jsparse.make_plan(tree, quantize=qa.HowToQuantize(qtype=F8, noise_fn=lambda shape: 0.0))
  for calibration in ("fixed,1,3", "rms", "absmax,abc"):  # qwix refuses them: named
    with pytest.raises(jsparse.ConfigError, match=r"\['v'\]"):
      jsparse.make_plan(tree, quantize=quantized.Quantization("int8",
                                                              calibration_method=calibration))
  with pytest.raises(jsparse.ConfigError, match=r"\['v'\].*4-bit zero point"):
    jsparse.make_plan(tree, quantize=quantized.Quantization("int4",
                                                            calibration_method="fixed,-1,3"))
  mesh = _mesh((4,), ("x",))
  split = {"w": jax.device_put(jnp.zeros((96, 64)), NamedSharding(mesh, P("x", None)))}
  with pytest.raises(jsparse.ConfigError, match=r"\['w'\].*'rms,2'.*not exact"):
    jsparse.make_plan(split, quantize=quantized.Quantization("int8", calibration_method="rms,2"))


def test_user_quantizers_work_and_bad_ones_are_refused():
  tree = {"w": masters(7)["w"]}

  def absmax_int8(x):  # a user quantizer: array -> (codes, scales)
    scale = jnp.max(jnp.abs(x), axis=0, keepdims=True) / 127
    return jnp.round(x / scale).astype(jnp.int8), scale

  plan = jsparse.make_plan(tree, quantize=absmax_int8)
  sender = jsparse.Sender(plan, tree)
  receiver = jsparse.Receiver(plan, plan.cast(tree))
  new = rl_step(tree, 0)
  codes, scale = receiver.receive(sender.send(new))["w"]
  want_codes, want_scale = jax.jit(absmax_int8)(new["w"])
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(want_codes))
  np.testing.assert_array_equal(np.asarray(to_bits(scale)), np.asarray(to_bits(want_scale)))

  def not_jittable(x):
    return jnp.asarray(np.asarray(x) > 0, jnp.int8)

  counter = iter(range(10**6))

  def not_deterministic(x):  # a constant baked in at trace time, other on each trace
    return (x + next(counter)).astype(jnp.int8)

  def four_bit(x):
    return x.astype(jnp.int4)

  def absmax_int8_halved(x):  # another quantizer of the same name: another plan
    scale = jnp.max(jnp.abs(x), axis=0, keepdims=True) / 63
    return jnp.round(x / scale).astype(jnp.int8), scale

  absmax_int8_halved.__qualname__ = absmax_int8.__qualname__
  assert jsparse.make_plan(tree, quantize=absmax_int8_halved).fingerprint != plan.fingerprint

  for fn, message in ((not_jittable, "does not trace under jax.jit"),
                      (not_deterministic, "other bits on a second run"),
                      (four_bit, "returns int4")):
    with pytest.raises(jsparse.ConfigError, match=rf"\['w'\].*{message}"):
      jsparse.make_plan(tree, quantize=fn)


def test_quantized_plans_fingerprint_their_quantization():
  tree = masters(8)
  a = jsparse.make_plan(tree, quantize=quantized.fp8_tiles())
  b = jsparse.make_plan(tree, quantize=quantized.fp8_tiles(qtype="float8_e5m2"))
  c = jsparse.make_plan(tree, quantize=quantized.fp8_tiles())
  assert a.fingerprint != b.fingerprint and a.fingerprint == c.fingerprint
  assert a != jsparse.make_plan(tree)
  same = [quantized.Quantization("int8", (), ((1, 64), (0, 64)), "ABSMAX"),
          quantized.Quantization("int8", (), ((0, 64), (1, 64)), "absmax", jnp.float32)]
  one, other = (jsparse.make_plan(tree, quantize=lambda p, s, q=q: q if p == "['w']" else None)
                for q in same)
  assert one.fingerprint == other.fingerprint  # one spelling of one quantization
  assert jsparse.make_plan(tree, quantize=lambda p, s: None).view is None  # nothing quantized
  again = pickle.loads(pickle.dumps(a))  # e.g. sent to another process
  assert again == a and again.fingerprint == a.fingerprint


# A user quantizer made by a factory: equal code, its bound a captured constant.
ABSMAX_SOURCE = """
import jax.numpy as jnp

def absmax(bound):
  def quantize(x):
    scale = jnp.max(jnp.abs(x), axis=0, keepdims=True) / bound
    return jnp.round(x / scale).astype(jnp.int8), scale
  return quantize
"""


def _absmax(bound):
  namespace = {}
  exec(ABSMAX_SOURCE, namespace)  # noqa: S102 -- the test's own source, also run in a child
  return namespace["absmax"](bound)


def test_user_quantizers_differing_by_a_captured_constant_are_other_plans():
  tree = {"w": masters(9)["w"]}
  plan, other = (jsparse.make_plan(tree, quantize=_absmax(b)) for b in (127, 7))
  assert plan.fingerprint != other.fingerprint
  anchor = jsparse.Sender(plan, tree).send(rl_step(tree, 0), anchor=True)
  receiver = jsparse.Receiver(other, other.cast(tree))
  before = jax.tree.map(np.asarray, receiver.params)
  with pytest.raises(jsparse.PayloadError, match="another plan"):
    receiver.receive(anchor)
  assert receiver.version == 0
  assert_trees_bitwise_equal(receiver.params, before)


def test_a_user_quantizer_defined_again_gives_the_same_plan_in_any_process():
  tree = {"w": masters(9)["w"]}
  plan = jsparse.make_plan(tree, quantize=_absmax(127))
  assert jsparse.make_plan(tree, quantize=_absmax(127)).fingerprint == plan.fingerprint

  def renamed(x):  # the same computation under another name
    scale = jnp.max(jnp.abs(x), axis=0, keepdims=True) / 127
    return jnp.round(x / scale).astype(jnp.int8), scale

  assert jsparse.make_plan(tree, quantize=renamed).fingerprint == plan.fingerprint
  child = ABSMAX_SOURCE + (  # a restarted job: another process, other object addresses
      "import jax, jsparse\n"
      f"shape = jax.ShapeDtypeStruct({tree['w'].shape}, 'float32')\n"
      "print(jsparse.make_plan({'w': shape}, quantize=absmax(127)).fingerprint.hex())\n")
  out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=300, check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.stdout.split()[-1] == plan.fingerprint.hex()


def test_a_rollout_tree_of_another_structure_maps_leaf_for_leaf_with_4bit_codes_unpacked():
  """How a qwix PTQ model holds a weight (``['w']['array']['qvalue']``, 4-bit codes one per
  element) against the plan's tree (``['w']`` a PackedQArray): the same leaves, mapped both ways;
  a leaf of another name or shape is refused, named."""
  from jsparse._src.tunix.quantized import RolloutStructure
  tree = {"w": masters(15)["w"], "b": masters(15)["b"]}
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, quantize=quantized.int4_tiles(64))
  held = quantized.unpack(plan.cast(tree))
  ptq_like = {"b": held["b"], "w": {"array": {"qvalue": held["w"].qvalue,
                                              "scale": held["w"].scale}}}
  structure = RolloutStructure.of(plan, ptq_like)
  assert not structure.identity
  as_plan = structure.to_view(ptq_like)
  assert_trees_bitwise_equal(as_plan, plan.cast(tree))
  back = structure.to_rollout(as_plan)
  assert jax.tree.structure(back) == jax.tree.structure(ptq_like)
  np.testing.assert_array_equal(code_bits(back["w"]["array"]["qvalue"]),
                                code_bits(ptq_like["w"]["array"]["qvalue"]))
  renamed = {"b": held["b"], "v": ptq_like["w"]}
  with pytest.raises(jsparse.PlanMismatchError, match=r"\['w'\].packed.*\['v'\]"):
    RolloutStructure.of(plan, renamed)
  short = {"b": held["b"][:-1], "w": ptq_like["w"]}
  with pytest.raises(jsparse.PlanMismatchError, match=r"\['b'\]"):
    RolloutStructure.of(plan, short)
