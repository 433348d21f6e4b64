"""Payload parts (``Sender.send`` / ``Receiver.receive``) in one process: exactness
across layouts, codings and overflow; refusals of missing, repeated, corrupt and mismatched
parts; reading only the units a process needs. The multi-process jobs are in
``tests/multihost``."""

import dataclasses
import mmap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.core.units import (Unit, block_box, needs_unit, to_segment_positions,
                                     to_unit_positions, unit_slots)
from jsparse._src.wire import parts as parts_wire
from jsparse._src.wire.payload import Mode
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.meshes import PAIRS, assert_layout, place, trees


def _setup(trainer, rollout, coding="ranked", capacity=0.1, seed=1):
  base, _ = trees(seed, 0.0)
  params = place(base, trainer)
  rollout_params = place(jax.tree.map(np.asarray, base), rollout)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=capacity,
                           bucket_size=256)
  return (base, plan, jsparse.Sender(plan, params, coding=coding),
          jsparse.Receiver(plan, plan.cast(rollout_params)),
          {k: v.sharding for k, v in rollout_params.items()})


def split(plan, data, k):
  """One part re-cut into ``k`` parts, its units dealt round-robin (as ``k`` trainer processes
  would each send theirs)."""
  index = parts_wire.read_index(plan, data)
  records = [parts_wire.read_unit(plan, index, data, i) for i in range(len(index.entries))]
  units = [e.unit for e in index.entries]
  return [parts_wire.encode_part(plan, dataclasses.replace(index.header, part=p, parts=k),
                                 units[p::k], records[p::k]) for p in range(k)]


# Every layout pair with "ranked"; the other codings on three pairs (a split
# trainer, a split rollout, both split on two axes): their coding differs, not their layouts.
CASES = ([(t, r, "ranked") for t, r in PAIRS]
         + [(t, r, c) for t, r in (PAIRS[0], PAIRS[4], PAIRS[5])
            for c in ("positioned", "packed")])


@pytest.mark.parametrize("trainer, rollout, coding", CASES)
def test_parts_are_exact_across_layouts_codings_and_overflow(trainer, rollout, coding):
  base, plan, sender, receiver, shardings = _setup(trainer, rollout, coding)
  rng = np.random.default_rng(2)
  for step, density in enumerate([0.02, 0.6, 0.01]):  # 0.6 overflows: dense units
    base = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
    part = sender.send(place(base, trainer), anchor=step == 2 and coding == "positioned")
    assert parts_wire.read_index(plan, part).header.format == jsparse.Coding(coding).format
    out = receiver.receive(split(plan, part, 3) if step else [part])
    assert_trees_bitwise_equal(out, plan.cast(base))
    assert_layout(out, shardings)
    assert receiver.version == sender.version == step + 1
    assert receiver.last_read.bytes_read == receiver.last_read.bytes_total  # one process


