"""``python -m jsparse.benchmarks --only device``: the prepared accelerator check.

Run it first on any machine with an accelerator (a few minutes on one GPU). It reports, side by
side in one run:

- per device program of the packed coding (the sender's diff and packing, the receiver's
  unpacking and apply), its time against its HBM floor: the bytes it must read and write at the
  bandwidth of a jitted dense copy measured here;
- the host stages against moving and checksumming the payload's bytes;
- the sync table (bytes, encode, apply, end-to-end at 0.1 to 100 Gbit/s) of every method on
  the TinyLM step nearest 1%, and of the packed, ranked, positioned and dense methods on a layered
  tree of ``large_params`` parameters after one RL-like step;
- a ``jax.profiler`` trace of one packed sync, in ``out_dir/trace``;
- the 7B and 70B estimate at 1% over 10 and 100 Gbit/s from the device passes timed here and
  the host stages of the large tree's payload (:func:`~jsparse.benchmarks.scale.packed_estimate`).

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(1000)}, rollout_dtype=jnp.bfloat16)
>>> {k: round(v * 1e9) for k, v in program_floors(plan, 10, rate=1e9).items()}  # in ns
{'diff': 8000, 'device_pack': 160, 'device_unpack': 160, 'device_apply': 2040}
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

import jsparse
from jsparse.benchmarks import scale, sync
from jsparse.examples import workload

LARGE_METHODS = (sync.DENSE, sync.RAW, sync.RANKED, sync.POSITIONED, sync.PACKED)


def copy_bandwidth(elements: int = 1 << 26, repeats: int = 5) -> float:
  """Bytes per second of a jitted dense copy (read and write) of ``elements`` fp32 values:
  the HBM floor's rate."""
  x = jnp.zeros((elements,), jnp.float32)
  copy = jax.jit(lambda a: a + 0)
  seconds = sync._best(copy, lambda: (x,), repeats)
  return 2 * x.nbytes / seconds


def program_floors(plan: jsparse.Plan, changed: int, rate: float) -> dict:
  """Per device program, the seconds its unavoidable bytes take at ``rate`` bytes/s: the diff
  reads the fp32 params and the bf16 snapshot and writes the next snapshot; the apply reads
  and writes the changed elements and reads every element for the digest; packing and
  unpacking read and write ~16 bytes per change."""
  n, rollout = plan.num_elements, plan.rollout_bytes
  trainer = sum(leaf.size * leaf.dtype.itemsize for leaf in plan.leaves)
  return {"diff": (trainer + 2 * rollout) / rate, "device_pack": 16 * changed / rate,
          "device_unpack": 16 * changed / rate, "device_apply": (rollout + 4 * changed) / rate}


def _step_tables(plan: jsparse.Plan, before: Any, after: Any, repeats: int,
                 methods=None) -> dict:
  rows = sync.compare_methods(plan, before, after, repeats, methods=methods or sync.METHODS)
  for r in rows.values():
    r["e2e"] = {g: r["encode"] + r["bytes"] * 8 / (g * 1e9) + r["apply"]
                for g in sync.LINKS_GBIT}
  return rows


