"""Disk bytes and save time: N full Orbax checkpoints against a base plus N delta checkpoints.

Both write the bf16 rollout view of each step with Orbax (``ocp.CheckpointManager``, synchronous
saves); the chain is :class:`jsparse.DeltaCheckpointManager`.

>>> import jax, jax.numpy as jnp, jsparse
>>> w = jax.random.normal(jax.random.key(0), (65536,))
>>> states = [{'w': w}, {'w': w.at[:100].add(1.0)}]
>>> plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16)
>>> rows = compare_storage(plan, states)
>>> rows['delta chain'][1]['kind'], rows['full'][1]['bytes'] > rows['delta chain'][1]['bytes']
('delta', True)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Sequence

import jax
import orbax.checkpoint as ocp

import jsparse


def _dir_bytes(path: Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _save_full(directory: Path, plan: jsparse.Plan, states: Sequence) -> list[dict]:
  rows = []
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(directory, options=options) as manager:
    for step, params in enumerate(states):
      rollout = jax.block_until_ready(plan.cast(params))
      start = time.perf_counter()
      manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(rollout)))
      manager.wait_until_finished()
      rows.append({"step": step, "kind": "full", "seconds": time.perf_counter() - start,
                   "bytes": _dir_bytes(directory / str(step))})
  return rows


def _save_chain(directory: Path, plan: jsparse.Plan, states: Sequence) -> list[dict]:
  rows = []
  with jsparse.DeltaCheckpointManager(directory, plan, rebase_every=len(states)) as chain:
    for step, params in enumerate(states):
      start = time.perf_counter()
      stats = chain.save(step, params)
      rows.append(dict(stats._asdict(), seconds=time.perf_counter() - start))
    jax.block_until_ready(chain.restore(len(states) - 1))  # compiles the apply programs
    start = time.perf_counter()
    jax.block_until_ready(chain.restore(len(states) - 1))
    rows[-1]["restore_seconds"] = time.perf_counter() - start
  return rows


def compare_storage(plan: jsparse.Plan, states: Sequence) -> dict[str, list[dict]]:
  """Per-step ``bytes`` and ``seconds`` of full checkpoints and of a delta chain."""
  with tempfile.TemporaryDirectory() as root:
    return {"full": _save_full(Path(root) / "full", plan, states),
            "delta chain": _save_chain(Path(root) / "chain", plan, states)}


def print_storage(plan: jsparse.Plan, rows: dict[str, list[dict]]) -> None:
  full, chain = rows["full"], rows["delta chain"]
  print(f"\nOrbax checkpoints of the bf16 params ({plan.rollout_bytes:,} B), one per step:")
  print(f"{'step':>4}{'full B':>14}{'full ms':>9}{'chain kind':>12}{'chain B':>12}{'chain ms':>10}"
        f"{'changed':>12}")
  for f, c in zip(full, chain):
    print(f"{f['step']:>4}{f['bytes']:>14,}{1e3 * f['seconds']:>9.0f}{c['kind']:>12}"
          f"{c['bytes']:>12,}{1e3 * c['seconds']:>10.0f}{c['changed']:>12,}")
  total_full = sum(r["bytes"] for r in full)
  total_chain = sum(r["bytes"] for r in chain)
  deltas = [r for r in chain[1:]]
  mean_delta = sum(r["bytes"] for r in deltas) / max(1, len(deltas))
  print(f"total: {len(full)} full checkpoints {total_full:,} B; base + {len(deltas)} deltas "
        f"{total_chain:,} B ({total_full / total_chain:.1f}x less); a delta step averages "
        f"{mean_delta:,.0f} B = {full[-1]['bytes'] / mean_delta:.1f}x less than a full one")
  steady = lambda rs: sum(r["seconds"] for r in rs) / max(1, len(rs))
  print(f"save time from step 2 on (compiled): full {1e3 * steady(full[2:]):.0f} ms, delta "
        f"{1e3 * steady(chain[2:]):.0f} ms; restoring the last step (base + {len(deltas)} "
        f"deltas, digest-checked): {1e3 * chain[-1]['restore_seconds']:.0f} ms")
