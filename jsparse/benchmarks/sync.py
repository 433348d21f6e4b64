"""Sync benchmark: jsparse against what a user would pick instead, on one realistic update.

Every method moves the trainer's update to a bf16 rollout copy, from device arrays on one side
to updated device arrays on the other:

- dense bf16: cast, copy to the host, send every byte, copy back.
- int32 index + bf16 value: the published SparseRL-Sync raw format, built as its proof of
  concept does (compare, ``nonzero``, gather), applied with a scatter.
- XOR + zstd: XOR of old and new bits over every array, zstd-compressed, XORed back in.
- jsparse, one row per coding (``ranked``, ``positioned``, ``packed``): :class:`jsparse.Sender`
  and :class:`jsparse.Receiver`, including their version, digest and checksum checks.

*encode* is device arrays to bytes on the trainer, *apply* bytes to updated device arrays on the
rollout (each the best of ``repeats``). End-to-end time at a link bandwidth is encode + bytes /
bandwidth + apply.

>>> import jax.numpy as jnp, jsparse
>>> states = [{'w': jnp.linspace(-1, 1, 4096)}, {'w': jnp.linspace(-1, 1, 4096).at[::64].add(1)}]
>>> plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16)
>>> rows = compare_methods(plan, states[0], states[1], repeats=1)
>>> sorted(rows) == sorted(METHODS) and rows['dense bf16']['bytes'] == 8192
True
"""

from __future__ import annotations

import functools
import time
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import zstandard

import jsparse
from jsparse import Coding
from jsparse.benchmarks._internals import (Format, Kind, PackedRecord, PartHeader, StagedRecords,
                                           apply_program, bits_lib, changes_of_units,
                                           chunks_of, diff_program, encode_part, layouts_of,
                                           owned_units, packed_units, part_records, programs,
                                           read_index, read_parts, read_unit, sparse_inputs)

LINKS_GBIT = (0.1, 1, 10, 100)
DENSE, RAW, XOR = ("dense bf16", "int32 index + bf16 value (SparseRL-Sync raw)", "XOR + zstd")
RANKED, POSITIONED, PACKED = (f"jsparse {c.value}" for c in (Coding.RANKED, Coding.POSITIONED,
                                                             Coding.PACKED))
METHODS = (DENSE, RAW, XOR, RANKED, POSITIONED, PACKED)
# The jsparse methods' codings.
CODINGS = {RANKED: Coding.RANKED, POSITIONED: Coding.POSITIONED, PACKED: Coding.PACKED}


