"""Scale benchmark: set-up time against the number of leaves, and time per parameter against
model size.

The trees are layered like an unscanned transformer: per layer four ``(w, w)`` attention
matrices, an up and a down projection ``(w, 4w)`` and ``(4w, w)``, and two norm scales ``(w,)``
(8 leaves per layer), pretrained-like values (normal, std 0.02), fp32 masters and a bf16 rollout.
An update is one step of sign-like AdamW updates at lr 1e-6, as RL post-training makes them
(~1% of the bf16 elements change).

- :func:`compile_times`: ``Sender()``, the first ``send``, ``Receiver()`` and the first
  ``receive`` in a fresh process per leaf count (every compilation included), against a plain
  jitted per-leaf op over the same tree (the bf16 cast a dense sync does); then the steady
  ``send`` and ``receive`` per parameter, to hold against :func:`scaling`'s trees of few,
  large leaves.
- :func:`scaling`: per model size, in a fresh process each, the steady ``send`` and ``receive``
  times per parameter and the process's peak resident memory against the bytes it must hold
  (fp32 params, the sender's bf16 snapshot, the receiver's bf16 params); then the sync's four
  stages and the device stages against their floors at that size.

>>> rows = compile_times([16], width=32)
>>> sorted(rows[16])
['first receive', 'first send', 'params', 'plain jit', 'receive', 'receiver', 'send', 'sender']
"""

from __future__ import annotations

import functools
import resource
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from jsparse import Coding
from jsparse.benchmarks import sync
from jsparse.benchmarks._internals import parts_reader, programs, sender_snapshot
from jsparse.benchmarks.fresh import in_fresh_process

LEAVES_PER_LAYER = 8


def layered_tree(leaves: int, width: int, seed: int = 0) -> dict:
  """A tree of ``leaves`` fp32 leaves (8 per layer, see the module docstring)."""
  rng = np.random.default_rng(seed)
  shapes = {"attn_q": (width, width), "attn_k": (width, width), "attn_v": (width, width),
            "attn_o": (width, width), "mlp_up": (width, 4 * width), "mlp_down": (4 * width, width),
            "norm_attn": (width,), "norm_mlp": (width,)}
  tree: dict = {}
  for i in range(leaves):
    name, shape = list(shapes.items())[i % LEAVES_PER_LAYER]
    value = (1.0 + 0.1 * rng.standard_normal(shape) if name.startswith("norm")
             else 0.02 * rng.standard_normal(shape))
    tree.setdefault(f"layer{i // LEAVES_PER_LAYER:05d}", {})[name] = jnp.asarray(value,
                                                                                 jnp.float32)
  return tree


def tree_of_size(params: int, width: int, seed: int = 0) -> dict:
  """A :func:`layered_tree` of whole layers of ``width``, about ``params`` parameters (at least
  one layer)."""
  layers = max(1, round(params / (12 * width * width + 2 * width)))
  return layered_tree(layers * LEAVES_PER_LAYER, width, seed)


def rl_like_update(params, seed: int, xp=np):
  """One sign-like AdamW step at lr 1e-6 on every leaf: the sign of each element's update is a
  hash of its position, the leaf and ``seed``. ``xp``: ``numpy`` on the host (nothing to
  compile, whatever the leaf count) or ``jax.numpy`` under ``jit`` (``seed`` static); the two
  give the same bits."""
  leaves, treedef = jax.tree.flatten(params)
  out = []
  for i, x in enumerate(leaves):
    x = xp.asarray(x)
    key = xp.uint32((seed + i * 0x85EBCA77) & 0xFFFFFFFF)
    h = ((xp.arange(x.size, dtype=xp.uint32) * xp.uint32(0x9E3779B1)) ^ key) * xp.uint32(
        0xC2B2AE3D)
    sign = xp.where((h >> 15) & 1 == 1, 1.0, -1.0).astype(x.dtype)
    out.append(x - xp.float32(1e-6) * sign.reshape(x.shape))
  return jax.tree.unflatten(treedef, out)


