"""The main job: train a Flax model in an RL-like regime and sync it, sharded, every step.

A TinyLM (Flax NNX) is pretrained briefly, then fine-tuned with optax AdamW at lr 1e-6 on fp32
masters, its parameters sharded FSDP-style over a trainer mesh. After every optimizer step a
:class:`jsparse.Sender` turns the params into a compact payload, and a :class:`jsparse.Receiver`
applies it to a bf16 rollout copy that lives on a differently shaped mesh (data x tensor, the
matrices split by columns). Each step is checked bit for bit, and the rollout copy is also
persisted as an Orbax delta checkpoint chain. Without an accelerator the meshes are made of
simulated CPU devices.

Writes, under ``--out``: ``demo_summary.json`` (per-step numbers), ``demo_sync.png`` (density
and payload bytes per step) and ``checkpoints/`` (the chain).

Run ``python -m jsparse.examples.demo --help`` for options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Sequence

import jax


def _ensure_devices(count: int) -> None:
  """Simulated CPU devices for the meshes, if no accelerator is there (before JAX starts)."""
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # the backend is already up: keep what it has
    pass


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  from jsparse.examples import rl_model
  defaults = rl_model.Config()
  parser = argparse.ArgumentParser(prog="python -m jsparse.examples.demo",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=12, help="RL-like steps, each synced")
  parser.add_argument("--lr", type=float, default=defaults.rl_lr, help="AdamW learning rate")
  parser.add_argument("--dim", type=int, default=defaults.dim, help="model width")
  parser.add_argument("--depth", type=int, default=defaults.depth, help="residual blocks")
  parser.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary size")
  parser.add_argument("--capacity", type=float, default=0.05,
                      help="sparse slots per large leaf, as a fraction of its elements")
  parser.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when there is no accelerator")
  parser.add_argument("--rebase-every", type=int, default=5,
                      help="deltas per checkpoint chain before a new base")
  parser.add_argument("--out", default="jsparse_out", help="folder for the outputs")
  parser.add_argument("--no-progress", action="store_true", help="plain lines, no progress bar")
  return parser.parse_args(argv)


def _meshes():
  """(trainer mesh, rollout mesh) over the same devices, shaped differently."""
  from jax.sharding import AxisType
  devices = jax.devices()
  n = len(devices)
  tensor = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
  trainer = jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,))
  rollout = jax.make_mesh((n // tensor, tensor), ("data", "tensor"),
                          axis_types=(AxisType.Auto,) * 2)
  return trainer, rollout


def _shardings(params, mesh, split_dim: int, axis: str):
  """Matrices split along ``split_dim`` over ``axis`` where it divides; the rest replicated."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  parts = mesh.shape[axis]

  def one(x):
    if x.ndim == 2 and x.shape[split_dim] % parts == 0:
      spec = [None, None]
      spec[split_dim] = axis
      return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())
  return jax.tree.map(one, params)


def _train_step_keeping(shardings):
  """``rl_model.train_step``, with the params laid out as ``shardings`` when it returns. Left to
  itself XLA splits the biases and norms (held whole in the plan) over the fsdp axis, and every
  diff then gathers them again."""
  from flax import nnx
  from jsparse.examples import rl_model

  @nnx.jit
  def step(model, optimizer, tokens):
    value = rl_model.train_step(model, optimizer, tokens)
    nnx.update(model, jax.lax.with_sharding_constraint(nnx.state(model, nnx.Param), shardings))
    return value
  return step


