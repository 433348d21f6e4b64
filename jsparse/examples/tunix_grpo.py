"""Tunix's GRPO learner on a tiny Qwen3 from Tunix's model zoo, with dense or jsparse syncs.

The trainer (fp32, AdamW) and the rollout (bf16, Tunix's ``VanillaRollout``) sit on two meshes
of the same devices, so Tunix really syncs weights after every step. ``run_grpo(sparse=False)``
is Tunix as it ships; ``run_grpo(sparse=True)`` adds one line, ``use_sparse_sync(rl_cluster)``.
Everything is random-initialized, nothing is downloaded. Needs 4 devices (on CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=4``) and ``pip install 'jsparse[tunix]'``.

>>> from jsparse.examples import tunix_grpo
>>> tunix_grpo.WordTokenizer(8).decode(tunix_grpo.WordTokenizer(8).encode("w3 w4"))
'w3 w4'
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

import numpy as np

PROMPTS = ["w3 w4", "w5 w6 w7", "w8", "w9 w10", "w4 w3 w11", "w12 w5"]


class WordTokenizer:
  """Words ``w0 .. w{vocab-1}``; 0 pads, 1 begins, 2 ends (what Tunix's sampler asks of a
  tokenizer: encode, decode, bos_id, eos_id, pad_id)."""

  def __init__(self, vocab: int):
    self.vocab = vocab

  def encode(self, text: str, **_) -> list[int]:
    return [int(w[1:]) for w in text.split() if w[1:].isdigit() and int(w[1:]) < self.vocab]

  def decode(self, ids, **_) -> str:
    return " ".join(f"w{int(i)}" for i in ids)

  def bos_id(self) -> int:
    return 1

  def eos_id(self) -> int:
    return 2

  def pad_id(self) -> int:
    return 0


Size = collections.namedtuple("Size", "vocab layers dim hidden heads head_dim",
                              defaults=(32, 2, 64, 128, 4, 16))
Size.__doc__ = """A Qwen3 config small enough for CPU: vocabulary, decoder layers, model width, MLP
width, attention heads and the width of each head (e.g. ``Size(dim=128, hidden=256)``)."""


def qwen3_config(size: Size):
  from tunix.models.qwen3 import model as qwen3
  return qwen3.ModelConfig(num_layers=size.layers, vocab_size=size.vocab, embed_dim=size.dim,
                           hidden_dim=size.hidden, num_heads=size.heads, head_dim=size.head_dim,
                           num_kv_heads=size.heads, rope_theta=10_000, norm_eps=1e-6)


def reward_even_words(prompts, completions, **_) -> list[float]:
  """A reward the policy can learn: the number of even-numbered words in the completion."""
  del prompts
  return [float(sum(int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


@dataclasses.dataclass
class GrpoRun:
  """What one run produced.

  Attributes:
    losses: the actor's loss per train step (Tunix's metrics logger).
    rewards: the mean reward per step.
    sync_seconds: wall time of each ``rollout.update_params`` (the sync itself).
    synced: per sync, the trainer's params and the rollout's params right after it (host copies).
    sparse: the ``SparseRollout`` (its ``records``) when jsparse synced, else None.
  """
  losses: list[float]
  rewards: list[float]
  sync_seconds: list[float]
  synced: list[tuple[dict, dict]]
  sparse: Any = None


def _meshes():
  import jax
  devices = np.array(jax.devices()[:4])
  if devices.size < 4:
    raise RuntimeError("tunix_grpo needs 4 devices (XLA_FLAGS="
                       "--xla_force_host_platform_device_count=4 on CPU)")
  # Same devices, another order: Tunix reshards on device (its CPU guard forbids host copies).
  actor = jax.sharding.Mesh(devices.reshape(2, 2), ("fsdp", "tp"))
  rollout = jax.sharding.Mesh(devices[::-1].reshape(2, 2), ("fsdp", "tp"))
  return actor, rollout


def _host_state(model) -> dict:
  import jax
  from flax import nnx
  flat = jax.tree.flatten_with_path(nnx.state(model, nnx.Param))[0]
  with jax.transfer_guard("allow"):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def pretrained_like(model, std: float, seed: int = 0):
  """``model`` with every matrix drawn from N(0, ``std``^2) (norm scales stay 1): the weight
  scale of a pretrained transformer, where a bf16 ulp is ~1e-4, instead of Tunix's init (zero
  MLP kernels, attention weights of ~0.01)."""
  import jax
  from flax import nnx
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [std * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
            for k, x in zip(keys, leaves)]
  return nnx.merge(graph, jax.tree.unflatten(treedef, leaves), rest)


def with_lora(model, rank: int):
  """``model`` with qwix LoRA adapters of ``rank`` on the attention's q and v and the MLP's up
  projection (Tunix then trains and syncs only the ``nnx.LoRAParam``s)."""
  import qwix
  from flax import nnx
  provider = qwix.LoraProvider(module_path=".*q_proj|.*v_proj|.*up_proj", rank=rank, alpha=2.0)
  return qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1), **model.get_model_input())


def build_cluster(size: Size = Size(), *, steps: int = 3, learning_rate: float = 1e-5,
                  new_tokens: int = 8, init_std: float | None = None,
                  lora_rank: int | None = None):
  """A Tunix ``RLCluster`` (actor, reference, bf16 vanilla rollout) for GRPO on ``size``;
  ``init_std``: weights :func:`pretrained_like` instead of Tunix's init; ``lora_rank``: the
  actor trains LoRA adapters (:func:`with_lora`)."""
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import rl_cluster as rl
  from tunix.rl.rollout import base_rollout

  actor_mesh, rollout_mesh = _meshes()
  config = qwen3_config(size)
  cluster_config = rl.ClusterConfig(
      role_to_mesh={rl.Role.ACTOR: actor_mesh, rl.Role.REFERENCE: actor_mesh,
                    rl.Role.ROLLOUT: rollout_mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl.RLTrainingConfig(actor_optimizer=optax.adamw(learning_rate),
                                          eval_every_n_steps=1_000, max_steps=steps),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=new_tokens, max_prompt_length=8, kv_cache_size=64,
          data_type=jnp.bfloat16, temperature=0.9))
  def model():
    built = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
    return built if init_std is None else pretrained_like(built, init_std)
  actor = model() if lora_rank is None else with_lora(model(), lora_rank)
  return rl.RLCluster(actor=actor, reference=model(),
                      tokenizer=WordTokenizer(size.vocab), cluster_config=cluster_config)


def quantize_rollout(rl_cluster, qtype: str = "float8_e4m3fn",
                     module_path: str = ".*(gate_proj|up_proj|down_proj)") -> None:
  """Makes ``rl_cluster``'s rollout serve qwix-quantized weights: a ``VanillaRollout`` of a qwix
  PTQ copy of its model (``qwix.quantize_model`` with a ``PtqProvider``), the weights of the
  modules matching ``module_path`` quantized to ``qtype`` with a scale per output channel.
  Tunix 0.1.7 has no option for this (its rollout is built from the actor); and its Qwen3 serves
  PTQ weights in the MLP's ``nnx.Linear`` layers only (its attention ``Einsum`` layers call
  ``jnp.astype`` on the weight, which a PTQ weight is not). Tunix's own dense sync cannot fill
  such a rollout (the trees differ), nor can its ``GRPOLearner`` be built on it (its check for
  shared weights maps the actor's and the rollout's states together); ``RLCluster.sync_weights``
  with :func:`jsparse.tunix.use_sparse_sync` syncs it."""
  import jax.numpy as jnp
  import qwix
  from tunix.rl.rollout import base_rollout, vanilla_rollout
  model = rl_cluster.rollout.model()
  rule = qwix.QtRule(module_path=module_path, weight_qtype=jnp.dtype(qtype))
  quantized = qwix.quantize_model(model, qwix.PtqProvider([rule]), **model.get_model_input())
  config = model.config
  rl_cluster._rollout = vanilla_rollout.VanillaRollout(  # pylint: disable=protected-access
      quantized, rl_cluster.tokenizer, base_rollout.CacheConfig(
          cache_size=rl_cluster.cluster_config.rollout_config.kv_cache_size,
          num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
          head_dim=config.head_dim))


def dataset(batch: int = 2):
  """The prompts as a grain dataset of ``batch``-sized batches (``prompts`` and ``answer``)."""
  from grain import python as grain

  class Prompts(grain.RandomAccessDataSource):
    def __getitem__(self, i):
      return PROMPTS[i % len(PROMPTS)]

    def __len__(self):
      return 64
  return grain.MapDataset.source(Prompts()).batch(batch).map(
      lambda x: {"prompts": x, "answer": x})


def _observe(rl_cluster, seconds: list, synced: list, keep_states: bool) -> None:
  """Times every ``rollout.update_params`` of a sync and keeps both sides' params after it."""
  sync_weights = rl_cluster.sync_weights

  def timed_update(update: Callable) -> Callable:
    def update_params(params, filter_types=None):
      start = time.perf_counter()
      update(params, filter_types)
      if filter_types is not None:
        import jax
        from flax import nnx
        jax.block_until_ready(nnx.state(rl_cluster.rollout.model(), nnx.Param))
        seconds.append(time.perf_counter() - start)
    return update_params

  rollout = rl_cluster.rollout
  rollout.update_params = timed_update(rollout.update_params)

  def observed_sync():
    sync_weights()
    if keep_states:
      synced.append((_host_state(rl_cluster.actor_trainer.model),
                     _host_state(rl_cluster.rollout.model())))
  rl_cluster.sync_weights = observed_sync


