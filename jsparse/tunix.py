"""Sparse weight sync for Tunix (``pip install 'jsparse[tunix]'``, tested with google-tunix 0.1.7).

Tunix's ``RLCluster.sync_weights`` copies the whole actor state to the rollout every step.
:func:`use_sparse_sync` switches a cluster to jsparse: the same GRPO (or PPO, DAPO...) script,
two more lines::

    rl_cluster = rl_cluster_lib.RLCluster(actor=model, reference=ref, tokenizer=tokenizer,
                                          cluster_config=cluster_config)
    sync = jsparse.tunix.use_sparse_sync(rl_cluster)        # <- the switch
    grpo_learner.GRPOLearner(rl_cluster, reward_fns=..., algo_config=...).train(dataset)
    print(sync.records[-1].payload_bytes, sync.records[-1].dense_bytes)

Every sync then moves only the rollout elements whose bits changed; the rollout's params after
it are bit-identical to the trainer's cast to the rollout dtype (the receiver checks the digest).
A rollout that serves qwix PTQ-quantized weights (``qwix.quantize_model``) is synced into its
codes and scales, bit for bit (see :mod:`jsparse.quantized`). With ``feed=`` the syncs go through
an engine feed (:class:`~jsparse.engine.DirectoryFeed`,
:class:`~jsparse.engine.RayFeed`) that rollout jobs in other processes follow with
:class:`RolloutSubscriber`.
"""

from __future__ import annotations

from typing import Any

import jax

from jsparse._src.core.plan import Plan
from jsparse._src.planning import make_plan
from jsparse._src.engine.feed import Feed
from jsparse._src.engine.signing import SigningKey
from jsparse._src.engine.subscriber import Subscriber
from jsparse._src.errors import PlanMismatchError, TunixVersionError
from jsparse._src.pytree import PyTree
from jsparse._src.sync.receiver import Receiver
from jsparse._src.sync.sender import Sender
from jsparse._src.tunix import compat
from jsparse._src.tunix.compat import TESTED_TUNIX_VERSION
from jsparse._src.tunix.links import FeedLink, InProcessLink
from jsparse._src.tunix.quantized import RolloutStructure, ptq_rule
from jsparse._src.tunix.rollout import SparseRollout, SyncRecord


def sync_filter(model: Any) -> tuple:
  """The variable types Tunix syncs for ``model``: ``(nnx.LoRAParam,)`` when LoRA is on, else
  ``(nnx.Param,)`` (as ``RLCluster.sync_weights`` chooses).

  >>> from flax import nnx
  >>> [t.__name__ for t in sync_filter(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))]
  ['Param']
  """
  from flax import nnx
  is_lora_enabled = compat.tunix_attr("tunix.sft.utils", "is_lora_enabled")
  return (nnx.LoRAParam if is_lora_enabled(model) else nnx.Param,)


def tunix_plan(trainer_state: PyTree, rollout_state: PyTree, *, capacity: float = 0.05,
               pooled_capacity: float = 1.0, quantize: Any = None) -> Plan:
  """The plan for syncing ``trainer_state`` into ``rollout_state``: each leaf goes to the dtype
  the rollout holds it in. Both may be abstract (``jax.ShapeDtypeStruct``, e.g. from
  ``nnx.eval_shape``), so a rollout job builds the same plan as the trainer without its arrays.

  A rollout that serves qwix-quantized weights (``qwix.quantize_model`` with a ``PtqProvider``)
  needs ``quantize=ptq_rule(rollout_model)``: those weights then sync as the codes and scales
  the rollout holds (see :mod:`jsparse.quantized`).

  Raises:
    PlanMismatchError: the two states differ in structure (the first differing leaf is named).

  >>> import jax.numpy as jnp
  >>> plan = tunix_plan({'w': jnp.zeros(4)}, {'w': jnp.zeros(4, jnp.bfloat16)})
  >>> plan.leaves[0].dtype, plan.leaves[0].rollout_dtype
  (dtype('float32'), dtype(bfloat16))
  """
  trainer = jax.tree.flatten_with_path(trainer_state)[0]
  rollout = jax.tree.flatten_with_path(rollout_state)[0]
  dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in rollout}
  if quantize is not None:  # quantized weights: the rollout's leaves are their codes and scales
    def rollout_dtype(path: str, _) -> Any:
      if path not in dtypes:
        raise PlanMismatchError(f"jsparse.tunix: trainer leaf {path} is not quantized by the "
                                "rollout and the rollout holds no leaf there")
      return dtypes[path]
    plan = make_plan(trainer_state, rollout_dtype=rollout_dtype, capacity=capacity,
                     pooled_capacity=pooled_capacity, quantize=quantize)
    RolloutStructure.of(plan, rollout_state)  # the same leaves, in order
    return plan
  for (path, x), (rpath, r) in zip(trainer, rollout):
    if path != rpath or x.shape != r.shape:
      raise PlanMismatchError(
          f"jsparse.tunix: trainer leaf {jax.tree_util.keystr(path)} {x.shape} does not match "
          f"rollout leaf {jax.tree_util.keystr(rpath)} {r.shape}")
  if len(trainer) != len(rollout):
    raise PlanMismatchError(f"jsparse.tunix: the trainer syncs {len(trainer)} leaves, the "
                            f"rollout holds {len(rollout)}")
  return make_plan(trainer_state, rollout_dtype=lambda path, _: dtypes[path], capacity=capacity,
                   pooled_capacity=pooled_capacity)


