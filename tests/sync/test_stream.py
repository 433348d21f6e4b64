"""A version as a stream of parts (``Sender.send_stream`` / ``Receiver.open_stream``): exact on
sparse, overflowing and anchor versions and across layouts; parts bounded in size, in any
order; a missing, corrupt, repeated or foreign part refuses the version and changes nothing; a
stream dropped halfway makes the next version an anchor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.wire import parts as parts_wire
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.meshes import PAIRS, place, trees

CHUNK = 3000  # bytes of rollout data per part: the test trees' leaves make several parts


def _layers(rng, n=6):
  return {f"layer{i}": {"w": strategies.random_bits(rng, (40, 30), np.float32),
                        "b": strategies.random_bits(rng, (30,), np.float32)} for i in range(n)}


def _setup(rng, capacity=0.1, coding="ranked"):
  params = jax.tree.map(jnp.asarray, _layers(rng))
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=capacity,
                           bucket_size=1000)
  return (params, plan, jsparse.Sender(plan, params, coding=coding),
          jsparse.Receiver(plan, plan.cast(params)))


def _perturb(rng, params, density):
  return jax.tree.map(lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), density)),
                      params)


@pytest.mark.parametrize("coding", ["ranked", "positioned", "packed"])
def test_stream_versions_are_exact_and_parts_are_bounded(coding):
  rng = np.random.default_rng(0)
  params, plan, sender, receiver = _setup(rng, coding=coding)
  for step, (density, full) in enumerate([(0.02, False), (0.6, False), (0.01, True),
                                          (0.0, False)]):  # sparse, overflow, anchor, nothing
    params = _perturb(rng, params, density)
    stream = receiver.open_stream()
    parts = list(sender.send_stream(params, anchor=full, chunk_bytes=CHUNK))
    for part in reversed(parts):  # any arrival order
      stream.add(part)
    assert_trees_bitwise_equal(stream.commit(), plan.cast(params))
    assert receiver.version == sender.version == step + 1
    assert receiver.digest == sender.digest
    assert len(parts) == receiver.last_read.parts >= plan.rollout_bytes // CHUNK
    assert sender.last_stats.payload_bytes == sum(len(p) for p in parts)
    if full:  # an anchor: each part carries at most CHUNK bytes of data (and its table)
      assert max(len(p) for p in parts) <= CHUNK + 200


def test_a_streamed_version_is_also_received_whole_or_joined():
  """As the list of its parts, or as one payload (``Version.join``; parts joined in any order,
  as the payloads of several trainer processes are)."""
  rng = np.random.default_rng(1)
  params, plan, sender, receiver = _setup(rng)
  start = plan.cast(params)
  params = _perturb(rng, params, 0.03)
  version = sender.send_stream(params, chunk_bytes=CHUNK)
  first = next(version)
  rest = version.join()  # the parts not yet iterated
  parts = [first, *map(bytes, parts_wire.split_parts(rest))]
  assert len(parts) == version.parts > 2 and b"".join(parts[1:]) == rest
  for data in (parts, b"".join(parts), b"".join(reversed(parts)),
               bytearray(b"".join(parts[1:] + parts[:1]))):
    receiver = jsparse.Receiver(plan, start)
    assert_trees_bitwise_equal(receiver.receive(data), plan.cast(params))
    assert receiver.digest == sender.digest and receiver.last_read.parts == len(parts)


@pytest.mark.parametrize("fault", ["missing", "truncated", "extended", "repeated", "corrupt"])
def test_a_bad_joined_payload_is_refused_and_changes_nothing(fault):
  rng = np.random.default_rng(5)
  params, plan, sender, receiver = _setup(rng)
  before, version = plan.cast(params), receiver.version
  parts = list(sender.send_stream(_perturb(rng, params, 0.02), chunk_bytes=CHUNK))
  joined = {"missing": b"".join(parts[:1] + parts[2:]),
            "truncated": b"".join(parts)[:-7],
            "extended": b"".join(parts) + bytes(40),
            "repeated": b"".join(parts + parts[1:2]),
            "corrupt": b"".join(parts[:1] + [_corrupt(parts[1])] + parts[2:])}[fault]
  message = {"missing": "missing", "truncated": "truncated", "extended": "not a part",
             "repeated": "repeated", "corrupt": "checksum"}[fault]
  with pytest.raises(jsparse.PayloadError, match=message):
    receiver.receive(joined)
  assert receiver.version == version
  assert_trees_bitwise_equal(receiver.params, before)


@pytest.mark.parametrize("trainer, rollout, coding", [(*PAIRS[4], "ranked"),
                                                      (*PAIRS[5], "ranked"),
                                                      (*PAIRS[5], "packed")])
def test_streams_across_layouts(trainer, rollout, coding):
  base, _ = trees(3, 0.0)
  plan = jsparse.make_plan(place(base, trainer), rollout_dtype=jnp.bfloat16, capacity=0.1,
                           bucket_size=256)
  sender = jsparse.Sender(plan, place(base, trainer), coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(place(jax.tree.map(np.asarray, base), rollout)))
  rng = np.random.default_rng(4)
  for density in (0.02, 0.6):
    base = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
    stream = receiver.open_stream()
    for part in sender.send_stream(place(base, trainer), chunk_bytes=1000):
      stream.add(part)
    assert_trees_bitwise_equal(stream.commit(), plan.cast(base))


def _corrupt(part):
  data = bytearray(part)
  data[-1] ^= 0xFF
  return bytes(data)


@pytest.mark.parametrize("fault", ["missing", "corrupt", "repeated", "other version"])
def test_a_bad_stream_refuses_the_version_and_changes_nothing(fault):
  rng = np.random.default_rng(2)
  params, plan, sender, receiver = _setup(rng)
  before, version = plan.cast(params), receiver.version
  other = jsparse.Sender(plan, params)
  other_parts = list(other.send_stream(_perturb(rng, params, 0.02), chunk_bytes=CHUNK,
                                       version=7))
  parts = list(sender.send_stream(_perturb(rng, params, 0.02), chunk_bytes=CHUNK))
  assert len(parts) > 2
  stream = receiver.open_stream()
  for k, part in enumerate(parts):
    if k == 1 and fault == "missing":
      continue
    if k == 1 and fault == "corrupt":
      with pytest.raises(jsparse.PayloadError, match="checksum"):
        stream.add(_corrupt(part))
      continue
    if k == 1 and fault == "other version":
      with pytest.raises(jsparse.PayloadError, match="another version"):
        stream.add(other_parts[1])
      continue
    stream.add(part)
    if k == 1 and fault == "repeated":
      with pytest.raises(jsparse.PayloadError, match="repeated"):
        stream.add(part)
  with pytest.raises(jsparse.PayloadError):
    stream.commit()
  assert receiver.version == version
  assert_trees_bitwise_equal(receiver.params, before)
  with pytest.raises(jsparse.VersionError, match="committed"):
    stream.add(parts[0])


def test_a_stream_dropped_halfway_makes_the_next_version_an_anchor():
  rng = np.random.default_rng(3)
  params, plan, sender, receiver = _setup(rng)
  params = _perturb(rng, params, 0.02)
  parts = sender.send_stream(params, chunk_bytes=CHUNK)
  next(parts)  # the trainer dies, or the link breaks, after the first part
  parts.close()
  params = _perturb(rng, params, 0.02)
  data = sender.send(params)
  assert sender.last_stats.anchor
  assert_trees_bitwise_equal(receiver.receive(data), plan.cast(params))


def test_chunk_bytes_must_be_a_positive_int():
  rng = np.random.default_rng(5)
  params, _, sender, _ = _setup(rng)
  with pytest.raises(jsparse.ConfigError, match="chunk_bytes"):
    sender.send_stream(params, chunk_bytes=0)
  assert sender.version == 0


def test_parts_of_a_stream_cover_each_segment_once_in_chunk_order():
  rng = np.random.default_rng(6)
  params, plan, sender, _ = _setup(rng)
  parts = list(sender.send_stream(params, chunk_bytes=CHUNK))
  segments = [e.unit.segment for p in parts for e in parts_wire.read_index(plan, p).entries]
  assert sorted(segments) == list(range(len(plan.segments)))
