"""Bytes per change across densities: RL steps at learning rates 1e-6, 1e-5 and 3e-5 from one
pretrained TinyLM, and a jolt (every weight moved at once, then an ordinary step), synced at
the default settings, against the same coding with ``capacity=1.0`` (every segment's slots
its whole size: the sparse bytes that no capacity limits) and with ``max_capacity=0`` (slots
that never widen: a segment over its capacity goes dense), and against a dense anchor.

Between steps the background compilations finish (``programs.wait_for_slot_levels``), as they
do during a training step of a real model; what a step that comes sooner would send is the
capacity test's and the compile test's subject, not this table's.

>>> from jsparse.examples import rl_model
>>> cfg = rl_model.Config(vocab=64, dim=16, depth=1, batch=2, seq=8, pretrain_steps=1)
>>> runs = lr_runs(cfg, lrs=(1e-5,), steps=2)
>>> [len(states) for states in runs.values()]
[3]
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from jsparse.benchmarks._internals import programs
from jsparse.examples import rl_model

LEARNING_RATES = (1e-6, 1e-5, 3e-5)
CODINGS = tuple(c for c in jsparse.Coding if c is not jsparse.Coding.AUTO)
SETTINGS = {"default": {}, "capacity=1.0": {"capacity": 1.0},
            "max_capacity=0": {"max_capacity": 0.0}}


def lr_runs(cfg: rl_model.Config, lrs: Sequence[float] = LEARNING_RATES, steps: int = 4
            ) -> dict[str, list]:
  """Per learning rate, the fp32 params before and after each of ``steps`` AdamW steps from
  one pretrained model (pretrained once)."""
  pretrained = rl_model.pretrained_model(cfg)
  runs = {}
  for lr in lrs:
    model = nnx.clone(pretrained)
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    batches = rl_model.markov_batches(cfg, cfg.seed + 1)
    states = [jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))]
    for _ in range(steps):
      rl_model.train_step(model, optimizer, next(batches))
      states.append(jax.tree.map(jnp.copy, nnx.state(model, nnx.Param)))
    runs[f"lr {lr:g}"] = states
  return runs


def jolted(states: list, scale: float = 1e-2, seed: int = 0) -> list:
  """``states[:2]``, then every weight of ``states[1]`` moved by ``scale`` of itself (a jolt:
  about every bf16 element changes), then that plus the run's next step (an ordinary step
  after it)."""
  rng = np.random.default_rng(seed)
  jolt = jax.tree.map(lambda x: x * (1 + scale * rng.standard_normal(x.shape)).astype(x.dtype),
                      states[1])
  after = jax.tree.map(lambda j, a, b: j + (b - a), jolt, states[1], states[2])
  return [states[0], states[1], jolt, after]


def synced_bytes(plan: jsparse.Plan, states: list, coding: jsparse.Coding, **options: Any
                 ) -> list[int]:
  """Payload bytes of each step of ``states``, synced in order by a Sender of ``options``
  (and checked bit for bit by a Receiver)."""
  capacity = options.pop("capacity", None)
  if capacity is not None:
    plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, capacity=capacity)
  sender = jsparse.Sender(plan, states[0], coding=coding, **options)
  receiver = jsparse.Receiver(plan, plan.cast(states[0]))
  sizes = []
  for params in states[1:]:
    data = sender.send(params)
    receiver.receive(data)
    sizes.append(len(data))
    programs.wait_for_slot_levels()
  assert_trees_bitwise_equal(receiver.params, plan.cast(states[-1]))
  return sizes


def density_sweep(plan: jsparse.Plan, runs: dict[str, list],
                  codings: Sequence[jsparse.Coding] = CODINGS) -> dict:
  """Per run and coding, each step's density, changes and bytes at each of :data:`SETTINGS`,
  with the dense anchor's bytes."""
  out = {}
  for name, states in runs.items():
    counts = [_changes(plan, a, b) for a, b in zip(states, states[1:])]
    rows = {"density": [n / plan.num_elements for n in counts], "changes": counts,
            "codings": {}}
    for coding in codings:
      sender = jsparse.Sender(plan, states[0], coding=coding)
      dense = len(sender.send(states[0], anchor=True))
      rows["codings"][coding.value] = {"dense": dense, **{
          setting: synced_bytes(plan, states, coding, **options)
          for setting, options in SETTINGS.items()}}
    out[name] = rows
  return out


def _changes(plan: jsparse.Plan, before: Any, after: Any) -> int:
  bits = lambda tree: [np.asarray(x).view(np.uint16) for x in jax.tree.leaves(plan.cast(tree))]
  return int(sum(np.count_nonzero(a != b) for a, b in zip(bits(before), bits(after))))


def summary(sweep: dict) -> dict:
  """Per run and coding: the default's bytes over ``capacity=1.0``'s and over
  ``max_capacity=0``'s (summed over the steps), and its largest step over the dense anchor."""
  out = {}
  for name, rows in sweep.items():
    for coding, row in rows["codings"].items():
      default = sum(row["default"])
      out[name, coding] = {
          "vs_capacity_1": default / sum(row["capacity=1.0"]),
          "vs_static": default / sum(row["max_capacity=0"]),
          "max_vs_dense": max(row["default"]) / row["dense"],
          "bytes_per_change": default / max(1, sum(rows["changes"]))}
  return out


def print_density_sweep(sweep: dict) -> None:
  print("\nbytes per change across densities (default settings; ratios over the run's steps):")
  print(f"{'run':>9} {'densities':>15} {'coding':>17} {'B/change':>9} {'÷ cap=1.0':>10} "
        f"{'÷ max_cap=0':>12} {'max ÷ dense':>12}")
  for (name, coding), row in summary(sweep).items():
    d = sweep[name]["density"]
    print(f"{name:>9} {min(d):>6.2%}-{max(d):>7.2%} {coding:>17} "
          f"{row['bytes_per_change']:>9.3f} {row['vs_capacity_1']:>9.3f}x "
          f"{row['vs_static']:>11.3f}x {row['max_vs_dense']:>11.3f}x")