def _timed(fn):
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def _compile_point(n: int, width: int, steps: int = 2) -> dict:
  """One leaf count, in this process: see :func:`compile_times`."""
  before = layered_tree(n, width)
  after = jax.tree.map(jnp.asarray, rl_like_update(before, n))
  plan = jsparse.make_plan(before, rollout_dtype=jnp.bfloat16)
  row = {"params": plan.num_elements}
  _, row["plain jit"] = _timed(lambda: jax.jit(plan.cast)(before))
  rollout = jax.block_until_ready(plan.cast(before))
  sender, row["sender"] = _timed(lambda: jsparse.Sender(plan, before))
  data, row["first send"] = _timed(lambda: sender.send(after))
  receiver, row["receiver"] = _timed(lambda: jsparse.Receiver(plan, rollout))
  _, row["first receive"] = _timed(lambda: receiver.receive(data))
  programs.wait_for_slot_levels()  # steady steps: the slot levels they need are compiled
  row["send"] = row["receive"] = float("inf")
  device = jax.devices()[0]
  for k in range(steps):  # steady steps: updates made on the host (jitting one over 10,000
    # leaves compiles for minutes), committed to the device as a train step's outputs are
    after = jax.block_until_ready(jax.device_put(rl_like_update(after, n + 1 + k), device))
    data, seconds = _timed(lambda: sender.send(after))
    row["send"] = min(row["send"], seconds)
    _, seconds = _timed(lambda: receiver.receive(data))
    row["receive"] = min(row["receive"], seconds)
  return row


def compile_times(leaf_counts: Sequence[int], width: int = 128) -> dict:
  """Per leaf count, in a fresh process each (no compilation cached): seconds of each set-up
  step, compilations included, see the module docstring."""
  return {n: _in_subprocess(f"_compile_point({int(n)}, {int(width)})") for n in leaf_counts}


def _in_subprocess(call: str) -> dict:
  return in_fresh_process("jsparse.benchmarks.scale", call)


def print_compile_times(rows: dict) -> None:
  print("set-up seconds (compilations included) against the number of leaves; x = the four "
        "set-up steps over a plain jitted per-leaf op")
  print("  then the steady send and receive, ns per parameter (compare the scaling table's "
        "few large leaves)")
  print(f"{'leaves':>7} {'plain jit':>9} {'Sender()':>9} {'1st send':>9} {'Receiver()':>10} "
        f"{'1st recv':>9} {'x':>6} {'params':>12} {'send ns/p':>9} {'recv ns/p':>9}")
  for n, row in rows.items():
    setup = row["sender"] + row["first send"] + row["receiver"] + row["first receive"]
    print(f"{n:>7} {row['plain jit']:>9.2f} {row['sender']:>9.2f} {row['first send']:>9.2f} "
          f"{row['receiver']:>10.2f} {row['first receive']:>9.2f} "
          f"{setup / row['plain jit']:>6.1f} {row['params']:>12,} "
          f"{row['send'] / row['params'] * 1e9:>9.2f} "
          f"{row['receive'] / row['params'] * 1e9:>9.2f}")


def peak_rss() -> int:
  """This process's peak resident memory in bytes: Linux's ``VmHWM``, which starts afresh at
  ``exec`` (``ru_maxrss``, the fallback elsewhere, carries over the parent's peak into a child
  started by fork and exec).

  >>> peak_rss() > 0
  True
  """
  try:
    with open("/proc/self/status") as status:
      for line in status:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _scaling_point(params_target: int, width: int, steps: int = 3, stages: bool = False) -> dict:
  """One model size, in this process: see :func:`scaling`."""
  params = tree_of_size(params_target, width)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  step = jax.jit(functools.partial(rl_like_update, xp=jnp), static_argnums=1,
                 donate_argnums=0)
  sends, receives = [], []
  for k in range(steps):
    params = jax.block_until_ready(step(params, k))
    data, seconds = _timed(lambda: sender.send(params))
    sends.append(seconds)
    _, seconds = _timed(lambda: receiver.receive(data))
    receives.append(seconds)
    programs.wait_for_slot_levels()  # the first step's: not timed in the steady minimum
  n = plan.num_elements
  held = n * 4 + 2 * plan.rollout_bytes
  row = {"params": n, "leaves": len(plan.leaves), "density": sender.last_stats.density,
         "bytes": len(data), "send": min(sends[1:]), "receive": min(receives[1:]),
         "peak_rss": peak_rss(), "held": held}
  if stages:  # one more step, after the peak is read: the timings hold copies of the snapshot
    del receiver
    snapshot = plan.cast(params)
    params = jax.block_until_ready(step(params, steps))
    data = sender.send(params)
    row["stages"] = sync.stage_times(plan, Coding.POSITIONED, snapshot, params, data, repeats=2)
    row["floors"] = sync.floor_times(plan, snapshot, params, repeats=2)
  return row


