"""The realistic workload of the benchmarks: RL-like AdamW steps on a briefly pretrained TinyLM.

fp32 masters, optax AdamW at lr 1e-6, a bf16 rollout copy: the regime of RL post-training.

>>> from jsparse.examples import rl_model
>>> cfg = rl_model.Config(vocab=64, dim=16, depth=1, batch=2, seq=8, pretrain_steps=1)
>>> [len(jax.tree.leaves(s)) for s in realistic_run(cfg, steps=2)]
[11, 11, 11]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jsparse.examples import rl_model


def benchmark_config(dim: int = 512, depth: int = 6, vocab: int = 8192, pretrain_steps: int = 300,
                     lr: float = 1e-6) -> rl_model.Config:
  """The default benchmark model: ~21M parameters."""
  return rl_model.Config(vocab=vocab, dim=dim, depth=depth, batch=8, seq=32,
                         pretrain_steps=pretrain_steps, rl_lr=lr)


def realistic_run(cfg: rl_model.Config, steps: int) -> list:
  """The fp32 params before and after each of ``steps`` RL-like optimizer steps."""
  model, optimizer, batches = rl_model.rl_finetuning(cfg)
  states = [jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))]
  for _ in range(steps):
    rl_model.train_step(model, optimizer, next(batches))
    states.append(jax.tree.map(jnp.copy, nnx.state(model, nnx.Param)))
  return states
