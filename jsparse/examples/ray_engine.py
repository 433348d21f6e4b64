"""Trainer and rollouts as Ray actors: one trainer actor publishes every version into a
:class:`~jsparse.engine.RayFeed`; rollout actors, each its own process with its own JAX runtime
and mesh, apply them, lagging as they like, and survive restarts.

  python -m jsparse.examples.ray_engine            # a local Ray instance, 3 actors
  python -m jsparse.examples.ray_engine --address auto   # on a cluster (after `ray start`)

Each actor gets 8 simulated CPU devices (``XLA_FLAGS``); on accelerators drop the flag and give
the actors GPUs/TPUs. The trainer trains the examples' TinyLM (fp32 masters on an 8-way FSDP
mesh, AdamW at lr 1e-6); rollout "tp4" holds bf16 weights split tensor 4 x data 2, rollout
"tp2" tensor 2 x data 4. They start empty and take an anchor first.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path
from typing import Sequence

import ray

from jsparse.testing import host_device_flags

ACTOR_ENV = {"env_vars": {"XLA_FLAGS": host_device_flags(8),
                          "JAX_PLATFORMS": "cpu"}}


def _bits_hash(tree) -> str:
  """sha256 of every leaf's bit patterns (gathered to this host: a test fixture)."""
  import jax
  import numpy as np
  from jsparse._src.core.bits import np_to_bits
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    h.update(np_to_bits(np.asarray(x)).tobytes())
  return h.hexdigest()


def _save(path: Path, state) -> None:
  import orbax.checkpoint as ocp
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path.absolute(), state, force=True)


def _load(plan, path: Path, shardings):
  import orbax.checkpoint as ocp
  import jsparse
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path.absolute(), jsparse.abstract_sync_state(plan, shardings))


@ray.remote(num_cpus=1, runtime_env=ACTOR_ENV)
class Trainer:
  """The trainer: fp32 masters, FSDP over its 8 devices; publishes a version per step."""

  def __init__(self, feed, state_dir: str, *, restore: bool = False, anchor_every: int = 4):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    import jsparse
    from jsparse import engine
    from jsparse.examples import multihost, rl_model

    cfg = multihost.config()
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    model = rl_model.pretrained_model(cfg)
    self._graphdef, local = nnx.split(model, nnx.Param)
    self._shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                                   multihost.trainer_specs(local))
    self.params = jax.device_put(local, self._shardings)
    self._tx = optax.adamw(cfg.rl_lr)
    self._opt_state = jax.jit(self._tx.init)(self.params)
    self._batches = rl_model.markov_batches(cfg, seed=1)
    self._np = np
    plan = jsparse.make_plan(self.params, rollout_dtype=jnp.bfloat16)
    self._state_dir = Path(state_dir)
    if restore:  # the trainer restarts from its saved params and sender state
      import orbax.checkpoint as ocp
      target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            self.params, self._shardings)
      with ocp.StandardCheckpointer() as checkpointer:
        self.params = checkpointer.restore((self._state_dir / "params").absolute(), target)
      self._opt_state = jax.jit(self._tx.init)(self.params)
      sender = jsparse.Sender.restore(plan, _load(plan, self._state_dir / "sender",
                                                  self._shardings))
    else:
      sender = jsparse.Sender(plan, self.params)
    self.publisher = engine.Publisher(sender, feed, anchor_every=anchor_every, keep=anchor_every)
    self.plan = plan

    self._train_step = multihost.sharded_train_step(self._graphdef, self._tx, self._shardings)

  def step(self, steps: int = 1) -> int:
    """Trains ``steps`` steps, publishing each; returns the version published last."""
    for _ in range(steps):
      self.params, self._opt_state = self._train_step(self.params, self._opt_state,
                                                      self._np.asarray(next(self._batches)))
      self.publisher.publish(self.params)
    return self.publisher.sender.version

  def save(self) -> int:
    """Saves the sender's state and the params to resume from, with Orbax (the optimizer state
    is re-initialized on restore: enough for this example)."""
    _save(self._state_dir / "sender", self.publisher.sender.state())
    _save(self._state_dir / "params", self.params)
    return self.publisher.sender.version

  def status(self) -> dict:
    return {"version": self.publisher.sender.version,
            "bits": _bits_hash(self.plan.cast(self.params)),
            "put_bytes": self.publisher.bytes_put,
            "dense_bytes": self.plan.rollout_bytes}