def scaling(params_targets: Sequence[int] = (25_000_000, 100_000_000, 250_000_000,
                                               1_000_000_000), width: int = 1024,
            stages: bool = False) -> list:
  """Per target size (layers of ``width``), a fresh process's steady send and receive times and
  peak memory (:func:`_scaling_point`); ``stages``: also each of the four stages' seconds
  (:func:`jsparse.benchmarks.sync.stage_times`) and the two floors the device stages are held
  against (:func:`jsparse.benchmarks.sync.floor_times`), timed after the peak is read."""
  return [_in_subprocess(f"_scaling_point({int(target)}, {int(width)}, stages={bool(stages)})")
          for target in params_targets]


def print_scaling(rows: list) -> None:
  print("steady sync time per parameter and peak memory against model size (a fresh process "
        "per size)")
  print(f"{'params':>13} {'leaves':>6} {'density':>8} {'bytes':>11} {'send ms':>8} "
        f"{'recv ms':>8} {'ns/param':>8} {'peak RSS GB':>11} {'held GB':>8} {'RSS/held':>8}")
  for r in rows:
    per = (r["send"] + r["receive"]) / r["params"] * 1e9
    print(f"{r['params']:>13,} {r['leaves']:>6} {r['density']:>8.2%} {r['bytes']:>11,} "
          f"{r['send'] * 1e3:>8.1f} {r['receive'] * 1e3:>8.1f} {per:>8.2f} "
          f"{r['peak_rss'] / 1e9:>11.2f} {r['held'] / 1e9:>8.2f} "
          f"{r['peak_rss'] / r['held']:>8.2f}")
  staged = [r for r in rows if "stages" in r]
  if staged:
    print("  stages, ns/param: send device | host encode | host decode | receive device; "
          "device stages against compare-and-count and a dense cast and copy")
    for r in staged:
      stages, floors = r["stages"], r["floors"]
      print(f"  {r['params']:>13,} " + " | ".join(
          f"{stages[k] / r['params'] * 1e9:.3f}" for k in
          ("diff", "host_encode", "host_decode", "device_apply"))
          + f"; send {stages['diff'] / floors['compare-and-count']:.2f}x, receive "
          f"{stages['device_apply'] / floors['dense copy']:.2f}x")


# The accelerator assumption of the estimate: HBM bandwidth an XLA streaming pass reaches (an
# H100 has 3.35 TB/s peak, a TPU v5p 2.76 TB/s; 2 TB/s is a sustained figure).
HBM_BYTES_PER_S = 2e12
HOST_THREADS = 8


def estimate(compact: dict, changed: int, device_ratio: float, density: float = 0.01,
             models: Sequence[int] = (7_000_000_000, 70_000_000_000),
             links_gbit: Sequence[float] = (10.0, 100.0),
             measured_per_param: tuple[float, float] | None = None) -> list:
  """Sync seconds per step for large models, sparse against dense, from this run's measured
  rates (``compact``: the format-2 row of the sync benchmark, whose step had ``changed``
  changes) and :data:`HBM_BYTES_PER_S`.

  Sparse: the device passes (diff on the trainer: fp32 read, bf16 read and write, 8 B per
  parameter; apply on the rollout: class tables and digest, 4 B per parameter), each times
  ``device_ratio`` (this run's send device part over compare-and-count), then host encode and
  decode at the measured changes per second on one core and on :data:`HOST_THREADS` cores
  (linear: an upper bound), then the payload over the link at the measured bytes per change.
  Dense: the bf16 cast (6 B per parameter) and 2 B per parameter over the link.
  ``measured_per_param``: seconds per parameter of the sparse device passes (both sides) and of
  the dense cast, as measured on an accelerator; they replace the assumed bandwidth.
  """
  per_change = {"encode": compact["host_encode"] / changed,
                "decode": compact["host_decode"] / changed, "bytes": compact["bytes"] / changed}
  rows = []
  for params in models:
    changes = density * params
    if measured_per_param is None:
      device = 12 * params / HBM_BYTES_PER_S * device_ratio
      dense_device = 6 * params / HBM_BYTES_PER_S
    else:
      device, dense_device = (params * t for t in measured_per_param)
    host = changes * (per_change["encode"] + per_change["decode"])
    for gbit in links_gbit:
      wire = changes * per_change["bytes"] * 8 / (gbit * 1e9)
      dense = dense_device + 2 * params * 8 / (gbit * 1e9)
      rows.append({"params": params, "link_gbit": gbit, "measured": measured_per_param
                   is not None, "payload_bytes": changes
                   * per_change["bytes"], "sparse_1": device + host + wire,
                   "sparse_n": device + host / HOST_THREADS + wire, "dense": dense})
  return rows


