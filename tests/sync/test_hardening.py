"""A receiver under hostile or careless use: parts that repeat what a stream already holds are
refused before they are decoded (what a version stages is bounded by the plan), concurrent
deliveries are serialized, and arguments of the wrong type get errors that say what was
expected."""

import logging
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.wire import parts as parts_wire
from jsparse.testing import assert_trees_bitwise_equal, trees_bitwise_equal
from tests import strategies


def _setup(seed=0, leaves=4, size=20_000):
  rng = np.random.default_rng(seed)
  params = {f"w{i}": jnp.asarray(rng.normal(size=size).astype(np.float32))
            for i in range(leaves)}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=1.0)
  new = {k: jnp.asarray(strategies.perturb(rng, np.asarray(v), 0.5)) for k, v in params.items()}
  return plan, params, new


def _repeating(plan, part, times):
  """``part`` rebuilt (valid checksums) with its first unit listed ``times`` times."""
  index = parts_wire.read_index(plan, part)
  record = parts_wire.read_unit(plan, index, part, 0)
  return parts_wire.encode_part(plan, index.header, [index.entries[0].unit] * times,
                                [record] * times)


def test_a_stream_refuses_a_part_repeating_covered_units_before_decoding_it():
  plan, params, new = _setup()
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  parts = list(sender.send_stream(new, chunk_bytes=40_000))
  assert len(parts) >= 2
  stream = receiver.open_stream()
  staged = stream._reader._staged
  with pytest.raises(jsparse.PayloadError, match="covered twice"):
    stream.add(_repeating(plan, parts[0], 150))  # one unit, 150 times
  assert not staged._counts.any()  # refused before a single body was decoded or staged
  stream = receiver.open_stream()
  stream.add(parts[0])
  counted = stream._reader._staged._counts.copy()
  for repeat in (parts[0], _repeating(plan, parts[0], 1)):  # the same unit again, in a new part
    with pytest.raises(jsparse.PayloadError):
      stream.add(repeat)
    assert (stream._reader._staged._counts == counted).all()
  with pytest.raises(jsparse.PayloadError):
    stream.commit()
  assert receiver.version == 0
  stream = receiver.open_stream()  # the next delivery of the version is accepted
  for part in parts:
    stream.add(part)
  assert_trees_bitwise_equal(stream.commit(), plan.cast(new))


def test_receive_refuses_a_unit_covered_twice_before_decoding():
  plan, params, new = _setup()
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  part = sender.send(new)
  with pytest.raises(jsparse.PayloadError, match="covered twice"):
    receiver.receive([_repeating(plan, part, 2)])
  assert_trees_bitwise_equal(receiver.receive([part]), plan.cast(new))