def _best(fn: Callable, setup: Callable[[], tuple] = tuple, repeats: int = 5) -> float:
  """Best wall time of ``fn(*setup())`` (setup not timed; a warm-up call first, and the slot
  levels it asked for compiled before timing)."""
  jax.block_until_ready(fn(*setup()))
  programs.wait_for_slot_levels()
  best = float("inf")
  for _ in range(repeats):
    args = setup()
    jax.block_until_ready(args)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _temp(jitted: Callable, *args) -> int:
  return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _copy(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


def _leaf_bits(plan: jsparse.Plan, tree: Any) -> list[jax.Array]:
  return [bits_lib.to_bits(x.astype(l.rollout_dtype))
          for x, l in zip(jax.tree.leaves(tree), plan.leaves)]


def _dense(plan, before, after, repeats):
  cast = jax.jit(plan.cast)

  def encode(params):
    return b"".join(np.ascontiguousarray(x).tobytes()
                    for x in jax.device_get(jax.tree.leaves(cast(params))))

  def apply(data):
    out, at = [], 0
    for leaf in plan.leaves:
      n = leaf.size * leaf.rollout_dtype.itemsize
      out.append(jax.device_put(np.frombuffer(data, leaf.rollout_dtype, leaf.size, at)
                                .reshape(leaf.shape)))
      at += n
    return out

  data = encode(after)
  return {"bytes": len(data), "encode": _best(encode, lambda: (after,), repeats),
          "apply": _best(apply, lambda: (data,), repeats), "temp": _temp(cast, after)}


def _raw_int32(plan, before, after, repeats):
  capacities = [max(1, int(0.05 * l.size)) for l in plan.leaves]

  @jax.jit
  def diff(base, new):
    out = []
    for b, n, leaf, k in zip(_leaf_bits(plan, base), _leaf_bits(plan, new), plan.leaves,
                             capacities):
      mask = b.reshape(-1) != n.reshape(-1)
      (idx,) = jnp.nonzero(mask, size=k, fill_value=leaf.size)
      out.append((idx, n.reshape(-1)[jnp.minimum(idx, leaf.size - 1)], jnp.sum(mask)))
    return out

  @functools.partial(jax.jit, donate_argnums=0)
  def scatter(rollout, entries):
    return [bits_lib.scatter_bits(x.reshape(-1), i, v).reshape(x.shape)
            for x, (i, v) in zip(rollout, entries)]

  def encode(snapshot, params):
    parts = []
    for idx, vals, count in jax.device_get(diff(snapshot, params)):
      count = min(int(count), len(idx))  # (the PoC has no overflow fallback)
      parts += [np.int32(count).tobytes(), idx[:count].astype("<i4").tobytes(),
                vals[:count].tobytes()]
    return b"".join(parts)

  def apply(rollout, data):
    entries, at = [], 0
    for leaf, k in zip(plan.leaves, capacities):
      count = int(np.frombuffer(data, "<i4", 1, at)[0])
      width = bits_lib.bit_dtype(leaf.rollout_dtype)
      idx = np.full(k, leaf.size, np.int32)
      vals = np.zeros(k, width)
      idx[:count] = np.frombuffer(data, "<i4", count, at + 4)
      vals[:count] = np.frombuffer(data, width, count, at + 4 + 4 * count)
      entries.append((idx, vals))
      at += 4 + count * (4 + width.itemsize)
    return scatter(rollout, entries)

  snapshot = plan.cast(before)
  data = encode(snapshot, after)
  rollout = lambda: (jax.tree.leaves(_copy(snapshot)), data)
  entries = [(np.zeros(k, np.int32), np.zeros(k, bits_lib.bit_dtype(l.rollout_dtype)))
             for l, k in zip(plan.leaves, capacities)]
  return {"bytes": len(data), "encode": _best(encode, lambda: (snapshot, after), repeats),
          "apply": _best(apply, rollout, repeats),
          "temp": _temp(diff, snapshot, after) + _temp(scatter, rollout()[0], entries)}


def _xor_zstd(plan, before, after, repeats):
  xor = jax.jit(lambda base, new: [b ^ n for b, n in zip(_leaf_bits(plan, base),
                                                         _leaf_bits(plan, new))])

  @functools.partial(jax.jit, donate_argnums=0)
  def merge(rollout, xors):
    return [bits_lib.from_bits(bits_lib.to_bits(r) ^ x, r.dtype) for r, x in zip(rollout, xors)]

  def encode(snapshot, params):
    raw = b"".join(np.ascontiguousarray(x).tobytes() for x in jax.device_get(xor(snapshot,
                                                                                params)))
    return zstandard.ZstdCompressor(level=3).compress(raw)

  def apply(rollout, data):
    raw, xors, at = zstandard.ZstdDecompressor().decompress(data), [], 0
    for leaf in plan.leaves:
      width = bits_lib.bit_dtype(leaf.rollout_dtype)
      xors.append(jax.device_put(np.frombuffer(raw, width, leaf.size, at).reshape(leaf.shape)))
      at += leaf.size * width.itemsize
    return merge(rollout, xors)

  snapshot = plan.cast(before)
  data = encode(snapshot, after)
  rollout = lambda: (jax.tree.leaves(_copy(snapshot)), data)
  return {"bytes": len(data), "encode": _best(encode, lambda: (snapshot, after), repeats),
          "apply": _best(apply, rollout, repeats),
          "temp": _temp(xor, snapshot, after) + _temp(merge, rollout()[0], xor(snapshot, after))}


def _jsparse(plan, before, after, repeats, coding):
  snapshot = plan.cast(before)
  fresh_sender = lambda: (jsparse.Sender(plan, before, coding=coding),)
  fresh_receiver = lambda: (jsparse.Receiver(plan, _copy(snapshot)),)
  data = fresh_sender()[0].send(after)
  row = {"bytes": len(data),
         "encode": _best(lambda s: s.send(after), fresh_sender, repeats),
         "apply": _best(lambda r: r.receive(data), fresh_receiver, repeats)}
  row.update(stage_times(plan, coding, snapshot, after, data, repeats))
  if coding.format == Format.PACKED:
    row["bytes_floor"] = bytes_floor(len(data), repeats)
  rollout = jax.tree.leaves(snapshot)
  inputs = sparse_inputs(plan, read_parts(plan, [data], rollout))
  layouts = layouts_of(plan, rollout)
  row["temp"] = _chunk_temps(plan, coding, layouts, rollout, jax.tree.leaves(after), inputs)
  return row


def sender_device_stage(plan: jsparse.Plan, coding: Coding, snapshot: list, new: list
                        ) -> programs.DeviceChanges:
  """The sender's device stage of a sync of ``snapshot`` (donated) to ``new``: its changes
  (the digest it updates is not this benchmark's: it starts from zeros)."""
  return programs.sender_changes(plan, coding, snapshot, new,
                                 base_digest=np.zeros(2, np.uint32))[0]


def receiver_device_stage(plan: jsparse.Plan, layouts: tuple, inputs: programs.ReceiverInputs,
                          flat: list) -> tuple:
  """The receiver's device stage of a delta's ``inputs`` into ``flat`` (donated; no dense
  records): its leaves and digest (updated from a digest of zeros, as a receiver updates
  its own)."""
  return programs.apply_inputs(plan, layouts, flat, inputs, donate=True,
                               base=(flat, np.zeros(2, np.uint32)))


def _one_part(plan: jsparse.Plan, coding: Coding, changes: programs.DeviceChanges,
              rollout: list, units: tuple) -> bytes:
  """The part of a delta of ``changes`` over ``units`` (the sender's host stage)."""
  head = PartHeader(coding.parts.format, Kind.DELTA, coding.ranked, 0, 1, bytes(8), bytes(8),
                    0, 1)
  return encode_part(plan, head, units, part_records(plan, coding.parts, units, changes,
                                                     rollout, False))


def _unpack_units(plan: jsparse.Plan, rollout: list, data: bytes) -> list:
  """A packed part's units unpacked and checked on the receiver's devices (their streams
  copied there included), from records decoded beforehand."""
  index = read_index(plan, data)
  records = [(e.unit, read_unit(plan, index, data, i)) for i, e in enumerate(index.entries)]
  staged = StagedRecords(plan, rollout)
  return jax.block_until_ready([packed_units.stage_unit(plan, unit, record, staged)
                                for unit, record in records if isinstance(record, PackedRecord)])


def stage_times(plan: jsparse.Plan, coding: Coding, snapshot: Any, after: Any, data: bytes,
                repeats: int = 5) -> dict:
  """Seconds of a sync's stages (best of ``repeats``): the sender's device stage (``diff``),
  its host stage (``host_encode``: the part's records and bytes from the diff's outputs), the
  receiver's host stage (``host_decode``: the part read, its records staged on the device), its
  device stage (``device_apply``). ``data``: the part of this update. The packed coding's device
  passes are two more: the sender's packing (``device_pack``, which ``host_encode`` then does
  not count), the receiver's unpacking and checks (``device_unpack``, likewise out of
  ``host_decode``); each host stage is then at least half the :func:`bytes_floor` of ``data``."""
  flat = jax.tree.leaves(after)
  rollout = jax.tree.leaves(snapshot)
  fresh_snapshot = lambda: (jax.tree.leaves(_copy(snapshot)), flat)
  device_stage = functools.partial(sender_device_stage, plan, coding)
  changes = device_stage(*fresh_snapshot())
  units = owned_units(plan, rollout, 0)
  row = {"diff": _best(device_stage, fresh_snapshot, repeats)}
  encode = functools.partial(_one_part, plan, coding, changes, rollout, units)
  read = lambda: read_parts(plan, [data], rollout)
  row["host_encode"], row["host_decode"] = _best(encode, repeats=repeats), _best(read,
                                                                                  repeats=repeats)
  if coding.format == Format.PACKED:  # the device passes apart from the host's
    counts = changes_of_units(plan, units, changes)
    row["device_pack"] = _best(lambda: jax.block_until_ready(
        [x.outputs for x in packed_units.launch(plan, coding.ranked, units, counts, changes)
         if x is not None]), repeats=repeats)
    row["device_unpack"] = _best(functools.partial(_unpack_units, plan, rollout, data),
                                 repeats=repeats)
    # Differences of two separately timed minima: where the device passes dominate (a CPU, a
    # program built at -O0) noise can take them to or below zero; no host stage moves its
    # half of the payload faster than the bytes floor's half.
    half_floor = bytes_floor(len(data), repeats) / 2
    row["host_encode"] = max(half_floor, row["host_encode"] - row["device_pack"])
    row["host_decode"] = max(half_floor, row["host_decode"] - row["device_unpack"])
  inputs = sparse_inputs(plan, read())
  layouts = layouts_of(plan, rollout)
  device_apply = functools.partial(receiver_device_stage, plan, layouts, inputs)
  row["device_apply"] = _best(device_apply, lambda: (jax.tree.leaves(_copy(snapshot)),), repeats)
  return row


def bytes_floor(size: int, repeats: int = 5) -> float:
  """Seconds to move ``size`` bytes as a sync's host must at least: from the device to the
  host, their CRC32, and back onto a device (best of ``repeats``)."""
  on_device = jnp.asarray(np.arange(size, dtype=np.uint32).astype(np.uint8))

  def move():
    host = np.asarray(on_device)
    zlib.crc32(host)
    return jax.device_put(host)
  return _best(move, repeats=repeats)


def _chunk_temps(plan, coding, layouts, snapshot: list, new: list, inputs) -> int:
  """Compiled temporary bytes of the sender's diff plus the receiver's apply, for the largest
  chunk (the programs run chunk by chunk)."""
  temps = []
  for c in chunks_of(plan):
    chunk_layouts, old = tuple(c.leaves(layouts)), c.leaves(snapshot)
    keys = c.segments(inputs.keys)
    indices = keys
    ranked = c.segments(inputs.ranked)
    if any(ranked):
      indices = programs.positions_program(c.plan, chunk_layouts, ranked, old,
                                           keys, inputs.counts[list(c.segment_ids)])
    temps.append(_temp(programs.diff_program, c.plan, coding.ranked, old, c.leaves(new),
                       c.leaf_id_array)
                 + _temp(programs.apply_program(True), c.plan, chunk_layouts, old, indices,
                         c.segments(inputs.values), c.leaf_id_array))
  return max(temps, default=0)


def compare_methods(plan: jsparse.Plan, before: Any, after: Any, repeats: int = 5,
                    methods: Sequence[str] = METHODS) -> dict:
  """Per method (of :data:`METHODS`): ``bytes``, ``encode`` and ``apply`` seconds, compiled
  ``temp`` bytes."""
  runs = {
      DENSE: _dense,
      RAW: _raw_int32,
      XOR: _xor_zstd,
      **{name: functools.partial(_jsparse, coding=coding) for name, coding in CODINGS.items()},
  }
  return {name: runs[name](plan, before, after, repeats) for name in methods}


def per_step_sizes(plan: jsparse.Plan, states: list) -> list[dict]:
  """Density and payload size (the default coding) of every step of a run, synced step by
  step."""
  sender = jsparse.Sender(plan, states[0])
  rows = []
  for params in states[1:]:
    size = len(sender.send(params))
    changed = sender.last_stats.changed
    rows.append({"density": changed / plan.num_elements, "changed": changed, "bytes": size})
  return rows


def print_report(plan: jsparse.Plan, steps: list[dict], rows: dict, step: int) -> None:
  changed = steps[step - 1]["changed"]
  dense = plan.rollout_bytes
  print("per step (jsparse, default coding):  " + "  ".join(
      f"{i + 1}: {r['density']:.2%} {r['bytes'] / r['changed']:.2f} B/chg"
      for i, r in enumerate(steps)))
  print(f"\nstep {step}: {changed:,} of {plan.num_elements:,} bf16 elements changed "
        f"({changed / plan.num_elements:.3%}); dense = {dense:,} B\n")
  links = "".join(f"{f'{g:g}G e2e ms':>13}" for g in LINKS_GBIT)
  print(f"{'method':<46}{'bytes':>11}{'B/chg':>7}{'vs dense':>9}{'enc ms':>8}{'apply ms':>9}"
        f"{'temp MB':>8}{links}")
  for name, r in rows.items():
    e2e = [r["encode"] + r["bytes"] * 8 / (g * 1e9) + r["apply"] for g in LINKS_GBIT]
    r["e2e"] = dict(zip(LINKS_GBIT, e2e))
    print(f"{name:<46}{r['bytes']:>11,}{r['bytes'] / changed:>7.2f}{dense / r['bytes']:>8.1f}x"
          f"{1e3 * r['encode']:>8.1f}{1e3 * r['apply']:>9.1f}{r['temp'] / 2**20:>8.1f}"
          + "".join(f"{1e3 * t:>13.1f}" for t in e2e))
  base = rows[DENSE]["e2e"]
  print(f"\nend-to-end speedup over dense bf16 at {', '.join(f'{g:g}' for g in LINKS_GBIT)} "
        "Gbit/s:")
  for name, r in rows.items():
    print(f"  {name:<44}" + "  ".join(f"{base[g] / r['e2e'][g]:>6.1f}x" for g in LINKS_GBIT))
  print("\njsparse parts (ms): jitted diff step (+ pack) | host encode | host decode | "
        "(unpack +) jitted apply")
  for name in (m for m in CODINGS if m in rows):
    r = rows[name]
    pack = f" +{1e3 * r['device_pack']:>5.1f}" if "device_pack" in r else " " * 7
    unpack = f"{1e3 * r['device_unpack']:>5.1f} + " if "device_unpack" in r else " " * 8
    print(f"  {name:<44}{1e3 * r['diff']:>7.1f}{pack} |{1e3 * r['host_encode']:>7.1f} |"
          f"{1e3 * r['host_decode']:>7.1f} |{unpack}{1e3 * r['device_apply']:>5.1f}")


def _floor(plan, base, new):
  """The streaming floor: cast, bitcast, compare and count every leaf, nothing else."""
  total = jnp.int32(0)
  for b, n in zip(_leaf_bits(plan, base), _leaf_bits(plan, new)):
    total += jnp.sum(b != n, dtype=jnp.int32)
  return total


def _floor_programs(plan: jsparse.Plan) -> tuple[Callable, Callable]:
  """The floors the device passes are held against: a jitted compare-and-count of the old bf16
  tree and the new params (``(plan, snapshot, params)``), and a jitted dense cast and copy of
  the params (``(params,)``)."""
  return (jax.jit(_floor, static_argnums=0),
          jax.jit(lambda p: jax.tree.map(lambda x: x + 0, plan.cast(p))))


def floor_times(plan: jsparse.Plan, snapshot: Any, after: Any, repeats: int = 5) -> dict:
  """Seconds of the two floors (:func:`_floor_programs`) on this update, best of ``repeats``."""
  floor, dense_copy = _floor_programs(plan)
  return {"compare-and-count": _best(floor, lambda: (plan, snapshot, after), repeats),
          "dense copy": _best(dense_copy, lambda: (after,), repeats)}


def core_budgets(plan: jsparse.Plan, before: Any, after: Any, repeats: int = 5) -> dict:
  """The design budgets of the pure core: diff against the compare-and-count floor, donated
  apply against a dense copy, and their compiled temporary memory."""
  snapshot = plan.cast(before)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(after))
  floor, dense_copy = _floor_programs(plan)
  delta = jsparse.diff(plan, snapshot, after)
  layouts = layouts_of(plan, jax.tree.leaves(snapshot))
  apply = functools.partial(jsparse.apply, plan, donate=True)
  rows = {
      "compare-and-count (floor)": (_best(floor, lambda: (plan, snapshot, after), repeats),
                                    _temp(floor, plan, snapshot, after)),
      "jsparse.diff": (_best(jsparse.diff, lambda: (plan, snapshot, after), repeats),
                       _temp(diff_program, plan, snapshot, after)),
      "dense bf16 copy": (_best(dense_copy, lambda: (after,), repeats),
                          _temp(dense_copy, after)),
      "jsparse.apply (donated)": (_best(apply, lambda: (_copy(snapshot), delta), repeats),
                                  _temp(apply_program(True), plan, layouts, snapshot, delta)),
  }
  print(f"\n{'pure core, jitted':<30}{'ms':>8}{'temp / fp32 params':>20}")
  for name, (seconds, temp) in rows.items():
    print(f"{name:<30}{1e3 * seconds:>8.1f}{temp / param_bytes:>20.3f}")
  floor_s, dense_s = rows["compare-and-count (floor)"][0], rows["dense bf16 copy"][0]
  print(f"diff = {rows['jsparse.diff'][0] / floor_s:.2f}x the floor; donated apply = "
        f"{rows['jsparse.apply (donated)'][0] / dense_s:.2f}x a dense copy")
  return rows