def run_grpo(*, sparse: bool, size: Size = Size(), steps: int = 3, batch: int = 2,
             keep_states: bool = True, init_std: float | None = None,
             learning_rate: float = 1e-5, lora_rank: int | None = None,
             **sync_options) -> GrpoRun:
  """Runs Tunix's GRPO learner for ``steps`` steps, syncing densely (Tunix) or with jsparse
  (``sync_options`` go to :func:`jsparse.tunix.use_sparse_sync`)."""
  from tunix.rl.grpo import grpo_learner
  from jsparse import tunix as jtunix

  rl_cluster = build_cluster(size, steps=steps, init_std=init_std, learning_rate=learning_rate,
                             lora_rank=lora_rank)
  rollout = jtunix.use_sparse_sync(rl_cluster, **sync_options) if sparse else None
  seconds: list[float] = []
  synced: list = []
  _observe(rl_cluster, seconds, synced, keep_states)
  learner = grpo_learner.GRPOLearner(
      rl_cluster=rl_cluster, reward_fns=reward_even_words,
      algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04))
  if not learner.should_sync_weights:
    raise RuntimeError("Tunix does not sync weights in this set-up (shared weights)")
  learner.train(dataset(batch))
  metrics = rl_cluster.actor_trainer.metrics_logger
  losses = [float(x) for x in metrics.get_metric_history("actor", "loss", "train")]
  rewards = [float(x) for x in
             rl_cluster._rl_metrics_logger.get_metric_history("rewards", "sum", "train")]  # pylint: disable=protected-access
  return GrpoRun(losses, rewards, seconds, synced, rollout)