@ray.remote(num_cpus=1, runtime_env=ACTOR_ENV)
class Rollout:
  """A rollout engine's weights: bf16, split (tensor, data) over its 8 devices."""

  def __init__(self, feed, tensor: int, state_path: str):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    import jsparse
    from jsparse import engine
    from jsparse.examples import multihost

    plan = jsparse.make_plan(multihost.abstract_trainer_params(multihost.config(), 8),
                             rollout_dtype=jnp.bfloat16)
    mesh = multihost.rollout_mesh(tensor)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                             multihost.rollout_specs(plan.rollout_shapes()))
    self._state_path = Path(state_path)
    if self._state_path.exists():  # restarted: resume from the persisted state
      receiver = jsparse.Receiver.restore(plan, _load(plan, self._state_path, shardings))
      self.subscriber = engine.Subscriber(receiver, feed)
    else:  # joins empty: an anchor first
      zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                           plan.rollout_shapes()), out_shardings=shardings)()
      self.subscriber = engine.Subscriber(jsparse.Receiver(plan, zeros), feed,
                                          start_with_anchor=True)
    self.mesh_shape = dict(mesh.shape)

  def poll(self) -> list[int]:
    """Applies what the feed has; returns the versions applied."""
    return self.subscriber.poll()

  def save(self) -> int:
    _save(self._state_path, self.subscriber.receiver.state())
    return self.subscriber.version

  def status(self) -> dict:
    return {"version": self.subscriber.version, "bits": _bits_hash(self.subscriber.params),
            "mesh": self.mesh_shape, "pid": os.getpid(), **vars(self.subscriber.stats)}


def main(argv: Sequence[str] | None = None) -> None:
  import tempfile
  from jsparse import engine
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--address", default=None, help="a Ray cluster (default: start one)")
  parser.add_argument("--steps", type=int, default=6)
  args = parser.parse_args(argv)
  started = not ray.is_initialized()  # (the tests call main() inside their own instance)
  if started and args.address:
    ray.init(address=args.address)
  elif started:  # a local instance on the loopback interface
    ray.init(include_dashboard=False, num_cpus=4, _node_ip_address="127.0.0.1")
  try:
    work = Path(tempfile.mkdtemp(prefix="jsparse_ray_"))
    feed = engine.RayFeed.create(f"jsparse-demo-{os.getpid()}")
    trainer = Trainer.remote(feed, str(work))
    rollouts = {name: Rollout.remote(feed, tensor, str(work / name))
                for name, tensor in (("tp4", 4), ("tp2", 2))}
    for step in range(args.steps):
      version = ray.get(trainer.step.remote())
      polled = ray.get([r.poll.remote() for r in rollouts.values()])
      print(f"version {version}: rollouts applied {dict(zip(rollouts, polled))}")
    want = ray.get(trainer.status.remote())
    for name, rollout in rollouts.items():
      got = ray.get(rollout.status.remote())
      print(name, got["mesh"], "version", got["version"], "bit-identical:",
            got["bits"] == want["bits"], f"deltas {got['deltas']} anchors {got['anchors']}")
    for actor in (trainer, *rollouts.values()):
      ray.kill(actor)
    print(f"the trainer put {want['put_bytes']} bytes (deltas, and anchors every 4 versions) "
          f"once for both rollouts; dense bf16 is {want['dense_bytes']} bytes per version")
  finally:
    if started:
      ray.shutdown()


if __name__ == "__main__":
  main()
