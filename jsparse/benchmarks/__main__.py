"""``python -m jsparse.benchmarks``: jsparse against the alternatives, side by side in one run.

On a realistic update (a ~21M-parameter TinyLM pretrained for 300 AdamW steps, then RL-like
AdamW steps at lr 1e-6 on fp32 masters, bf16 rollout; the method table is for the step whose
density is closest to 1%) it prints: payload bytes, encode and apply times and
compiled memory of the sync (``--only sync``), and the disk bytes and save times of full Orbax
checkpoints against a delta chain (``--only storage``), and the end-to-end sync time per step
over a simulated 1 and 10 Gbit/s link, sparse against dense (``--only link``); set-up time
against the number of leaves, time per parameter and peak memory from 25M to 1B parameters, and
an estimate for 7B and 70B models from this run's rates (``--only scale``; the estimate needs
the sync part's rates, so ``--only scale`` runs that too); the peak host memory of a sync
against its payload (``--only memory``); bytes and seconds per sync in Tunix's
GRPO loop, jsparse against Tunix's dense sync (``--only tunix``, needs ``jsparse[tunix]``).
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import jax
import jax.numpy as jnp

import jsparse
from jsparse.benchmarks import link, scale, storage, sync, tunix_loop
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
  parser.add_argument("--only", choices=["sync", "storage", "link", "scale", "memory", "tunix"],
                      help="run one part only")
  parser.add_argument("--leaf-counts", type=int, nargs="+", default=[100, 1000, 10000],
                      help="leaf counts of the set-up time table")
  parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                      help="host threads of the coding-rate table")
  parser.add_argument("--scale-params", type=int, nargs="+",
                      default=[25_000_000, 100_000_000, 250_000_000, 1_000_000_000],
                      help="model sizes of the scaling table")
  args = parser.parse_args(argv)
  # On a GPU, JAX takes 75% of its memory at start: the scaling and set-up rows run in child
  # processes of this one, which then would not fit. (Read when the backend starts.)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  results = {}
  if args.only == "tunix":  # its own run: no TinyLM workload needed
    results["tunix"] = tunix_loop.tunix_syncs()
    tunix_loop.print_tunix_syncs(results["tunix"])
    return results
  cfg = workload.benchmark_config(args.dim, args.depth, args.vocab, args.pretrain_steps, args.lr)
  states = workload.realistic_run(cfg, args.steps)
  plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, capacity=0.05)
  if args.only in (None, "sync", "scale"):
    results["sync"] = sync.run(plan, states, repeats=args.repeats)
  if args.only in (None, "link"):
    results["link"] = link.link_times(plan, states)
    link.print_link_times(results["link"])
    results["stream"] = link.stream_times(plan, states)
    link.print_stream_times(results["stream"])
  if args.only in (None, "storage"):
    results["storage"] = storage.compare_storage(plan, states)
    storage.print_storage(plan, results["storage"])
  if args.only in (None, "scale"):
    compact, core = results["sync"]["methods"][sync.METHODS[4]], results["sync"]["core"]
    changed = results["sync"]["steps"][results["sync"]["step"] - 1]["changed"]
    ratio = compact["diff"] / core["compare-and-count (floor)"][0]
    measured = None
    if jax.default_backend() != "cpu":  # the device passes as timed on this accelerator
      measured = ((compact["diff"] + compact["device_apply"]) / plan.num_elements,
                  core["dense bf16 copy"][0] / plan.num_elements)
    results["estimate"] = scale.estimate(compact, changed, ratio, measured_per_param=measured)
    scale.print_estimate(results["estimate"])
    step = results["sync"]["step"]
    results["coding"] = scale.coding_rates(plan, states[step - 1], states[step],
                                           threads=args.threads)
    scale.print_coding_rates(results["coding"])
    results["scaling"] = scale.scaling(args.scale_params, stages=True)
    scale.print_scaling(results["scaling"])
    results["compile"] = scale.compile_times(args.leaf_counts)
    scale.print_compile_times(results["compile"])
  if args.only in (None, "scale", "memory"):
    step = (results["sync"]["step"] if "sync" in results
            else sync.one_percent_step(sync.per_step_sizes(plan, states)))
    results["host_memory"] = scale.host_memory(plan, states[step - 1], states[step])
    scale.print_host_memory(results["host_memory"])
  if args.only is None:
    results["tunix"] = tunix_loop.tunix_syncs()
    tunix_loop.print_tunix_syncs(results["tunix"])
  return results


if __name__ == "__main__":
  run()