def test_one_call_takes_every_form_of_a_version(tmp_path):
  """A version of one part, as bytes, as an mmap of a file, in a list or a tuple; one of three
  parts joined in one file."""
  base, plan, sender, _, _ = _setup("fsdp8", "single", capacity=0.1)
  rng = np.random.default_rng(3)
  new = {k: strategies.nudge_leaf(rng, v, 0.03) for k, v in base.items()}
  part = sender.send(place(new, "fsdp8"))
  (tmp_path / "part").write_bytes(part)
  with open(tmp_path / "part", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    for data in (part, m, [part], (m,)):
      receiver = jsparse.Receiver(plan, plan.cast(place(base, "single")))
      assert_trees_bitwise_equal(receiver.receive(data), plan.cast(new))
  (tmp_path / "joined").write_bytes(b"".join(split(plan, part, 3)))
  with open(tmp_path / "joined", "rb") as f, mmap.mmap(f.fileno(), 0,
                                                        access=mmap.ACCESS_READ) as m:
    receiver = jsparse.Receiver(plan, plan.cast(place(base, "single")))
    assert_trees_bitwise_equal(receiver.receive(m), plan.cast(new))
    assert receiver.last_read.parts == 3


@pytest.mark.parametrize("coding", ["ranked", "packed"])
def test_parts_of_split_leaves_widened_past_their_capacity_are_sparse_and_exact(coding):
  """A leaf split over 8 devices whose changes exceed its capacity: its blocks' slots widen, and
  its units carry more changes than the capacity, sparsely, to a receiver of the same mesh."""
  base, plan, sender, receiver, shardings = _setup("fsdp8", "fsdp8", coding, capacity=0.01)
  rng = np.random.default_rng(5)
  for step in range(3):
    new = {k: strategies.nudge_leaf(rng, v, 0.1) for k, v in base.items()}
    part = sender.send(place(new, "fsdp8"))
    entries = parts_wire.read_index(plan, part).entries
    out = receiver.receive([part])
    assert_trees_bitwise_equal(out, plan.cast(new))
    base = new
  split_leaf = [i for i, seg in enumerate(plan.segments) if seg.blocks > 1][0]
  widened = [e for e in entries if e.unit.segment == split_leaf]
  assert widened and all(e.mode != Mode.DENSE and
                         e.count > unit_slots(plan, e.unit).segments[0].capacity
                         for e in widened), widened


def _refused(receiver, parts, error=jsparse.PayloadError, match=None):
  before = jax.tree.map(np.asarray, receiver.params)
  with pytest.raises(error, match=match):
    receiver.receive(parts)
  assert receiver.version == 0
  assert_trees_bitwise_equal(receiver.params, before)


def test_incomplete_repeated_corrupt_or_mixed_parts_change_nothing():
  base, plan, sender, receiver, _ = _setup("fsdp8", "dp2xtp4")
  rng = np.random.default_rng(4)
  new = {k: strategies.perturb(rng, v, 0.05) for k, v in base.items()}
  parts = split(plan, sender.send(place(new, "fsdp8")), 3)
  _refused(receiver, parts[:2], match=r"missing \[2\].*nothing was applied; give every part of "
           "the version once")
  _refused(receiver, [parts[0], parts[1], parts[1]], match="repeated")
  _refused(receiver, [], match="no parts given: pass every part of one version")
  index = parts_wire.read_index(plan, parts[1])
  body = next(e for e in index.entries if e.length)
  corrupt = bytearray(parts[1])
  corrupt[body.start + body.length // 2] ^= 0x10
  _refused(receiver, [parts[0], bytes(corrupt), parts[2]], match="body checksum")
  header = bytearray(parts[2])
  header[40] ^= 1  # inside the versions
  _refused(receiver, [parts[0], parts[1], bytes(header)], match="header checksum")
  _refused(receiver, [parts[0], parts[1], parts[2][:-3]], match="truncated|accounts")
  later = {k: strategies.perturb(rng, v, 0.05) for k, v in new.items()}
  other = split(plan, jsparse.Sender(plan, place(new, "fsdp8"), version=1)
                .send(place(later, "fsdp8")), 3)
  _refused(receiver, [parts[0], other[1], parts[2]], match="another version.*give the parts of "
           "one version only")
  overlapping = split(plan, parts_wire.encode_part(
      plan, dataclasses.replace(index.header, part=0, parts=1),
      [e.unit for e in index.entries] * 2,
      [parts_wire.read_unit(plan, index, parts[1], i) for i in range(len(index.entries))] * 2), 1)
  _refused(receiver, overlapping, match="cover")
  other_plan = jsparse.make_plan(place(new, "fsdp8"), rollout_dtype=jnp.bfloat16, capacity=0.2,
                                bucket_size=256)
  foreign = jsparse.Sender(other_plan, place(new, "fsdp8")).send(place(later, "fsdp8"))
  _refused(receiver, [foreign], match="another plan")
  out = receiver.receive(parts)  # the good parts still apply
  assert_trees_bitwise_equal(out, plan.cast(new))


def test_parts_of_a_stale_base_are_refused():
  base, plan, sender, receiver, _ = _setup("fsdp2", "single")
  first = sender.send(place(base, "fsdp2"))
  second = sender.send(place(base, "fsdp2"))
  _refused(receiver, [second], jsparse.VersionError)
  receiver.receive([first])
  with pytest.raises(jsparse.VersionError):
    receiver.receive([first])  # replayed
  receiver.receive([second])
  assert receiver.version == 2


def test_unit_positions_round_trip_and_overlap():
  """Blocks of a 2-D split leaf: segment <-> unit positions, and which process boxes need
  which blocks."""
  base, plan, _, _, _ = _setup("fsdp2xtp2", "single")
  s = next(i for i, seg in enumerate(plan.segments) if seg.blocks == 4)
  leaf = plan.leaves[plan.segments[s].leaf_ids[0]]
  unit = Unit(s, (1, 2))
  boxes = [block_box(leaf.layout, leaf.shape, b) for b in unit.blocks]
  positions = np.sort(np.concatenate([np.ravel_multi_index(
      np.meshgrid(*[np.arange(lo, hi) for lo, hi in box], indexing="ij"), leaf.shape).ravel()
      for box in boxes]))
  local = to_unit_positions(plan, unit, positions)
  assert sorted(local.tolist()) == list(range(len(positions)))
  assert np.array_equal(np.sort(to_segment_positions(plan, unit, local)), positions)
  no_boxes = [[] for _ in plan.leaves]
  holding_block_0 = list(no_boxes)
  holding_block_0[plan.segments[s].leaf_ids[0]] = [block_box(leaf.layout, leaf.shape, 0)]
  assert not needs_unit(plan, unit, no_boxes)
  assert not needs_unit(plan, unit, holding_block_0)
  assert needs_unit(plan, Unit(s, (0,)), holding_block_0)