def large_step(params: int, seed: int = 0) -> tuple[jsparse.Plan, dict, dict]:
  """A layered tree of about ``params`` parameters (width 1024 from 50M on, else 128) before
  and after one RL-like step, and its plan (bf16 rollout, capacity 5%)."""
  before = tree_of_size(params, 1024 if params >= 50_000_000 else 128, seed)
  step = jax.jit(functools.partial(rl_like_update, xp=jnp), static_argnums=1)
  after = jax.block_until_ready(step(before, 1))
  return jsparse.make_plan(before, rollout_dtype=jnp.bfloat16, capacity=0.05), before, after


def packed_host_rate(params: int = 250_000_000, repeats: int = 3) -> dict:
  """The packed coding's host stages on a payload of megabytes, where the bytes outweigh the
  fixed costs of a sync: :func:`packed_host_rate_of` a :func:`large_step` of ``params``
  parameters."""
  return packed_host_rate_of(*large_step(params), repeats)


def packed_host_rate_of(plan: jsparse.Plan, before, after, repeats: int = 3) -> dict:
  """The packed coding's host stages on the update ``before`` -> ``after``: its payload's
  ``bytes``, ``host_encode`` and ``host_decode`` seconds (best of ``repeats``) and
  ``per_byte``, their sum per payload byte; ``bytes_floor``: seconds to move and checksum the
  payload's bytes (:func:`~jsparse.benchmarks.sync.bytes_floor`)."""
  sender = jsparse.Sender(plan, before, coding="packed")
  data = sender.send(after)
  stages = sync.stage_times(plan, Coding.PACKED, plan.cast(before), after, data, repeats)
  row = {"host_encode": stages["host_encode"], "host_decode": stages["host_decode"]}
  row.update(params=plan.num_elements, changed=sender.last_stats.changed, bytes=len(data),
             per_byte=(row["host_encode"] + row["host_decode"]) / len(data),
             bytes_floor=sync.bytes_floor(len(data), repeats))
  return row


def print_packed_host_rate(row: dict) -> None:
  print(f"packed coding's host stages on {row['params']:,} parameters, {row['changed']:,} "
        f"changes, {row['bytes']:,} B: encode {1e3 * row['host_encode']:.1f} ms, decode "
        f"{1e3 * row['host_decode']:.1f} ms = {row['per_byte'] * 1e9:.2f} ns per payload byte, "
        f"{row['per_byte'] * row['bytes'] / row['bytes_floor']:.2f}x moving and checksumming "
        f"its bytes ({1e3 * row['bytes_floor']:.1f} ms)")


ACCELERATORS = 64
HOSTS = 8