def _plot(history: list[dict], dense_bytes: int, lr: float, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [h["version"] for h in history]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
  top.plot(steps, [100 * h["density"] for h in history], "o-")
  top.set_ylabel("bf16 elements changed (%)")
  top.set_title(f"jsparse: trainer -> rollout sync after each AdamW step (lr {lr:g})")
  bottom.semilogy(steps, [h["payload_bytes"] for h in history], "o-", label="jsparse payload")
  bottom.axhline(dense_bytes, color="gray", linestyle="--", label="dense bf16")
  bottom.set_ylabel("bytes per sync")
  bottom.set_xlabel("optimizer step")
  bottom.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  _ensure_devices(args.devices)
  import jax.numpy as jnp
  from flax import nnx
  from tqdm import tqdm

  import jsparse
  from jsparse.examples import rl_model
  from jsparse.testing import trees_bitwise_equal

  cfg = rl_model.Config(vocab=args.vocab, dim=args.dim, depth=args.depth, rl_lr=args.lr)
  trainer_mesh, rollout_mesh = _meshes()
  print(f"jsparse {jsparse.__version__} on {len(jax.devices())} {jax.devices()[0].platform} "
        f"devices: trainer mesh {dict(trainer_mesh.shape)}, rollout mesh "
        f"{dict(rollout_mesh.shape)}; pretraining a TinyLM (dim {cfg.dim}, depth {cfg.depth}, "
        f"vocab {cfg.vocab}) ...", flush=True)
  model, optimizer, batches = rl_model.rl_finetuning(cfg)
  params = nnx.state(model, nnx.Param)
  trainer_shardings = _shardings(params, trainer_mesh, 0, "fsdp")
  rollout_shardings = _shardings(params, rollout_mesh, 1, "tensor")
  nnx.update(model, jax.device_put(params, trainer_shardings))
  optimizer = nnx.Optimizer(model, optimizer.tx, wrt=nnx.Param)  # its state on the mesh too
  params = nnx.state(model, nnx.Param)
  train_step = _train_step_keeping(trainer_shardings)  # params stay laid out as planned

  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=args.capacity)
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, jax.device_put(plan.cast(params), rollout_shardings))
  os.makedirs(args.out, exist_ok=True)
  checkpoints = os.path.abspath(os.path.join(args.out, "checkpoints"))
  shutil.rmtree(checkpoints, ignore_errors=True)  # this run's chain replaces an earlier run's
  chain = jsparse.DeltaCheckpointManager(checkpoints, plan, rebase_every=args.rebase_every)
  chain.save(0, params)
  print(f"{plan.num_elements:,} parameters in {len(plan.leaves)} leaves; dense bf16 sync = "
        f"{plan.rollout_bytes:,} bytes; AdamW lr {cfg.rl_lr:g}", flush=True)

  history = []
  bar = tqdm(range(1, args.steps + 1), desc="sync", unit="step", disable=args.no_progress,
             file=sys.stdout)
  for step in bar:
    loss = float(train_step(model, optimizer, next(batches)))
    params = nnx.state(model, nnx.Param)
    start = time.perf_counter()
    rollout = jax.block_until_ready(receiver.receive(sender.send(params)))
    sync_ms = 1e3 * (time.perf_counter() - start)
    exact = trees_bitwise_equal(rollout, plan.cast(params))
    checkpoint = chain.save(step, params)
    stats = dict(dataclasses.asdict(sender.last_stats), loss=loss, sync_ms=sync_ms,
                 exact=exact, density=sender.last_stats.density,
                 checkpoint_kind=checkpoint.kind, checkpoint_bytes=checkpoint.bytes)
    history.append(stats)
    ratio = plan.rollout_bytes / stats["payload_bytes"]
    line = (f"density {stats['density']:.2%}, {stats['payload_bytes']:,} B ({ratio:.0f}x < "
            f"dense), {sync_ms:.0f} ms, exact {'yes' if exact else 'NO'}")
    if args.no_progress:
      print(f"step {step:>3}: loss {loss:.4f}, {line}", flush=True)
    else:
      bar.set_postfix_str(line)
  bar.close()

  restored = chain.restore(args.steps, shardings=rollout_shardings)
  chain_exact = trees_bitwise_equal(restored, plan.cast(params))
  chain.close()
  summary_path = os.path.abspath(os.path.join(args.out, "demo_summary.json"))
  plot_path = os.path.abspath(os.path.join(args.out, "demo_sync.png"))
  summary = {"parameters": plan.num_elements, "dense_bytes": plan.rollout_bytes,
             "trainer_mesh": dict(trainer_mesh.shape), "rollout_mesh": dict(rollout_mesh.shape),
             "all_exact": all(h["exact"] for h in history) and chain_exact,
             "checkpoint_chain_exact": chain_exact, "steps": history}
  with open(summary_path, "w") as f:
    json.dump(summary, f, indent=1)
  _plot(history, plan.rollout_bytes, cfg.rl_lr, plot_path)
  total = sum(h["payload_bytes"] for h in history)
  print(f"sent {total:,} bytes in {len(history)} syncs instead of "
        f"{plan.rollout_bytes * len(history):,} ({plan.rollout_bytes * len(history) / total:.1f}x "
        f"less); every step bit-exact: {all(h['exact'] for h in history)}; checkpoint chain "
        f"restores step {args.steps} exactly onto the rollout mesh: {chain_exact}")
  print(f"wrote {summary_path}\nwrote {plot_path}\nwrote {checkpoints}/ "
        f"(Orbax steps 0..{args.steps}: bases every {args.rebase_every + 1} steps, deltas "
        f"between)")
  return summary


if __name__ == "__main__":
  sys.exit(0 if main()["all_exact"] else 1)