def test_concurrent_deliveries_of_one_version_apply_it_once():
  plan, params, new = _setup(leaves=2, size=4096)
  for trial in range(6):
    sender = jsparse.Sender(plan, params)
    receiver = jsparse.Receiver(plan, plan.cast(params), donate=True)
    data = sender.send(new)
    deliver = receiver.receive
    outcomes, barrier = [], threading.Barrier(2)

    def deliver_once():
      barrier.wait()
      try:
        deliver(data)
        outcomes.append("applied")
      except jsparse.JsparseError as e:
        outcomes.append(type(e).__name__)

    threads = [threading.Thread(target=deliver_once) for _ in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert sorted(outcomes) == ["VersionError", "applied"], (trial, outcomes)
    assert receiver.version == 1
    assert trees_bitwise_equal(receiver.params, plan.cast(new)), trial


@pytest.mark.parametrize("parts, message", [
    (None, "must be the bytes of a part .what Sender.send returns., a list of a version's parts"),
    (7, "must be the bytes of a part .what Sender.send returns., a list of a version's parts"),
    ("a str", "must be the bytes of a part .what Sender.send returns., a list of a version's "
     "parts"),
    (["a str"], "part 0 must be bytes"),
    ([b"ok", None], "part 1 must be bytes"),
])
def test_receive_names_what_it_expects(parts, message):
  plan, params, _ = _setup(leaves=1, size=8)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  with pytest.raises(jsparse.ArgumentError, match=message):
    receiver.receive(parts)
  with pytest.raises(TypeError):  # ArgumentError is a TypeError too
    receiver.receive(parts)


@pytest.mark.parametrize("data, message", [(b"JSPS", "whole payload .container 'JSPS'.*jsparse "
                                                      "0.1 wrote.*send the version again"),
                                           (b"a part", "truncated"),
                                           ([b"JSPP"], "truncated"), ([b"x"], "truncated"),
                                           ([], "no parts given")])
def test_receive_refuses_bytes_that_are_no_payload_or_part(data, message):
  plan, params, _ = _setup(leaves=1, size=8)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  with pytest.raises(jsparse.PayloadError, match=message):
    receiver.receive(data)
  assert receiver.version == 0


def test_a_part_of_a_retired_format_is_refused_naming_it_and_the_jsparse_that_wrote_it():
  """Format 1 (positions and raw bits, coding "lists") is no longer read: a part of it, valid
  in every other way (its header checksum too), is refused before any body is read."""
  plan, params, _ = _setup(leaves=1, size=8)
  part = bytearray(jsparse.Sender(plan, params).send(jax.tree.map(lambda x: x + 1, params)))
  part[4] = 1  # the format byte
  end = parts_wire.HEADER.size + parts_wire.HEADER.unpack_from(part)[-1]
  part[end:end + 4] = zlib.crc32(bytes(part[:end])).to_bytes(4, "little")
  receiver = jsparse.Receiver(plan, plan.cast(params))
  with pytest.raises(jsparse.PayloadError, match=r"format 1 .*'lists'.*jsparse 0\.1 .*"
                                                 r"send the version again"):
    receiver.receive(bytes(part))
  assert receiver.version == 0


@pytest.mark.parametrize("bad", ["a str", None, 7, [b"x"]])
def test_stream_add_names_what_it_expects(bad):
  plan, params, _ = _setup(leaves=1, size=8)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  with pytest.raises(jsparse.ArgumentError, match="bytes"):
    receiver.open_stream().add(bad)


def _public_calls():
  import tempfile
  from jsparse import engine
  params = {"w": jnp.zeros(8)}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender = jsparse.Sender(plan, params)
  feed = engine.DirectoryFeed(tempfile.mkdtemp())
  return {
      "make_plan rollout_dtype": lambda: jsparse.make_plan(params, rollout_dtype="foo"),
      "Sender plan": lambda: jsparse.Sender("a plan", params),
      "Receiver plan": lambda: jsparse.Receiver(None, params),
      "diff plan": lambda: jsparse.diff("a plan", params, params),
      "apply plan": lambda: jsparse.apply("a plan", plan.cast(params), None),
      "receive": lambda: jsparse.Receiver(plan, plan.cast(params)).receive(None),
      "Publisher feed": lambda: engine.Publisher(sender, None),
      "Publisher sender": lambda: engine.Publisher("a sender", feed),
      "Subscriber receiver": lambda: engine.Subscriber(None, feed),
      "DirectoryFeed root": lambda: engine.DirectoryFeed(None),
  }


@pytest.mark.parametrize("name", list(_public_calls()))
def test_a_public_call_with_an_argument_of_the_wrong_type_says_what_it_expects(name):
  with pytest.raises(jsparse.JsparseError, match="must be"):
    _public_calls()[name]()


def test_overflow_is_counted_and_logged_with_the_capacity_that_fits_at_most_once_a_minute(
    caplog):
  params = {'w': jnp.zeros(100_000), 'b': jnp.zeros(8)}
  plan = jsparse.make_plan(params, capacity=0.01)
  sender = jsparse.Sender(plan, params, max_capacity=0)  # static slots: these overflow
  receiver = jsparse.Receiver(plan, sender.snapshot)
  dense = {'w': jnp.ones(100_000).at[::2].set(0.0), 'b': jnp.zeros(8)}
  with caplog.at_level(logging.WARNING, logger="jsparse"):
    receiver.receive(sender.send(dense))
    stats = sender.last_stats
    receiver.receive(sender.send({'w': dense['w'] + 1.0, 'b': jnp.zeros(8)}))
  assert (stats.overflowed_segments, stats.overflowed_changes) == (1, 50_000)
  assert sender.last_stats.overflowed_changes == 100_000
  warnings = [r.getMessage() for r in caplog.records if "densely" in r.getMessage()]
  assert len(warnings) == 1, warnings  # the second overflow within the minute is counted
  assert "['w']" in warnings[0] and "capacity=0.5 or capacity_slots=50000" in warnings[0]
  sender._overflow_log.every_seconds = 0
  with caplog.at_level(logging.WARNING, logger="jsparse"):
    receiver.receive(sender.send({'w': dense['w'] + 2.0, 'b': jnp.zeros(8)}))
  assert "1 more overflowed versions" in caplog.records[-1].getMessage()
  assert_trees_bitwise_equal(receiver.params, plan.cast({'w': dense['w'] + 2.0,
                                                         'b': jnp.zeros(8)}))
