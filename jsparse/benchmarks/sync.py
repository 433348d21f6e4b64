"""Benchmark of the core on a realistic update (>= 20M parameters), side by side in one run.

A TinyLM of ~21M parameters is pretrained briefly, then one AdamW step at lr 1e-6 runs on its
fp32 masters; the update is the bf16 rollout copy before vs after. Printed: density; payload
bytes of dense bf16, the published SparseRL-Sync raw format (int32 index + bf16 value per change)
and jsparse's wire format; times of the jitted diff against a jitted bitcast-compare-and-count (the
streaming floor) and a ``jnp.nonzero`` diff, of the donated apply against a jitted dense copy; and
compiled temporary memory of each, relative to the parameter bytes.

Run ``python -m jsparse.bench --help`` for options.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jsparse
from jsparse._src import bits as bits_lib
from jsparse._src.delta import _apply_donating, receiver_layouts
from jsparse.examples import rl_model


def _best_time(fn: Callable, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _temp_bytes(jitted: Callable, *args) -> int:
  return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _compare_and_count(plan, base, new):
  """The streaming floor: cast, bitcast, compare and count every leaf, nothing else."""
  total = jnp.int32(0)
  for b, n, leaf in zip(jax.tree.leaves(base), jax.tree.leaves(new), plan.leaves):
    nb = bits_lib.to_bits(n.astype(leaf.rollout_dtype))
    total += jnp.sum(bits_lib.to_bits(b.astype(leaf.rollout_dtype)) != nb, dtype=jnp.int32)
  return total


def _nonzero_diff(plan, base, new):
  """The straightforward alternative: ``jnp.nonzero(mask, size=K)`` per leaf, then gather."""
  out = []
  for b, n, leaf in zip(jax.tree.leaves(base), jax.tree.leaves(new), plan.leaves):
    nb = bits_lib.to_bits(n.astype(leaf.rollout_dtype)).reshape(-1)
    mask = bits_lib.to_bits(b.astype(leaf.rollout_dtype)).reshape(-1) != nb
    (idx,) = jnp.nonzero(mask, size=max(1, int(0.05 * leaf.size)), fill_value=leaf.size)
    out.append((idx, nb[jnp.minimum(idx, leaf.size - 1)]))
  return out


def _dense_copy(plan, base, new):
  return jax.tree.map(lambda n, leaf: n.astype(leaf.rollout_dtype) + 0, new,
                      jax.tree.unflatten(plan.treedef, plan.leaves))


def realistic_update(cfg: rl_model.Config):
  """(params before, params after) one AdamW lr-1e-6 step of a briefly pretrained TinyLM."""
  model, optimizer, batches = rl_model.rl_finetuning(cfg)
  before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  rl_model.train_step(model, optimizer, next(batches))
  return before, nnx.state(model, nnx.Param)


def run(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m jsparse.bench", description=__doc__.split("\n")[0])
  parser.add_argument("--dim", type=int, default=512)
  parser.add_argument("--depth", type=int, default=6)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  cfg = rl_model.Config(vocab=args.vocab, dim=args.dim, depth=args.depth, batch=8, seq=32,
                        pretrain_steps=10)
  before, after = realistic_update(cfg)
  plan = jsparse.make_plan(before, rollout_dtype=jnp.bfloat16, capacity=0.05)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(after))
  snapshot = plan.cast(before)

  sender = jsparse.Sender(plan, before)
  payload = sender.send(after)
  changed = sender.last_stats["changed"]
  rows = {"dense bf16": plan.rollout_bytes, "int32 index + bf16 value (SparseRL-Sync raw)":
          changed * 6, "jsparse wire format": len(payload)}
  print(f"{plan.num_elements:,} parameters ({param_bytes:,} B fp32), {len(plan.leaves)} leaves, "
        f"{len(plan.segments)} segments; one AdamW lr {cfg.rl_lr:g} step changed {changed:,} bf16 "
        f"elements = {changed / plan.num_elements:.3%}\n")
  print(f"{'payload':<46}{'bytes':>12}{'B/change':>10}{'vs dense':>10}")
  for name, size in rows.items():
    print(f"{name:<46}{size:>12,}{size / changed:>10.2f}{plan.rollout_bytes / size:>9.1f}x")

  floor = jax.jit(_compare_and_count, static_argnums=0)
  nonzero = jax.jit(_nonzero_diff, static_argnums=0)
  dense = jax.jit(_dense_copy, static_argnums=0)
  apply_inplace = functools.partial(jsparse.apply, donate=True)
  delta = jsparse.diff(plan, snapshot, after)
  timed = {
      "compare-and-count (floor)": (floor, (plan, snapshot, after)),
      "jsparse.diff": (jsparse.diff, (plan, snapshot, after)),
      "jnp.nonzero diff": (nonzero, (plan, snapshot, after)),
      "dense bf16 copy": (dense, (plan, snapshot, after)),
  }
  results = {}
  print(f"\n{'jitted step':<30}{'best ms':>10}{'vs floor':>10}{'temp MB':>10}{'temp/params':>13}")
  for name, (fn, fn_args) in timed.items():
    seconds = _best_time(fn, *fn_args, repeats=args.repeats)
    temp = _temp_bytes(fn, *fn_args)
    results[name] = (seconds, temp)
    print(f"{name:<30}{1e3 * seconds:>10.1f}{seconds / results[next(iter(timed))][0]:>9.2f}x"
          f"{temp / 2**20:>10.1f}{temp / param_bytes:>13.3f}")
  rollout = [plan.cast(before)]
  def apply_fresh():  # the donated buffer is dead after each call: feed back the result
    rollout[0] = apply_inplace(plan, rollout[0], delta)
    return rollout[0]
  seconds = _best_time(apply_fresh, repeats=args.repeats)
  layouts = receiver_layouts(plan, jax.tree.leaves(rollout[0]))
  temp = _temp_bytes(_apply_donating, plan, layouts, rollout[0], delta)
  dense_seconds = results["dense bf16 copy"][0]
  print(f"{'jsparse.apply (donated)':<30}{1e3 * seconds:>10.1f}{'':>10}{temp / 2**20:>10.1f}"
        f"{temp / param_bytes:>13.3f}   ({seconds / dense_seconds:.2f}x the dense copy)")
  return {"changed": changed, "elements": plan.num_elements, "payload": rows}


if __name__ == "__main__":
  run()
