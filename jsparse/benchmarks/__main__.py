"""``python -m jsparse.benchmarks``: jsparse against the alternatives, side by side in one run.

On a realistic update (a ~21M-parameter TinyLM pretrained for 300 AdamW steps, then RL-like
AdamW steps at lr 1e-6 on fp32 masters, bf16 rollout; the method table is for the step whose
density is closest to 1%) it prints: payload bytes, encode and apply times and
compiled memory of the sync (``--only sync``), and the disk bytes and save times of full Orbax
checkpoints against a delta chain (``--only storage``), and the end-to-end sync time per step
over a simulated 1 and 10 Gbit/s link, sparse against dense (``--only link``).
"""

from __future__ import annotations

import argparse
from typing import Sequence

import jax.numpy as jnp

import jsparse
from jsparse.benchmarks import link, storage, sync
from jsparse.examples import workload


def run(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m jsparse.benchmarks",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--dim", type=int, default=512, help="model width")
  parser.add_argument("--depth", type=int, default=6, help="residual blocks")
  parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
  parser.add_argument("--steps", type=int, default=8, help="RL-like steps to run")
  parser.add_argument("--pretrain-steps", type=int, default=300,
                      help="AdamW steps at lr 3e-3 before the RL-like ones")
  parser.add_argument("--lr", type=float, default=1e-6, help="the RL-like AdamW learning rate")
  parser.add_argument("--repeats", type=int, default=5, help="timing repeats (best is kept)")
  parser.add_argument("--only", choices=["sync", "storage", "link"], help="run one part only")
  args = parser.parse_args(argv)
  cfg = workload.benchmark_config(args.dim, args.depth, args.vocab, args.pretrain_steps, args.lr)
  states = workload.realistic_run(cfg, args.steps)
  plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, capacity=0.05)
  results = {}
  if args.only in (None, "sync"):
    results["sync"] = sync.run(plan, states, repeats=args.repeats)
  if args.only in (None, "link"):
    results["link"] = link.link_times(plan, states)
    link.print_link_times(results["link"])
  if args.only in (None, "storage"):
    results["storage"] = storage.compare_storage(plan, states)
    storage.print_storage(plan, results["storage"])
  return results


if __name__ == "__main__":
  run()