def use_sparse_sync(rl_cluster: Any, *, feed: Feed | None = None, coding: str = "positioned",
                    capacity: float = 0.05, donate: bool = True,
                    chunk_bytes: int = 64 << 20, key: SigningKey | None = None) -> SparseRollout:
  """Makes ``rl_cluster``'s weight syncs sparse; returns the :class:`SparseRollout` now in it.

  Call it after building the ``RLCluster`` (LoRA already applied) and before training. The
  trainer's current params are the base; if the rollout holds other bits (digests differ), the
  first sync is a dense anchor.

  Args:
    rl_cluster: a ``tunix.rl.rl_cluster.RLCluster``.
    feed: send through this engine feed (other rollout jobs may follow it with
      :class:`RolloutSubscriber`); None: payloads go straight to the rollout in this process.
    coding, capacity: as for :class:`~jsparse.Sender` and :func:`~jsparse.make_plan`.
    donate: the rollout's params are updated in place (the receiver's buffers are handed to the
      rollout; do not generate during a sync, which Tunix does not).
    chunk_bytes: with ``feed``, the size of each streamed part.
    key: with ``feed``, sign every version with this key and apply only versions it verifies
      (:class:`~jsparse.engine.HmacKey`, or an :class:`~jsparse.engine.Ed25519Key` with its
      private key; rollout jobs following the feed get the key or the public key).

  Raises:
    TunixVersionError: Tunix is missing or its API changed (names the tested version).

  >>> from jsparse.examples import tunix_grpo
  >>> rl_cluster = tunix_grpo.build_cluster()  # GRPO on a tiny Qwen3; needs 4 devices
  >>> sync = use_sparse_sync(rl_cluster)
  >>> rl_cluster.rollout is sync, sync.link.receiver.version
  (True, 0)
  """
  from flax import nnx
  trainer = compat.require(compat.require(rl_cluster, "actor_trainer", "RLCluster"), "model",
                           "RLCluster.actor_trainer")
  compat.require(rl_cluster, "_rollout", "RLCluster")
  inner = rl_cluster.rollout
  filter_types = sync_filter(trainer)
  trainer_state = nnx.state(trainer, filter_types)
  rollout_state = nnx.state(inner.model(), filter_types)
  plan = tunix_plan(trainer_state, rollout_state, capacity=capacity,
                    quantize=ptq_rule(inner.model()))
  structure = RolloutStructure.of(plan, rollout_state)
  sender = Sender(plan, trainer_state, coding=coding)
  receiver = Receiver(plan, structure.to_view(rollout_state), donate=donate)
  anchor_first = sender.digest != receiver.digest
  link = (InProcessLink(sender, receiver, anchor_first=anchor_first) if feed is None else
          FeedLink(sender, receiver, feed, anchor_first=anchor_first, chunk_bytes=chunk_bytes,
                   key=key))
  rollout = SparseRollout(inner, link, filter_types, structure)
  rl_cluster._rollout = rollout  # pylint: disable=protected-access
  return rollout


class RolloutSubscriber:
  """A Tunix rollout in its own job, following a trainer's feed.

  Args:
    rollout: any Tunix ``BaseRollout`` (its model holds the rollout's params).
    plan: the trainer's plan (:func:`tunix_plan` from the same abstract states).
    feed: the trainer's feed.
    version: the version the rollout's current params are (0: the trainer's initial params);
      when they are not, the first thing applied is an anchor.
    key: apply only versions this key verifies (the trainer's key, or its public key).

  >>> import tempfile, jax, jsparse
  >>> from flax import nnx
  >>> from jsparse import engine
  >>> class Rollout:  # stands for a Tunix rollout, in a job of its own
  ...   def __init__(self):
  ...     self.net = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  ...   def model(self):
  ...     return self.net
  ...   def update_params(self, params, filter_types):
  ...     nnx.update(self.net, params)
  >>> trainer = nnx.state(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Param)  # version 0
  >>> plan = tunix_plan(trainer, trainer)
  >>> feed = engine.DirectoryFeed(tempfile.mkdtemp())
  >>> publisher = engine.Publisher(jsparse.Sender(plan, trainer), feed)  # in the trainer job
  >>> follower = RolloutSubscriber(Rollout(), plan, feed)
  >>> _ = publisher.publish(jax.tree.map(lambda x: x + 1, trainer))
  >>> follower.poll(), float(follower.rollout.net.bias[0])
  ([1], 1.0)
  """

  def __init__(self, rollout: Any, plan: Plan, feed: Feed, *, version: int = 0,
               donate: bool = True, filter_types: tuple | None = None,
               key: SigningKey | None = None):
    from flax import nnx
    self.rollout = rollout
    self.filter_types = filter_types or sync_filter(rollout.model())
    state = nnx.state(rollout.model(), self.filter_types)
    self.structure = RolloutStructure.of(plan, state)
    self.subscriber = Subscriber(Receiver(plan, self.structure.to_view(state), version=version,
                                          donate=donate), feed, key=key)

  @property
  def version(self) -> int | None:
    return self.subscriber.version

  @property
  def weights(self):
    """The version and digest of the weights the rollout generates with (stamp samples)."""
    return self.subscriber.weights

  def poll(self) -> list[int]:
    """Applies every version in the feed now and installs the newest into the rollout; returns
    the versions applied."""
    with jax.transfer_guard("allow"):
      applied = self.subscriber.poll()
      if applied:
        self.rollout.update_params(self.structure.to_rollout(self.subscriber.params),
                                   self.filter_types)
    return applied


__all__ = ["RolloutSubscriber", "SparseRollout", "SyncRecord", "TESTED_TUNIX_VERSION",
           "TunixVersionError", "ptq_rule", "sync_filter", "tunix_plan", "use_sparse_sync"]
