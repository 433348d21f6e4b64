"""The packed coding (format 3): bit packing on the device, exact syncs, hostile parts refused,
TPU-friendly programs, and its size against the compact format."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from jsparse._src.core import bitpack
from jsparse._src.core.chunks import chunks_of
from jsparse._src.sync import auto, packed_units, programs
from jsparse._src.device import packing as device_codes
from jsparse._src.wire.packed import PackedRecord
from jsparse._src.wire.payload import Mode
from jsparse.benchmarks.scale import layered_tree, rl_like_update
from jsparse.testing import assert_trees_bitwise_equal, special_values
from tests.part_bytes import read_part, recoded


@st.composite
def _values(draw):
  """uint32 values of mixed magnitudes (whole blocks of small ones, single huge ones)."""
  n = draw(st.integers(0, 200))
  bits = draw(st.lists(st.integers(0, 32), min_size=n, max_size=n))
  raw = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
  values = np.array([r & ((1 << b) - 1) for r, b in zip(raw, bits)], np.uint32)
  return values, draw(st.integers(0, n))


@settings(max_examples=60, deadline=None)
@given(_values(), st.sampled_from([bitpack.PAGE_BLOCKS, 1, 2]))
def test_bitpack_round_trips_any_values_and_counts_its_words_like_the_host(case, page_blocks):
  """Also with pages of 1 and 2 blocks: a long stream's pages, each starting on a word."""
  values, count = case
  size = max(1, len(values))
  values = np.pad(values, (0, size - len(values)))
  widths, words, used = bitpack.pack(jnp.asarray(values), count, page_blocks)
  assert int(used) == bitpack.num_words(np.asarray(widths), count, page_blocks)
  assert words.shape == (bitpack.max_words(size, page_blocks),)
  assert not np.asarray(words)[int(used):].any()  # nothing written past the used words
  # Reads past the end give 0 bits.
  out = bitpack.unpack(widths, words[:int(used)], count, size, page_blocks)
  expected = np.where(np.arange(size) < count, values, 0)
  np.testing.assert_array_equal(np.asarray(out), expected)


def test_bitpack_keeps_full_width_values():
  values = jnp.array([0xFFFFFFFF, 0, 0x80000000, 1] * 20, jnp.uint32)
  widths, words, used = bitpack.pack(values, 80)
  assert np.asarray(widths).tolist() == [32, 32, 32]
  np.testing.assert_array_equal(np.asarray(bitpack.unpack(widths, words, 80, 80)), values)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_rank_order_sorts_distinct_ranks_like_a_stable_argsort(data):
  size = data.draw(st.integers(1, 300))
  ranks = np.array(data.draw(st.lists(st.integers(0, size - 1), max_size=size, unique=True)),
                   np.int32)
  used = np.array(data.draw(st.lists(st.booleans(), min_size=len(ranks), max_size=len(ranks))),
                  bool)
  order = np.asarray(device_codes.rank_order(jnp.asarray(ranks, jnp.int32),
                                             jnp.asarray(used), size))
  expected = np.full(len(ranks), -1)
  mine = np.flatnonzero(used)
  expected[mine[np.argsort(ranks[mine], kind="stable")]] = np.arange(len(mine))
  np.testing.assert_array_equal(order, expected)


def _special_tree():
  tree = {}
  for name, dtype in (("bf", jnp.bfloat16), ("f32", jnp.float32), ("f16", jnp.float16)):
    values = special_values(dtype)
    tree[name] = np.resize(values, 3000).astype(dtype)
  tree["i8"] = np.arange(3000, dtype=np.int8)
  tree["flag"] = np.arange(3000) % 3 == 0
  tree["small"] = np.linspace(-1, 1, 7).astype(np.float32)
  return tree