def one_percent_step(steps: list[dict]) -> int:
  """The step (1-based) whose density is closest to 1%: the one the reports dwell on."""
  return min(range(1, len(steps) + 1), key=lambda i: abs(steps[i - 1]["density"] - 0.01))


QUICK_METHODS = (DENSE, RAW, *CODINGS)  # every coding: auto is held against them


def run(plan: jsparse.Plan, states: list, repeats: int = 5,
        methods: Sequence[str] = METHODS) -> dict:
  """The sync tables of a run's step nearest 1% (``methods``: which of :data:`METHODS`; the
  ranked one is always among them, as the estimate needs it)."""
  methods = tuple(dict.fromkeys((*methods, RANKED)))
  steps = per_step_sizes(plan, states)
  step = one_percent_step(steps)
  rows = compare_methods(plan, states[step - 1], states[step], repeats, methods)
  print_report(plan, steps, rows, step)
  core = core_budgets(plan, states[step - 1], states[step], repeats)
  for name in CODINGS:
    if name in rows:
      print_device_ratios(name, rows[name], core)
  auto = auto_against_fixed(plan, states[step - 1], states[step], rows, repeats)
  print_auto(auto)
  return {"steps": steps, "step": step, "methods": rows, "core": core, "auto": auto}


def auto_against_fixed(plan: jsparse.Plan, before: Any, after: Any, rows: dict,
                       repeats: int = 5) -> dict:
  """Per link bandwidth of :data:`LINKS_GBIT`: a ``coding="auto"`` Sender's choice for this
  update and its end-to-end seconds (encode + bytes / bandwidth + apply), against the fastest
  of the fixed jsparse codings among ``rows`` at that bandwidth, timed again next to it."""
  snapshot = plan.cast(before)
  fresh_receiver = lambda: (jsparse.Receiver(plan, _copy(snapshot)),)

  def e2e(coding: Coding, gbit: float) -> tuple[float, int, str]:
    fresh_sender = lambda: (jsparse.Sender(plan, before, coding=coding, link_gbit=gbit),)
    sender = fresh_sender()[0]
    data = sender.send(after)
    seconds = (_best(lambda s: s.send(after), fresh_sender, repeats) + len(data) * 8 / (gbit * 1e9)
               + _best(lambda r: r.receive(data), fresh_receiver, repeats))
    return seconds, len(data), sender.last_stats.coding

  out = {}
  for gbit in LINKS_GBIT:
    fixed = {name: r["encode"] + r["bytes"] * 8 / (gbit * 1e9) + r["apply"]
             for name, r in rows.items() if name in CODINGS}
    best = min(fixed, key=fixed.get)
    runs = [(e2e(Coding.AUTO, gbit), e2e(CODINGS[best], gbit)) for _ in range(2)]  # alternated
    (seconds, size, chosen), fixed_seconds = min(r[0] for r in runs), min(r[1][0] for r in runs)
    out[gbit] = {"chosen": chosen, "bytes": size, "e2e": seconds, "best_fixed": best,
                 "best_fixed_e2e": fixed_seconds}
  return out


