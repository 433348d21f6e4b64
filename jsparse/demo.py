"""The main job: train a small Flax model in an RL-like regime and sync it every step.

A TinyLM is pretrained briefly, then fine-tuned with optax AdamW at lr 1e-6 on fp32 masters; after
every optimizer step a :class:`jsparse.Sender` turns the new params into a payload and a
:class:`jsparse.Receiver` applies it to a bf16 rollout copy. Each step is checked bit for bit
against the trainer's params cast to bf16, and a JSON summary is written.

Run ``python -m jsparse.demo --help`` for options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jsparse
from jsparse.examples import rl_model
from jsparse.testing import trees_bitwise_equal


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  defaults = rl_model.Config()
  parser = argparse.ArgumentParser(prog="python -m jsparse.demo", description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10, help="RL-like steps, each synced")
  parser.add_argument("--lr", type=float, default=defaults.rl_lr, help="AdamW learning rate")
  parser.add_argument("--dim", type=int, default=defaults.dim, help="model width")
  parser.add_argument("--depth", type=int, default=defaults.depth, help="residual blocks")
  parser.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary size")
  parser.add_argument("--capacity", type=float, default=0.05,
                      help="sparse slots per large leaf, as a fraction of its elements")
  parser.add_argument("--out", default="jsparse_out", help="folder for the run summary")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  cfg = rl_model.Config(vocab=args.vocab, dim=args.dim, depth=args.depth, rl_lr=args.lr)
  print(f"jsparse {jsparse.__version__} on {jax.devices()[0].platform}: pretraining a TinyLM "
        f"(dim {cfg.dim}, depth {cfg.depth}, vocab {cfg.vocab}) ...", flush=True)
  model, optimizer, batches = rl_model.rl_finetuning(cfg)
  params = nnx.state(model, nnx.Param)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=args.capacity)
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  print(f"{plan.num_elements:,} parameters in {len(plan.leaves)} leaves, {len(plan.segments)} "
        f"segments; dense bf16 sync = {plan.rollout_bytes:,} bytes; AdamW lr {cfg.rl_lr:g}")
  print(f"{'step':>4} {'loss':>7} {'density':>8} {'payload B':>10} {'vs dense':>9} "
        f"{'sync ms':>8}  exact")
  history = []
  for step in range(1, args.steps + 1):
    loss = float(rl_model.train_step(model, optimizer, next(batches)))
    params = nnx.state(model, nnx.Param)
    start = time.perf_counter()
    rollout = receiver.receive(sender.send(params))
    jax.block_until_ready(rollout)
    sync_ms = 1e3 * (time.perf_counter() - start)
    exact = trees_bitwise_equal(rollout, plan.cast(params))
    stats = dict(sender.last_stats, loss=loss, sync_ms=sync_ms, exact=exact,
                 density=sender.last_stats["changed"] / plan.num_elements)
    history.append(stats)
    print(f"{step:>4} {loss:>7.4f} {stats['density']:>8.3%} {stats['payload_bytes']:>10,} "
          f"{plan.rollout_bytes / stats['payload_bytes']:>8.1f}x {sync_ms:>8.1f}  "
          f"{'yes' if exact else 'NO'}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  summary_path = os.path.join(args.out, "demo_summary.json")
  summary = {"parameters": plan.num_elements, "dense_bytes": plan.rollout_bytes,
             "all_exact": all(h["exact"] for h in history), "steps": history}
  with open(summary_path, "w") as f:
    json.dump(summary, f, indent=1)
  total = sum(h["payload_bytes"] for h in history)
  print(f"sent {total:,} bytes in {len(history)} syncs instead of "
        f"{plan.rollout_bytes * len(history):,} ({plan.rollout_bytes * len(history) / total:.1f}x "
        f"less); every step bit-exact: {summary['all_exact']}")
  print(f"wrote {os.path.abspath(summary_path)}")
  return summary


if __name__ == "__main__":
  sys.exit(0 if main()["all_exact"] else 1)