def _shuffled(tree, seed):
  """Every leaf's elements permuted: special values move onto each other's slots."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, v in tree.items():
    v = np.array(v)
    sel = rng.random(v.shape) < 0.1
    v[sel] = rng.permutation(v[sel])
    out[k] = v
  return out


def test_packed_syncs_are_bit_exact_on_special_values():
  tree = _special_tree()
  plan = jsparse.make_plan(tree, capacity=0.2)
  sender = jsparse.Sender(plan, tree, coding="packed")
  receiver = jsparse.Receiver(plan, tree)
  for step in range(1, 4):
    new = _shuffled(tree, step)
    receiver.receive(sender.send(new))
    assert_trees_bitwise_equal(receiver.params, plan.cast(new))
    tree = new
  assert sender.last_stats.changed > 0


def test_packed_sync_is_bit_exact_on_64_bit_leaves():
  with jax.enable_x64(True):
    tree = {"d": np.resize(special_values(np.float64), 4096), "q": np.arange(4096, dtype=np.int64)}
    plan = jsparse.make_plan(tree, capacity=0.3)
    sender = jsparse.Sender(plan, tree, coding="packed")
    receiver = jsparse.Receiver(plan, tree)
    new = _shuffled(tree, 7)
    new["q"] = new["q"] + (np.arange(4096) % 5 == 0) * (2**40)
    receiver.receive(sender.send(new))
    assert_trees_bitwise_equal(receiver.params, new)


@pytest.fixture(scope="module")
def one_change():
  params = {"w": jnp.zeros(1000)}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender = jsparse.Sender(plan, params, coding="packed")
  data = sender.send({"w": params["w"].at[3].set(1.0).at[500].set(-2.0)})
  return plan, params, data


def _refused(plan, params, data, match, error=jsparse.PayloadError):
  receiver = jsparse.Receiver(plan, plan.cast(params), donate=False)
  with pytest.raises(error, match=match):
    receiver.receive(data)
  assert receiver.version == 0
  assert_trees_bitwise_equal(receiver.params, plan.cast(params))


def test_corrupt_and_truncated_packed_parts_are_refused(one_change):
  plan, params, data = one_change
  _refused(plan, params, data[:-9], "truncated|accounts for")
  _refused(plan, params, data[:50] + bytes([data[50] ^ 1]) + data[51:], "checksum")
  _refused(plan, params, data[:-1] + bytes([data[-1] ^ 1]), "body checksum")
  # Valid checksums around broken streams: each is refused before anything is written.
  index, (record,) = read_part(plan, data)
  key_widths, key_words, code_widths, code_words = record.streams
  streams = lambda *s: recoded(plan, index, [PackedRecord(record.mode, record.count, s)])
  assert streams(*record.streams) == data
  _refused(plan, params, streams(np.array([33], np.uint8), key_words, code_widths, code_words),
           "width 33")
  _refused(plan, params, streams(key_widths, key_words[:-1], code_widths, code_words),
           "truncated|unexpected|blocks")
  _refused(plan, params, streams(np.array([key_widths[0] + 20], np.uint8), key_words,
                                 code_widths, code_words), "truncated|unexpected|blocks")
  # Well framed, but other keys: the end-to-end digest refuses what the device checks allow.
  other = streams(np.array([key_widths[0] + 1], np.uint8), key_words, code_widths, code_words)
  _refused(plan, params, other, "end-to-end", jsparse.IntegrityError)


def test_packed_programs_are_tpu_friendly():
  """No sort, no 64-bit integers, no loops and no host callbacks in the lowered programs."""
  tree = layered_tree(16, 64)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, capacity=0.05)
  chunk = chunks_of(plan)[0]
  segs = chunk.plan.segments
  keys = tuple(jnp.zeros((s.capacity,), jnp.int32) for s in segs)
  bits = tuple(jnp.zeros((s.capacity,), s.bit_dtype) for s in segs)
  counts = np.zeros(len(segs), np.int32)
  blocks = tuple(None for _ in segs)
  texts = [device_codes.pack_program.lower(chunk.plan, ranked, keys, bits, bits, counts,
                                           blocks).as_text() for ranked in (False, True)]
  slots = tuple(s.capacity for s in segs)
  texts.append(device_codes.unpack_program.lower(
      chunk.plan, slots, jnp.zeros(4096, jnp.uint32), jnp.zeros(4, jnp.int32), counts,
      blocks).as_text())
  # A part's unit of a split leaf: to and from positions in the unit.
  slots = [jnp.zeros((16,), jnp.int32)] * 3
  texts.append(packed_units._unit_changes.lower((64, 48), (8, 48), slots, slots, slots,
                                                jnp.zeros(3, jnp.int32)).as_text())
  texts.append(packed_units._segment_positions.lower(
      (64, 48), (8, 48), (8, 1), jnp.zeros(48, jnp.int32), jnp.arange(3, dtype=jnp.int32)
  ).as_text())
  for text in texts:
    # Attributes (window sizes, paddings) are 64-bit whatever the program: only values count.
    values = re.sub(r"dense<[^>]*>\s*:\s*tensor<[^>]*>|array<i64[^>]*>", "", text)
    assert "tensor<" in values
    for banned in ("stablehlo.sort", "stablehlo.while", "i64", "f64", "custom_call",
                   "callback"):
      assert banned not in values, banned


def test_a_chunk_past_the_int32_indices_of_the_packed_buffer_is_refused_clearly():
  """A chunk whose slots would pack into 2**31 words or more is refused when its program is
  traced (shapes only: nothing this size is allocated)."""
  leaf = jax.ShapeDtypeStruct((2**31 - 1,), jnp.float32)
  plan = jsparse.make_plan({"w": leaf}, rollout_dtype=jnp.bfloat16, capacity=0.6)
  chunk = chunks_of(plan)[0]
  seg = chunk.plan.segments[0]
  keys = (jax.ShapeDtypeStruct((seg.capacity,), jnp.int32),)
  bits = (jax.ShapeDtypeStruct((seg.capacity,), seg.bit_dtype),)
  with pytest.raises(jsparse.ConfigError, match="int32 indices.*lower the plan's capacity"):
    device_codes.pack_program.lower(chunk.plan, False, keys, bits, bits,
                                    np.zeros(1, np.int32), (None,))


def test_packed_bytes_stay_near_the_compact_format_on_an_rl_like_update():
  tree = layered_tree(16, 256)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, capacity=0.05)
  new = rl_like_update(tree, seed=1)
  sizes = {}
  for coding in ("packed", "ranked", "positioned"):
    sender = jsparse.Sender(plan, tree, coding=coding)
    sizes[coding] = len(sender.send(new))
    changed = sender.last_stats.changed
  assert 0.002 < changed / plan.num_elements < 0.05
  assert sizes["packed"] <= 1.1 * sizes["ranked"], sizes
  assert sizes["packed"] / changed <= 1.4, sizes


@pytest.mark.compile_ahead  # its sizes compile in the background
def test_the_prefix_sliced_on_the_device_gives_the_bytes_read_in_place(monkeypatch):
  """On an accelerator the sender copies each chunk's used prefix, sliced on the device; on CPU
  devices it reads the whole buffer in place. Both give the same payload, whole and in parts."""
  tree = layered_tree(8, 256)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, capacity=0.05)
  new = rl_like_update(tree, seed=2)

  def payloads():
    sender = jsparse.Sender(plan, tree, coding="packed")  # (the slicing knows no coding)
    return sender.send(new), sender.send(rl_like_update(new, seed=3))

  sliced, real = [], packed_units._prefix

  class Spy:  # the jitted slice, counted (its sizes still compile in the background)
    def __call__(self, x, size):
      sliced.append(size)
      return real(x, size)

    def lower(self, *args):
      return real.lower(*args)

  monkeypatch.setattr(packed_units, "_prefix", Spy())
  in_place = payloads()
  assert not sliced  # these tests run on CPU devices
  monkeypatch.setattr(packed_units, "in_host_memory", lambda x: False)
  assert payloads() == in_place  # the whole buffers, while the slices' sizes compile
  assert programs.wait_for_slot_levels(timeout=600)
  assert payloads() == in_place
  assert sliced  # the sliced path ran


def test_auto_measures_every_coding_on_its_tree_and_picks_the_fastest_over_the_link():
  tree = layered_tree(8, 128)
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, capacity=0.05)
  slow = jsparse.Sender(plan, tree, coding="auto", link_gbit=1e-6)  # 1 kbit/s: bytes decide
  receiver = jsparse.Receiver(plan, plan.cast(tree))
  new = rl_like_update(tree, seed=3)
  assert auto.measured(plan) is None
  receiver.receive(slow.send(new))  # the first delta: every coding measured on this tree
  calibration = auto.measured(plan)
  rates = calibration.rates
  assert set(rates) == {jsparse.Coding(c) for c in ("packed", "ranked", "positioned")}
  assert all(r.seconds > 0 for r in rates.values())
  assert rates[jsparse.Coding.POSITIONED].bytes_per_change > 1.1 * rates[
      jsparse.Coding.RANKED].bytes_per_change
  changed = slow.last_stats.changed
  assert slow.last_stats.coding == min(
      rates, key=lambda c: rates[c].bytes_per_change).value  # a slow link: the fewest bytes
  fast = jsparse.Sender(plan, tree, coding="auto", link_gbit=1e6)
  fast_receiver = jsparse.Receiver(plan, plan.cast(tree))
  fast_receiver.receive(fast.send(new))
  assert auto.measured(plan) is calibration  # measured once per plan
  assert calibration.changes == changed
  assert fast.last_stats.coding == min(rates, key=lambda c: rates[c].predict(changed, 1e6)).value
  newer = rl_like_update(new, seed=4)
  for sender, rx in ((slow, receiver), (fast, fast_receiver)):
    rx.receive(sender.send(newer))
    assert_trees_bitwise_equal(rx.params, plan.cast(newer))
    assert_trees_bitwise_equal(sender.snapshot, plan.cast(newer))


@pytest.mark.parametrize("split", [True, False])
def test_forged_packed_parts_are_refused_before_anything_is_applied(split):
  """A packed part's unit whose keys leave the unit, repeat, or whose codes are too wide, behind
  valid checksums, is refused on the device, also by a donating receiver; a truncated stream
  on the host. Both for a split leaf's blocks (positions in the unit) and a whole segment
  (ranks)."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from jsparse._src.wire import packed, parts as parts_wire
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  base = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
  spec = P("fsdp") if split else P()
  on_mesh = lambda x: {"w": jax.device_put(x, NamedSharding(mesh, spec))}
  plan = jsparse.make_plan(on_mesh(base), rollout_dtype=jnp.bfloat16, capacity=0.25)
  new = base.copy()
  for row, col in ((0, 5), (0, 7), (9, 3), (20, 0), (63, 47)):
    new[row, col] += 1
  sender = jsparse.Sender(plan, on_mesh(base), coding="packed")
  part = sender.send(on_mesh(new))
  index = parts_wire.read_index(plan, part)
  record = parts_wire.read_unit(plan, index, part, 0)
  assert isinstance(record, packed.PackedRecord) and record.count == 5
  assert record.mode == (Mode.BY_POSITION if split else Mode.BY_RANK)
  key_widths, key_words, code_widths, code_words = record.streams
  gaps = np.asarray(bitpack.unpack(jnp.asarray(key_widths), jnp.asarray(key_words), 5, 5))
  codes = np.asarray(bitpack.unpack(jnp.asarray(code_widths), jnp.asarray(code_words), 5, 5))
  last = int(gaps.sum()) + 4  # the last key
  assert last == 64 * 48 - 1 if split else last < 64 * 48  # split: the unit's last position

  def forged(g=gaps, c=codes, cut=0):
    streams = []
    for values in (g, c):
      widths, words, used = bitpack.pack(jnp.asarray(values.astype(np.uint32)), 5)
      streams += [np.asarray(widths), np.asarray(words)[:int(used) - cut]]
    return parts_wire.encode_part(plan, index.header, [index.entries[0].unit],
                                  [packed.PackedRecord(record.mode, 5, tuple(streams))])

  assert forged() == part
  with_gap = lambda i, v: np.concatenate([gaps[:i], [v], gaps[i + 1:]])
  cases = [(forged(with_gap(4, gaps[4] + 64 * 48 - last)), "out of"),  # one past the unit
           (forged(with_gap(1, 2**32 - 1)), "out of"),  # the second key repeats the first
           (forged(c=np.full(5, 0xFFFF)), "wider"),  # no bf16 code of 16 bits + 1
           (forged(cut=1), "truncated|blocks for")]  # a word short: the rest shifts
  for data, match in cases:
    for donate in (False, True):
      receiver = jsparse.Receiver(plan, plan.cast(on_mesh(base)), donate=donate)
      with pytest.raises(jsparse.PayloadError, match=match):
        receiver.receive([data])
      assert receiver.version == 0
      assert_trees_bitwise_equal(jax.device_get(receiver.params),
                                 jax.device_get(plan.cast(on_mesh(base))))
  receiver = jsparse.Receiver(plan, plan.cast(on_mesh(base)))
  assert_trees_bitwise_equal(receiver.receive([part]), plan.cast(on_mesh(new)))
