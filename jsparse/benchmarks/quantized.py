"""Quantized rollouts on the realistic workload: per preset of :mod:`jsparse.quantized`, how many
codes and scales an RL step changes, the payload against the dense quantized weights and against
the bf16 sparse sync, and the sync time of both, side by side in one run (``--only quantized``).

Codes are counted one per element (4-bit codes unpacked); ``scale B`` is the bytes of every
scale the rollout holds (what a dense scale stream would send each step). Sync time is the best
``Sender.send`` + ``Receiver.receive`` of the step, each from the same synced state.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from jsparse import quantized
from jsparse.benchmarks._internals import to_bits

# What --quick runs: an 8-bit and a 4-bit preset (packed codes).
QUICK_PRESETS = ("fp8 128x128 tiles", "mxfp4")


def _parts(plan: jsparse.Plan, tree: Any) -> dict[str, list]:
  """The rollout tree's code arrays (4-bit unpacked) and scale arrays, each as bit patterns."""
  held = quantized.unpack(plan.cast(tree))
  codes, scales = [], []
  for path, x in jax.tree.flatten_with_path(held)[0]:
    name = jax.tree_util.keystr(path)
    if name.endswith(".qvalue"):
      widened = x.astype(jnp.int8) if x.dtype == jnp.int4 else (
          x.astype(jnp.float32) if x.dtype == jnp.float4_e2m1fn else x)
      codes.append(np.asarray(to_bits(widened)))
    elif name.endswith(".scale") or name.endswith(".zero_point"):
      scales.append(np.asarray(to_bits(x)))
  return {"codes": codes, "scales": scales}


def _changed(before: list, after: list) -> int:
  return int(sum(np.count_nonzero(a != b) for a, b in zip(before, after)))


def _sync_seconds(plan: jsparse.Plan, before: Any, after: Any, repeats: int) -> float:
  from jsparse.benchmarks.sync import _best
  snapshot = plan.cast(before)
  fresh = lambda: (jsparse.Sender(plan, before),  # noqa: E731
                   jsparse.Receiver(plan, jax.tree.map(jnp.copy, snapshot)))
  return _best(lambda s, r: r.receive(s.send(after)), fresh, repeats)


def preset_rows(states: Sequence, step: int, presets: Sequence[str] | None = None,
                repeats: int = 3, capacity: float = 0.05) -> dict:
  """Per preset (and ``bf16`` for the plain sparse sync): every step's code and scale changes
  and payload bytes, the dense quantized bytes, and the sync time of step ``step``."""
  bf16 = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, capacity=capacity)
  rows = {"bf16": _rows(bf16, states, step, repeats, quantized_plan=False)}
  for name in presets or list(quantized.PRESETS):
    plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, capacity=capacity,
                             quantize=quantized.PRESETS[name]())
    rows[name] = _rows(plan, states, step, repeats, quantized_plan=True)
  return {"step": step, "rows": rows}


def _rows(plan: jsparse.Plan, states: Sequence, step: int, repeats: int,
          quantized_plan: bool) -> dict:
  sender = jsparse.Sender(plan, states[0])
  parts = [_parts(plan, s) for s in states] if quantized_plan else None
  steps = []
  for i, params in enumerate(states[1:], start=1):
    size = len(sender.send(params))
    row = {"changed": sender.last_stats.changed, "bytes": size}
    if parts is not None:
      row["codes_changed"] = _changed(parts[i - 1]["codes"], parts[i]["codes"])
      row["scales_changed"] = _changed(parts[i - 1]["scales"], parts[i]["scales"])
    steps.append(row)
  out = {"steps": steps, "dense_bytes": plan.rollout_bytes, "elements": plan.num_elements,
         "sync_seconds": _sync_seconds(plan, states[step - 1], states[step], repeats)}
  if parts is not None:
    out["codes"] = int(sum(c.size for c in parts[0]["codes"]))
    out["scales"] = int(sum(s.size for s in parts[0]["scales"]))
    out["scale_bytes"] = int(sum(s.nbytes for s in parts[0]["scales"]))
  return out


def print_presets(result: dict) -> None:
  step = result["step"]
  rows = result["rows"]
  bf16 = rows["bf16"]
  print(f"\nquantized rollouts, RL step {step} (bf16 rollout: "
        f"{bf16['steps'][step - 1]['changed'] / bf16['elements']:.2%} of elements change, "
        f"{bf16['steps'][step - 1]['bytes']:,} B, sync {bf16['sync_seconds'] * 1e3:.1f} ms):")
  print(f"{'preset':>18} {'codes chg':>9} {'scales chg':>10} {'scale B':>9} {'payload B':>10} "
        f"{'B/change':>8} {'dense q B':>10} {'x dense q':>9} {'x bf16 sp':>9} {'sync ms':>8} "
        f"{'bf16 ms':>8}")
  for name, row in rows.items():
    if name == "bf16":
      continue
    s = row["steps"][step - 1]
    print(f"{name:>18} {s['codes_changed'] / max(1, row['codes']):>9.2%} "
          f"{s['scales_changed'] / max(1, row['scales']):>10.2%} {row['scale_bytes']:>9,} "
          f"{s['bytes']:>10,} {s['bytes'] / max(1, s['changed']):>8.2f} "
          f"{row['dense_bytes']:>10,} {row['dense_bytes'] / s['bytes']:>9.1f} "
          f"{bf16['steps'][step - 1]['bytes'] / s['bytes']:>9.1f} "
          f"{row['sync_seconds'] * 1e3:>8.1f} {bf16['sync_seconds'] * 1e3:>8.1f}")