def packed_estimate(packed: dict, changed: int, floors: dict, density: float = 0.01,
                    models: Sequence[int] = (7_000_000_000, 70_000_000_000),
                    links_gbit: Sequence[float] = (10.0, 100.0),
                    per_param: tuple[float, float] | None = None,
                    host_per_byte: float | None = None, accelerators: int = ACCELERATORS,
                    hosts: int = HOSTS) -> list:
  """:func:`estimate` for the packed coding (``packed``: its row of the sync benchmark, whose
  step had ``changed`` changes), whose hosts only move bytes, on ``accelerators`` devices over
  ``hosts`` hosts per side (each holding its share of the model; one link of the given
  bandwidth carries every byte).

  - Device passes scale with the parameters each device holds. Seconds per parameter
    (sender's, receiver's): ``per_param`` as measured on an accelerator, else this run's
    ratios to the two floors (``floors``: ``compare-and-count`` and ``dense copy`` seconds)
    at :data:`HBM_BYTES_PER_S` (8 and 6 bytes per parameter).
  - Host stages scale with the payload bytes each host moves: ``host_per_byte`` seconds per
    byte (:func:`packed_host_rate`, on a payload of megabytes), else ``packed``'s own.
  - Dense bf16: the cast (6 bytes per parameter, on every device at once) and 2 bytes per
    parameter over the link.

  ``sparse_one_host``: the same with all host stages on one host per side.
  """
  if per_param is None:
    send = (packed["diff"] + packed.get("device_pack", 0.0)) / floors["compare-and-count"]
    receive = (packed.get("device_unpack", 0.0) + packed["device_apply"]) / floors["dense copy"]
    per_param = (8 * send / HBM_BYTES_PER_S, 6 * receive / HBM_BYTES_PER_S)
  if host_per_byte is None:
    host_per_byte = (packed["host_encode"] + packed["host_decode"]) / packed["bytes"]
  rows = []
  for params in models:
    payload = density * params * packed["bytes"] / changed
    device = params / accelerators * (per_param[0] + per_param[1])
    host = payload / hosts * host_per_byte
    for gbit in links_gbit:
      wire = payload * 8 / (gbit * 1e9)
      dense = 6 * params / accelerators / HBM_BYTES_PER_S + 2 * params * 8 / (gbit * 1e9)
      rows.append({"params": params, "link_gbit": gbit, "payload_bytes": payload,
                   "accelerators": accelerators, "hosts": hosts, "device": device,
                   "host": host, "wire": wire, "sparse": device + host + wire,
                   "sparse_one_host": device + host * hosts + wire, "dense": dense})
  return rows


def print_packed_estimate(rows: list) -> None:
  where = (f"{rows[0]['accelerators']} accelerators on {rows[0]['hosts']} hosts per side"
           if rows else "")
  print(f"estimate at 1% density, packed coding (device-coded: hosts move bytes), {where}")
  print(f"{'params':>6} {'link':>9} {'payload MB':>10} {'device s':>9} {'host s':>7} "
        f"{'wire s':>7} {'sparse s':>9} {'dense s':>8} {'dense/sparse':>12} "
        f"{'one host: sparse s':>18} {'dense/sparse':>12}")
  for r in rows:
    print(f"{r['params'] / 1e9:>5g}B {r['link_gbit']:>5g} Gb/s {r['payload_bytes'] / 1e6:>10.1f} "
          f"{r['device']:>9.3f} {r['host']:>7.3f} {r['wire']:>7.3f} {r['sparse']:>9.3f} "
          f"{r['dense']:>8.2f} {r['dense'] / r['sparse']:>11.1f}x "
          f"{r['sparse_one_host']:>18.3f} {r['dense'] / r['sparse_one_host']:>11.1f}x")


def print_estimate(rows: list) -> None:
  device = ("device passes as timed on this accelerator" if rows and rows[0]["measured"]
            else f"assumed {HBM_BYTES_PER_S / 1e12:g} TB/s HBM")
  print(f"estimate at 1% density ({device}; host coding "
        f"at this run's rates on 1 core and on {HOST_THREADS} (linear, an upper bound))")
  print(f"{'params':>6} {'link':>9} {'payload MB':>10} {'sparse 1 core s':>15} "
        f"{f'sparse {HOST_THREADS} cores s':>16} {'dense s':>8} {'dense/sparse':>12}")
  for r in rows:
    print(f"{r['params'] / 1e9:>5g}B {r['link_gbit']:>5g} Gb/s {r['payload_bytes'] / 1e6:>10.1f} "
          f"{r['sparse_1']:>15.2f} {r['sparse_n']:>16.2f} {r['dense']:>8.2f} "
          f"{r['dense'] / r['sparse_n']:>11.1f}x")


