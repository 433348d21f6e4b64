"""The wire formats: decoder robustness (fuzzed), hostile lengths, compactness, every dtype."""

import dataclasses
import functools
import struct
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

import jsparse
from jsparse._src.wire import compact, framing
from jsparse._src.wire import payload as payload_lib
from jsparse._src.wire.reader import Reader
from jsparse._src.wire.payload import Format, Mode
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies


@functools.lru_cache(maxsize=None)
def _samples():
  """(plan, valid payloads of both formats, including dense segments and an anchor)."""
  tree = strategies.mixed_tree(np.random.default_rng(0))
  plan = jsparse.make_plan(tree, capacity=0.1, **strategies.mixed_plan_options())
  rng = np.random.default_rng(1)
  payloads = []
  for coding in ("lists", "ranked"):
    sender = jsparse.Sender(plan, tree, coding=coding)
    new = strategies.nudge(rng, tree, 0.03)
    payloads.append(sender.send(new))
    payloads.append(sender.send(dict(new, w=new["w"] + 1.0)))  # w overflows: dense
    payloads.append(sender.send(new, anchor=True))
  return plan, tree, payloads


def _with_crc(body: bytes) -> bytes:
  return body + struct.pack("<I", zlib.crc32(body))


def _check_decodes_or_refuses(plan, data):
  try:
    payload = framing.decode(plan, data)
  except jsparse.PayloadError as e:
    assert str(e)
    return None
  for seg, part in zip(plan.segments, payload.segments):  # what decode promises
    if part.mode == Mode.DENSE:
      assert len(part.values) == seg.size
      continue
    assert len(part.indices) == len(part.values) <= seg.capacity
    if len(part.indices):
      assert part.indices[0] >= 0 and part.indices[-1] < seg.size
      assert np.all(np.diff(part.indices) > 0)
  return payload


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=600), st.booleans(), st.integers(0, 5))
def test_fuzz_arbitrary_bytes_are_refused_cleanly(noise, valid_crc, which):
  plan, _, payloads = _samples()
  header = payloads[which][:framing.HEADER.size]  # sometimes a real header, to get past it
  for data in (noise, header + noise):
    _check_decodes_or_refuses(plan, _with_crc(data) if valid_crc else data)


@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 5), st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255),
                                             st.sampled_from(["xor", "set", "cut", "insert"])),
                                   min_size=1, max_size=4))
def test_fuzz_mutated_payloads_with_a_valid_checksum(which, mutations):
  """Mutations behind a recomputed checksum reach the structural checks: every outcome is a
  PayloadError or a payload that keeps decode's promises."""
  plan, _, payloads = _samples()
  body = bytearray(payloads[which][:-4])
  for where, byte, kind in mutations:
    at = where % (len(body) + 1)
    if kind == "xor" and at < len(body):
      body[at] ^= byte or 1
    elif kind == "set" and at < len(body):
      body[at] = byte
    elif kind == "cut":
      del body[at:]
    else:
      body[at:at] = bytes([byte]) * (1 + where % 7)
  _check_decodes_or_refuses(plan, _with_crc(bytes(body)))


def test_hostile_lengths_are_refused_before_decompressing():
  plan, _, payloads = _samples()
  good = framing.decode(plan, payloads[3])
  header = payloads[3][:framing.HEADER.size]
  table = b"".join(struct.pack("<BI", Mode.EMPTY, 0) for _ in plan.segments)
  bomb = zstandard.ZstdCompressor().compress(bytes(50_000_000))  # 50 MB of zeros, ~1.6 KB
  for streams in [struct.pack("<II", 2**32 - 1, 0),  # a huge raw length
                  struct.pack("<II", 0, 2**32 - 1),  # packed bytes that are not there
                  struct.pack("<II", 0, len(bomb)) + bomb]:
    with pytest.raises(jsparse.PayloadError):
      framing.decode(plan, _with_crc(header + table + streams))
  assert good.format == Format.COMPACT


def test_compact_format_is_near_one_byte_per_change_on_an_rl_update():
  """A small TinyLM, AdamW at lr 1e-6 on fp32 masters, bf16 rollout: both formats exact, the
  compact one below 1.5 B/change (the benchmark measures ~1 on a 21M model)."""
  from flax import nnx
  from jsparse.examples import rl_model
  cfg = rl_model.Config(vocab=1024, dim=256, depth=2, batch=8, seq=32, pretrain_steps=20)
  model, optimizer, batches = rl_model.rl_finetuning(cfg)
  params = nnx.state(model, nnx.Param)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  senders = {f: jsparse.Sender(plan, params, coding=c) for f, c in ((1, "lists"), (2, "ranked"))}
  receivers = {f: jsparse.Receiver(plan, plan.cast(params)) for f in (1, 2)}
  for _ in range(3):
    rl_model.train_step(model, optimizer, next(batches))
    params = nnx.state(model, nnx.Param)
    sizes = {f: len(s.send(params)) for f, s in senders.items()}
    changed = senders[2].last_stats.changed
  for f in (1, 2):
    receivers[f].receive(senders[f].send(params, anchor=True))
    assert_trees_bitwise_equal(receivers[f].params, plan.cast(params))
  per_change = sizes[2] / changed
  print(f"\ncompact: {per_change:.2f} B/change at density {changed / plan.num_elements:.2%}; "
        f"lists {sizes[1] / changed:.2f}")
  assert per_change < 1.5 and sizes[1] / sizes[2] > 2.5


