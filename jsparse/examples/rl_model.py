"""A small Flax NNX language model and an RL-like update regime to drive weight syncs.

The model is "pretrained" briefly at a normal learning rate on a synthetic Markov-chain corpus,
so its weights have a trained (not just initialized) distribution; then fine-tuning steps run in
the RL post-training regime: fp32 masters, optax AdamW at a learning rate around 1e-6, on a
shifted data distribution. Each step changes ~1% of the bf16 rollout copy's elements.

>>> import jax.numpy as jnp
>>> model = TinyLM(vocab=64, dim=32, depth=1, rngs=nnx.Rngs(0))
>>> sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
12640
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class Block(nnx.Module):
  """Pre-norm residual MLP block."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TinyLM(nnx.Module):
  """Next-token model: embedding, ``depth`` residual MLP blocks, final norm, output head."""

  def __init__(self, vocab: int, dim: int, depth: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, rngs=rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes and schedule. The defaults give a ~2.6M-parameter model.

  Attributes:
    vocab, dim, depth: the model's vocabulary, width and residual blocks.
    batch, seq: sequences per batch and tokens per sequence.
    pretrain_steps, pretrain_lr: the AdamW pretraining that makes the weights realistic.
    rl_lr: the AdamW learning rate of the RL-like steps after it.
    seed: of the model's initialization and of the data.
  """

  vocab: int = 2048
  dim: int = 256
  depth: int = 4
  batch: int = 32
  seq: int = 64
  pretrain_steps: int = 30
  pretrain_lr: float = 3e-3
  rl_lr: float = 1e-6
  seed: int = 0


def markov_batches(cfg: Config, seed: int) -> Iterator[jax.Array]:
  """Endless batches of token sequences from a random sparse Markov chain (seeded)."""
  rng = np.random.default_rng(seed)
  successors = rng.integers(0, cfg.vocab, size=(cfg.vocab, 4))
  while True:
    tokens = np.empty((cfg.batch, cfg.seq), np.int32)
    tokens[:, 0] = rng.integers(0, cfg.vocab, cfg.batch)
    for t in range(1, cfg.seq):
      tokens[:, t] = successors[tokens[:, t - 1], rng.integers(0, 4, cfg.batch)]
    yield jnp.asarray(tokens)


def loss(model: TinyLM, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of ``model`` on a batch of ``tokens``."""
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: TinyLM, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
  """One optimizer step on a batch; returns the loss."""
  value, grads = nnx.value_and_grad(loss)(model, tokens)
  optimizer.update(model, grads)
  return value


def pretrained_model(cfg: Config = Config()) -> TinyLM:
  """A TinyLM trained for ``cfg.pretrain_steps`` steps of AdamW at ``cfg.pretrain_lr``."""
  model = TinyLM(cfg.vocab, cfg.dim, cfg.depth, rngs=nnx.Rngs(cfg.seed))
  optimizer = nnx.Optimizer(model, optax.adamw(cfg.pretrain_lr), wrt=nnx.Param)
  batches = markov_batches(cfg, cfg.seed)
  for _ in range(cfg.pretrain_steps):
    train_step(model, optimizer, next(batches))
  return model


def rl_finetuning(cfg: Config = Config()) -> tuple[TinyLM, nnx.Optimizer, Iterator[jax.Array]]:
  """The pretrained model, an AdamW(``cfg.rl_lr``) optimizer on its fp32 params, and a shifted
  data stream: call ``train_step(model, optimizer, next(batches))`` for each RL-like step."""
  model = pretrained_model(cfg)
  optimizer = nnx.Optimizer(model, optax.adamw(cfg.rl_lr), wrt=nnx.Param)
  return model, optimizer, markov_batches(cfg, cfg.seed + 1)