def coding_rates(plan: jsparse.Plan, before, after, chunk_bytes: int = 1 << 20,
                 threads: Sequence[int] = (1, 2), repeats: int = 3) -> dict:
  """Host coding of one streamed version on 1, 2, ... threads (``JSPARSE_THREADS``): changes
  per second to encode its parts (from the device diff's outputs, copies to the host
  included) and to decode them (checks included), best of ``repeats``."""
  import os
  rows = {}
  saved = os.environ.get("JSPARSE_THREADS")
  try:
    for n in threads:
      os.environ["JSPARSE_THREADS"] = str(n)
      encode, decode = float("inf"), float("inf")
      for _ in range(repeats):
        sender = jsparse.Sender(plan, before)
        receiver = jsparse.Receiver(plan, plan.cast(before))
        stream = sender.send_stream(after, chunk_bytes=chunk_bytes)  # the device diff runs
        jax.block_until_ready(sender_snapshot(sender))
        start = time.perf_counter()
        parts = list(stream)
        encode = min(encode, time.perf_counter() - start)
        reader = parts_reader(receiver)
        start = time.perf_counter()
        for part in parts:
          reader.add(part)
        reader.finish()
        decode = min(decode, time.perf_counter() - start)
      changed = sender.last_stats.changed
      rows[n] = {"parts": len(parts), "changed": changed, "encode": changed / encode,
                 "decode": changed / decode}
  finally:
    if saved is None:
      os.environ.pop("JSPARSE_THREADS", None)
    else:
      os.environ["JSPARSE_THREADS"] = saved
  return rows


def print_coding_rates(rows: dict) -> None:
  first = rows[min(rows)]
  print(f"host coding of a streamed version ({first['parts']} parts, {first['changed']:,} "
        "changes), changes per second")
  for n, r in rows.items():
    print(f"  {n} thread(s): encode {r['encode'] / 1e6:.1f} M/s "
          f"({r['encode'] / first['encode']:.2f}x), decode {r['decode'] / 1e6:.1f} M/s "
          f"({r['decode'] / first['decode']:.2f}x)")


def host_memory(plan: jsparse.Plan, before, after,
                codings: Sequence[str] = ("ranked", "positioned", "packed"),
                chunk_bytes: Sequence[int] = (8 << 20, 1 << 20)) -> dict:
  """Peak host memory of one sync, per coding, against its payload: Python and NumPy
  allocations traced by ``tracemalloc`` (device buffers, and the host copies XLA:CPU makes
  itself, are not counted) during a whole ``send``, a whole ``receive``, and a streamed version
  for each of ``chunk_bytes`` (``send_stream`` in parts of that size, each added to a
  ``ReceiveStream`` as it comes: rows ``stream <MiB>``)."""
  import tracemalloc
  rows = {}
  for coding in codings:
    fresh = lambda: (jsparse.Sender(plan, before, coding=coding),
                     jsparse.Receiver(plan, plan.cast(before)))
    sender, receiver = fresh()
    receiver.receive(sender.send(after))  # compiles outside the traced runs
    programs.wait_for_slot_levels()
    sender, receiver = fresh()
    tracemalloc.start()
    data = sender.send(after)
    send_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    held = tracemalloc.get_traced_memory()[0]
    receiver.receive(data)
    receive_peak = tracemalloc.get_traced_memory()[1] - held
    tracemalloc.stop()
    rows[coding] = {"payload": len(data), "changed": sender.last_stats.changed,
                    "send": send_peak, "receive": receive_peak}
    for size in chunk_bytes:
      sender, receiver = fresh()
      tracemalloc.start()
      stream = receiver.open_stream()
      for part in sender.send_stream(after, chunk_bytes=size):
        stream.add(part)
      stream.commit()
      rows[coding][f"stream {size / 2**20:g}"] = tracemalloc.get_traced_memory()[1]
      tracemalloc.stop()
  return rows


def print_host_memory(rows: dict) -> None:
  first = next(iter(rows.values()))
  print(f"peak host memory of one sync ({first['changed']:,} changes; traced Python/NumPy "
        "allocations; streams in parts of <MiB>), MB and x the payload")
  for coding, r in rows.items():
    cells = "  ".join(f"{what} {r[what] / 1e6:.1f} ({r[what] / r['payload']:.1f}x)"
                      for what in r if what not in ("payload", "changed"))
    print(f"  {coding:>10}: payload {r['payload'] / 1e6:.2f} MB; {cells}")