def print_auto(rows: dict) -> None:
  print("\ncoding=\"auto\" against the fastest fixed coding of this run, timed side by side "
        "(end-to-end ms):")
  for gbit, r in rows.items():
    print(f"  {gbit:>5g} Gbit/s: auto chose {r['chosen']:<18}{1e3 * r['e2e']:>9.1f}  |  "
          f"fastest fixed: {r['best_fixed']:<30}{1e3 * r['best_fixed_e2e']:>9.1f}  "
          f"({r['e2e'] / r['best_fixed_e2e']:.2f}x)")


def print_device_ratios(name: str, compact: dict, core: dict) -> None:
  """The sync's device passes against their floors, measured in this run: the sender's device
  stage (diff, next snapshot, digest, ranks) against a jitted compare-and-count of the same
  trees, the receiver's (positions, apply, digest) against a jitted dense cast and copy."""
  floor, dense = core["compare-and-count (floor)"][0], core["dense bf16 copy"][0]
  send, receive = device_passes(compact)
  print(f"device passes ({name}): send {1e3 * send:.1f} ms = {send / floor:.2f}x "
        f"compare-and-count; receive {1e3 * receive:.1f} ms = {receive / dense:.2f}x a dense "
        "cast and copy")
  if "bytes_floor" in compact:
    host = compact["host_encode"] + compact["host_decode"]
    print(f"host stages ({name}): {1e3 * host:.1f} ms = {host / compact['bytes_floor']:.2f}x "
          f"moving and checksumming its bytes ({1e3 * compact['bytes_floor']:.1f} ms)")


def device_passes(row: dict) -> tuple[float, float]:
  """Seconds of a jsparse row's device passes: (sender's, receiver's)."""
  return (row["diff"] + row.get("device_pack", 0.0),
          row.get("device_unpack", 0.0) + row["device_apply"])
