"""Tunix's GRPO loop with its dense sync against jsparse, side by side in one fresh process
(4 simulated devices): bytes and seconds per sync.

Both runs are the same seeded GRPO run of :mod:`jsparse.examples.tunix_grpo` (a Qwen3 of
``size`` with pretrained-like random weights, std 0.02; fp32 AdamW trainer at lr 1e-6, bf16
``VanillaRollout`` on a second mesh); only the sync differs.
Tunix's dense sync moves the trainer's arrays (fp32, 4 B per parameter) and casts on the rollout;
a dense bf16 copy would be 2 B per parameter. Seconds are the wall time of
``rollout.update_params`` (the sync alone), the median over the syncs after the first two (which
compile); on one host, so the dense copy is a local device copy, not a network transfer.
"""

from __future__ import annotations

import dataclasses
import statistics

from jsparse.benchmarks.fresh import in_fresh_process

SIZE = dict(vocab=256, layers=4, dim=256, hidden=1024, heads=4, head_dim=64)
INIT_STD = 0.02  # pretrained-like weights (see tunix_grpo.pretrained_like)
LEARNING_RATE = 1e-6


def _point(size: dict, steps: int) -> dict:
  from jsparse.examples import tunix_grpo
  run = dict(size=tunix_grpo.Size(**size), steps=steps, keep_states=False, init_std=INIT_STD,
             learning_rate=LEARNING_RATE)
  dense = tunix_grpo.run_grpo(sparse=False, **run)
  sparse = tunix_grpo.run_grpo(sparse=True, **run)
  return {"dense_seconds": dense.sync_seconds, "sparse_seconds": sparse.sync_seconds,
          "records": [dataclasses.asdict(r) for r in sparse.sparse.records],
          "same_run": dense.losses == sparse.losses and dense.rewards == sparse.rewards}


def tunix_syncs(size: dict | None = None, steps: int = 6) -> dict:
  """Per sync of a ``steps``-step GRPO run: jsparse's bytes, density and seconds, Tunix's."""
  return in_fresh_process("jsparse.benchmarks.tunix_loop", f"_point({size or SIZE!r}, {steps})",
                          devices=4)


def print_tunix_syncs(result: dict) -> None:
  records = result["records"]
  params = records[0]["elements"]
  print(f"Tunix GRPO loop ({params / 1e6:.1f}M-param Qwen3, fp32 trainer, bf16 rollout): "
        f"jsparse vs Tunix's dense sync; same losses and rewards: {result['same_run']}")
  print(f"{'sync':>4} {'density':>8} {'jsparse B':>10} {'B/change':>8} {'dense fp32 B':>12} "
        f"{'x fp32':>7} {'x bf16':>7} {'jsparse ms':>10} {'dense ms':>9}")
  for r, dense_s in zip(records, result["dense_seconds"]):
    print(f"{r['version']:>4} {r['changed'] / r['elements']:>8.2%} {r['payload_bytes']:>10,} "
          f"{r['payload_bytes'] / max(1, r['changed']):>8.2f} {r['dense_bytes']:>12,} "
          f"{r['dense_bytes'] / r['payload_bytes']:>7.1f} "
          f"{r['dense_bytes'] / 2 / r['payload_bytes']:>7.1f} {r['seconds'] * 1e3:>10.1f} "
          f"{dense_s * 1e3:>9.1f}")
  later = slice(2, None)  # the first two syncs compile
  for gbits in (1, 10):  # the dense copy here is local; over a link each sync also pays its bytes
    sparse_wire = [s + r["payload_bytes"] * 8 / (gbits * 1e9)
                   for s, r in zip(result["sparse_seconds"], records)]
    dense_wire = [s + r["dense_bytes"] * 8 / (gbits * 1e9)
                  for s, r in zip(result["dense_seconds"], records)]
    print(f"  + its bytes over {gbits} Gbit/s (computed): jsparse "
          f"{statistics.median(sparse_wire[later]) * 1e3:.1f} ms, dense "
          f"{statistics.median(dense_wire[later]) * 1e3:.1f} ms per sync (median after compiling)")
  print(f"median after compiling: jsparse {statistics.median(result['sparse_seconds'][later]) * 1e3:.1f}"
        f" ms, dense {statistics.median(result['dense_seconds'][later]) * 1e3:.1f} ms per sync")