def run(out_dir: str | None = "jsparse-device-benchmark", *, dim: int = 512, depth: int = 6,
        vocab: int = 8192, pretrain_steps: int = 300, large_params: int = 1_000_000_000,
        repeats: int = 5, trace: bool = True, echo: bool = True,
        methods: tuple = sync.METHODS) -> dict:
  """The accelerator check (see the module docstring); writes ``results.json`` (and the trace)
  to ``out_dir`` if given. ``methods``: which of :data:`~jsparse.benchmarks.sync.METHODS` to
  compare (the packed coding's is always among them)."""
  methods = tuple(dict.fromkeys((*methods, sync.PACKED)))
  say = print if echo else (lambda *a, **k: None)
  start = time.perf_counter()
  device = jax.devices()[0]
  rows: dict = {"backend": {"platform": device.platform, "kind": device.device_kind,
                            "devices": jax.device_count(), "jax": jax.__version__}}
  rate = copy_bandwidth(1 << 20 if large_params < 10_000_000 else 1 << 26, repeats)
  rows["copy_gbps"] = rate / 1e9
  say(f"{device.device_kind}: a jitted dense copy moves {rate / 1e9:.1f} GB/s")
  states = workload.realistic_run(
      workload.benchmark_config(dim, depth, vocab, pretrain_steps, 1e-6), 6)
  plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, capacity=0.05)
  steps = sync.per_step_sizes(plan, states)
  k = sync.one_percent_step(steps)
  table = _step_tables(plan, states[k - 1], states[k], repeats, methods)
  packed = table[sync.PACKED]
  changed = steps[k - 1]["changed"]
  floors = program_floors(plan, changed, rate)
  rows["programs"] = {name: {"ms": 1e3 * packed[name], "floor_ms": 1e3 * floor,
                             "x_floor": packed[name] / floor}
                      for name, floor in floors.items()}
  rows["programs"]["host"] = {"ms": 1e3 * (packed["host_encode"] + packed["host_decode"]),
                              "floor_ms": 1e3 * packed["bytes_floor"],
                              "x_floor": (packed["host_encode"] + packed["host_decode"])
                              / packed["bytes_floor"]}
  rows["step"] = {"params": plan.num_elements, "changed": changed, "methods": table}
  say(f"\n{plan.num_elements:,}-parameter TinyLM step: {changed:,} changed")
  if echo:
    sync.print_report(plan, steps, table, k)
  say(f"\n{'packed coding program':<24}{'ms':>9}{'HBM floor ms':>14}{'x floor':>9}")
  for name, r in rows["programs"].items():
    say(f"{name:<24}{r['ms']:>9.2f}{r['floor_ms']:>14.3f}{r['x_floor']:>9.1f}")
  if trace and out_dir:
    before, after = states[k - 1], states[k]
    sender = jsparse.Sender(plan, before, coding="packed")
    receiver = jsparse.Receiver(plan, plan.cast(before))
    receiver.receive(sender.send(after))  # compiled outside the trace
    sender = jsparse.Sender(plan, before, coding="packed")
    receiver = jsparse.Receiver(plan, plan.cast(before))
    with jax.profiler.trace(os.path.join(out_dir, "trace")):
      jax.block_until_ready(receiver.receive(sender.send(after)))
  large_plan, before, after = scale.large_step(large_params)
  large = _step_tables(large_plan, before, after, max(1, repeats // 2),
                       [m for m in LARGE_METHODS if m in methods])
  rows["large"] = {"params": large_plan.num_elements, "methods": large}
  say(f"\nlayered tree of {large_plan.num_elements:,} parameters, one RL-like step")
  say(f"{'method':<46}{'bytes':>14}" + "".join(f"{f'{g:g}G ms':>11}" for g in sync.LINKS_GBIT))
  for name, r in large.items():
    say(f"{name:<46}{r['bytes']:>14,}" + "".join(f"{1e3 * r['e2e'][g]:>11.1f}"
                                                  for g in sync.LINKS_GBIT))
  n = plan.num_elements
  measured = ((packed["diff"] + packed["device_pack"]) / n,
              (packed["device_unpack"] + packed["device_apply"]) / n)
  large_packed = large[sync.PACKED]
  rows["estimate"] = scale.packed_estimate(
      packed, changed, {}, per_param=measured,
      host_per_byte=(large_packed["host_encode"] + large_packed["host_decode"])
      / large_packed["bytes"])
  if echo:
    print()
    scale.print_packed_estimate(rows["estimate"])
  say(f"\ndone in {time.perf_counter() - start:.0f} s")
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
      json.dump(rows, f, indent=1, default=float)
  return rows