@pytest.mark.parametrize("dtype", strategies.ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_compact_format_with_special_values_of_every_dtype(dtype):
  rng = np.random.default_rng(7)
  base = {"big": strategies.with_specials(rng, strategies.random_bits(rng, (70, 30), dtype)),
          "small": strategies.with_specials(rng, strategies.random_bits(rng, (9,), dtype))}
  plan = jsparse.make_plan(base, capacity=0.5, bucket_size=1000)
  sender = jsparse.Sender(plan, base)
  receiver = jsparse.Receiver(plan, base)
  for density in (0.01, 0.3):
    new = {k: strategies.with_specials(rng, strategies.perturb(rng, v, density))
           for k, v in base.items()}
    assert_trees_bitwise_equal(receiver.receive(sender.send(new)), new)
    base = new


def test_varints_roundtrip_and_refuse_overlong_or_short():
  values = np.array([0, 1, 127, 128, 16383, 16384, 2**31 - 1, 2**34, 2**35, 2**63, 2**64 - 1],
                    np.uint64)
  assert compact.varint_decode(compact.varint_encode(values), len(values), "t", 2**64).tolist() \
      == values.tolist()
  for data, count in [(b"\x80", 1), (b"\x01\x02", 1), (b"\xff" * 5 + b"\x01", 1), (b"", 1)]:
    with pytest.raises(jsparse.PayloadError):
      compact.varint_decode(data, count, "t", 2**35)
  with pytest.raises(jsparse.PayloadError, match="at or above"):
    compact.varint_decode(compact.varint_encode(np.array([2**31])), 1, "t", 2**31)
  with pytest.raises(jsparse.PayloadError, match="at or above"):  # bits past 64 in byte 10
    compact.varint_decode(b"\xff" * 9 + b"\x02", 1, "t", 2**64)


def test_varints_cut_across_parsing_windows_roundtrip():
  rng = np.random.default_rng(5)
  bits = rng.integers(0, 64, 3 * compact._BLOCK)  # lengths of 1..10 bytes, windows cut them
  values = rng.integers(0, 2**63, len(bits), dtype=np.uint64) >> bits.astype(np.uint64)
  data = compact.varint_encode(values)
  assert compact.varint_decode(data, len(values), "t", 2**64).tolist() == values.tolist()
  small = values[values < 2**31]
  decoded = compact.varint_decode(compact.varint_encode(small), len(small), "t", 2**31, np.uint32)
  assert decoded.dtype == np.uint32 and decoded.tolist() == small.tolist()
  with pytest.raises(jsparse.PayloadError, match="expected"):
    compact.varint_decode(data, len(values) - 1, "t", 2**64)


def test_host_temporaries_of_format_2_stay_a_few_bytes_per_change():
  """Coding works a block of changes at a time: the traced peak of encoding 1M changes, and of
  decoding them, is a few bytes per change (the streams and the decoded records), whatever
  the count (before blocks: ~90 B per change to encode, ~60 to decode)."""
  import tracemalloc
  size, count = 1 << 24, 1 << 20
  plan = jsparse.make_plan({"w": np.zeros(size, np.float32)}, rollout_dtype=jnp.bfloat16,
                           capacity=0.1)
  rng = np.random.default_rng(0)
  keys = np.sort(rng.choice(size, count, replace=False)).astype(np.int32)
  codes = rng.geometric(0.4, count).astype(np.uint16)  # small ulp codes, as RL updates make
  codes[rng.random(count) < 0.01] = 40_000  # and 1% escaped
  records = (payload_lib.SegmentPayload(Mode.BY_POSITION, keys, codes),)
  tracemalloc.start()
  body = compact.encode_body(plan, records)
  encode_peak = tracemalloc.get_traced_memory()[1] - len(body)
  tracemalloc.stop()
  tracemalloc.start()
  (decoded,) = compact.decode_body(plan, Reader(body))
  decode_peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert decoded.indices.tolist() == keys.tolist() and decoded.values.tolist() == codes.tolist()
  assert encode_peak < 8 * count and decode_peak < 12 * count, (encode_peak / count,
                                                                 decode_peak / count)


@pytest.mark.parametrize("records", ["fewer", "more", "generator"])
def test_encode_takes_one_record_per_segment_from_any_iterable(records):
  """A sender's records come as a generator (each segment coded as it comes): the bytes are
  those of the same records in a tuple, and a count other than the plan's is refused."""
  plan, _, payloads = _samples()
  payload = framing.decode(plan, payloads[0])
  segments = {"fewer": payload.segments[:-1], "more": payload.segments + payload.segments[:1],
              "generator": (record for record in payload.segments)}[records]
  lazy = dataclasses.replace(payload, segments=segments)
  if records == "generator":
    assert framing.encode(plan, lazy) == framing.encode(plan, payload) == payloads[0]
  else:
    with pytest.raises(jsparse.PayloadError, match=f"the plan('s)? {len(plan.segments)}"):
      framing.encode(plan, lazy)