def abstract_trainer_state(size: Size = Size()):
  """The trainer's synced state as shapes on an abstract copy of its mesh: what a rollout job
  builds the plan from, without the trainer's arrays or devices."""
  import jax
  from flax import nnx
  from jax.sharding import AbstractMesh, AxisType, NamedSharding
  from tunix.models.qwen3 import model as qwen3
  shapes = nnx.state(nnx.eval_shape(lambda: qwen3.Qwen3(qwen3_config(size), rngs=nnx.Rngs(0))),
                     nnx.Param)
  mesh = AbstractMesh((2, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
  specs = nnx.get_partition_spec(shapes)
  return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=NamedSharding(mesh, spec)),
                      shapes, specs)


def rollout_job(size: Size = Size()):
  """A rollout job's own Tunix ``VanillaRollout``: the model built from the same seed as the
  trainer's (version 0), cast to bf16 and laid out on this job's rollout mesh."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl.rollout import base_rollout, vanilla_rollout
  _, mesh = _meshes()
  graph, state = nnx.split(qwen3.Qwen3(qwen3_config(size), rngs=nnx.Rngs(0)))
  shardings = jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec),
                           nnx.get_partition_spec(state))
  model = nnx.merge(graph, jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state),
                                          shardings))
  return vanilla_rollout.VanillaRollout(model, WordTokenizer(size.vocab), base_rollout.CacheConfig(
      cache_size=64, num_layers=size.layers, num_kv_heads=size.heads, head_dim=size.head_dim))


def follow(feed_dir: str, until: int, out: str, size: Size = Size(), timeout: float = 120.0):
  """The rollout job: follows the trainer's directory feed until version ``until``, then writes
  its rollout's params (bf16 bit patterns) to the ``.npz`` file ``out``."""
  from jsparse import engine
  from jsparse import tunix as jtunix
  rollout = rollout_job(size)
  plan = jtunix.tunix_plan(abstract_trainer_state(size), _abstract(rollout))
  follower = jtunix.RolloutSubscriber(rollout, plan, engine.DirectoryFeed(feed_dir))
  deadline = time.monotonic() + timeout
  while (follower.version or 0) < until:  # None: no version of the trainer's yet
    if time.monotonic() > deadline:
      raise TimeoutError(f"rollout job: at version {follower.version}, waited for {until}")
    follower.poll() or time.sleep(0.1)
  np.savez(out, **{k: v.view(np.uint16) for k, v in _host_state(rollout.model()).items()})
  return follower.version


def _abstract(rollout):
  import jax
  from flax import nnx
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      nnx.state(rollout.model(), nnx.Param))


if __name__ == "__main__":
  import argparse
  import os
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  parser = argparse.ArgumentParser(description="A Tunix rollout job following a jsparse feed.")
  parser.add_argument("--feed", required=True)
  parser.add_argument("--until", type=int, required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  print("rollout job at version", follow(args.feed, args.until, args.out), flush=True)
