"""First-sync benchmark: how long a new user waits for the first sync, compilations included.

Each point runs in a fresh process with 8 simulated CPU devices (on a machine without an
accelerator) and JAX's persistent compilation cache off, so every program is compiled:

- :func:`mlp_point`: a 3.2M-parameter Flax NNX MLP, its fp32 params split FSDP-style over the 8
  devices, one optax AdamW step at lr 1e-5; ``make_plan``, ``Sender()``, ``Receiver()`` (a bf16
  rollout on the same devices, its matrices split by columns instead), then the first sync
  (``send`` and ``receive``) and a second one, after another step.
- :func:`demo_point`: the demo (``python -m jsparse.examples.demo``, default model: a TinyLM of
  2.6M parameters, FSDP trainer mesh, data x tensor rollout mesh), two steps: the time of its
  first and second sync as the demo measures it (``send`` and ``receive``).

>>> row = mlp_point(widths=(64, 64))
>>> sorted(row)
['dense bytes', 'first receive', 'first send', 'params', 'plan', 'receive', 'receiver', 'send',
 'sender', 'steps']
"""

from __future__ import annotations

import tempfile
import time
from typing import Sequence

from jsparse.benchmarks.fresh import in_fresh_process

DEVICES = 8
MLP_WIDTHS = (1024, 1024, 1024, 1024)  # three 1024 x 1024 layers: 3.15M parameters


def _seconds(fn):
  import jax
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def mlp_point(widths: Sequence[int] = MLP_WIDTHS, steps: int = 3, lr: float = 1e-5) -> dict:
  """The MLP's set-up and syncs in this process (see the module docstring), in seconds."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jsparse

  class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths, widths[1:])])

    def __call__(self, x):
      for layer in self.layers:
        x = jax.nn.gelu(layer(x))
      return x

  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("fsdp",), axis_types=(AxisType.Auto,))
  split = lambda x, dim: NamedSharding(mesh, P(*[("fsdp" if d == dim and x.shape[d] % len(
      devices) == 0 else None) for d in range(x.ndim)]))
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, split(x, 0)), params))

  @nnx.jit
  def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  batches = iter(jax.random.normal(jax.random.key(k), (64, widths[0])) for k in range(steps + 1))
  params = nnx.state(model, nnx.Param)
  row = {}
  plan, row["plan"] = _seconds(lambda: jsparse.make_plan(params, rollout_dtype=jnp.bfloat16))
  row["params"] = plan.num_elements
  rollout = jax.block_until_ready(jax.tree.map(
      lambda x: jax.device_put(x, split(x, x.ndim - 1)), plan.cast(params)))
  sender, row["sender"] = _seconds(lambda: jsparse.Sender(plan, params))
  receiver, row["receiver"] = _seconds(lambda: jsparse.Receiver(plan, rollout))
  for k in range(steps):
    jax.block_until_ready(train_step(model, optimizer, next(batches)))
    params = nnx.state(model, nnx.Param)
    data, send = _seconds(lambda: sender.send(params))
    _, receive = _seconds(lambda: receiver.receive(data))
    key = "first " if k == 0 else ""
    row[key + "send"], row[key + "receive"] = send, receive
    row.setdefault("steps", []).append({"density": sender.last_stats.density,
                                        "bytes": len(data)})
  row["dense bytes"] = plan.rollout_bytes
  return row


def demo_point(steps: int = 2) -> dict:
  """The demo's first and second sync in this process, in seconds."""
  import contextlib
  import io
  from jsparse.examples import demo
  with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
    summary = demo.main(["--steps", str(steps), "--no-progress", "--out", out])
  syncs = [h["sync_ms"] / 1e3 for h in summary["steps"]]
  return {"params": summary["parameters"], "first sync": syncs[0], "sync": min(syncs[1:])}


def first_syncs() -> dict:
  """Both points, each in a fresh process: ``{"mlp": ..., "demo": ...}``."""
  return {"mlp": in_fresh_process(__name__, "mlp_point()", DEVICES),
          "demo": in_fresh_process(__name__, "demo_point()", DEVICES)}


def print_first_syncs(rows: dict) -> None:
  mlp, demo = rows["mlp"], rows["demo"]
  print(f"\nfirst sync, compilations included (fresh process, {DEVICES} devices, no "
        "persistent cache), seconds:")
  print(f"  {mlp['params'] / 1e6:.1f}M-parameter MLP, FSDP: make_plan {mlp['plan']:.2f}, "
        f"Sender() {mlp['sender']:.2f}, Receiver() {mlp['receiver']:.2f}; first sync "
        f"{mlp['first send'] + mlp['first receive']:.2f} (send {mlp['first send']:.2f}, "
        f"receive {mlp['first receive']:.2f}); the next {mlp['send'] + mlp['receive']:.3f}")
  print(f"  the demo ({demo['params'] / 1e6:.1f}M-parameter TinyLM): first sync "
        f"{demo['first sync']:.2f}; the next {demo['sync']:.3f}")
