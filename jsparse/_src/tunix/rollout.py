"""A Tunix rollout whose weight syncs travel as jsparse payloads.

Tunix's ``RLCluster.sync_weights`` hands the actor's filtered state to
``rollout.update_params(params, filter_types)``, which reshards it onto the rollout mesh (fp32,
the trainer's dtype) and casts it there: a dense copy of the model every step.
:class:`SparseRollout` wraps any ``BaseRollout``: its ``update_params`` sends the params through
a jsparse link (a payload of the changed bf16 elements, checked by version and digest) and hands
the receiver's params, already in the rollout's dtypes and layout, to the wrapped rollout's own
``update_params``. Everything else (generation, log-probs, ids, the model) is the wrapped
rollout's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from jsparse._src.errors import ConfigError
from jsparse._src.pytree import PyTree
from jsparse._src.tunix import compat
from jsparse._src.tunix.links import Link
from jsparse._src.tunix.quantized import RolloutStructure

BaseRollout = compat.tunix_attr("tunix.rl.rollout.base_rollout", "BaseRollout")


@dataclasses.dataclass(frozen=True)
class SyncRecord:
  """One weight sync through jsparse.

  Attributes:
    version: the version the rollout holds after it.
    changed: rollout elements whose bits changed.
    elements: elements in the synced state.
    payload_bytes: bytes that travelled.
    dense_bytes: what Tunix's dense sync moves for the same state (the trainer's arrays, before
      its cast on the rollout side).
    seconds: wall time of the whole sync (send, receive, install), on the host clock.
    digest: the digest (hex) of the weights the rollout generates with after it, verified
      against the trainer's: stamp samples with it and ``version``.

  >>> record = SyncRecord(3, changed=900, elements=100_000, payload_bytes=1_000,
  ...                     dense_bytes=400_000, seconds=0.08)
  >>> record.density, record.reduction
  (0.009, 400.0)
  """
  version: int
  changed: int
  elements: int
  payload_bytes: int
  dense_bytes: int
  seconds: float
  digest: str = ""

  @property
  def density(self) -> float:
    return self.changed / max(1, self.elements)

  @property
  def reduction(self) -> float:
    """How many times fewer bytes than the dense sync."""
    return self.dense_bytes / max(1, self.payload_bytes)


class SparseRollout(BaseRollout):
  """Wraps a Tunix rollout so that trainer syncs arrive as jsparse payloads.

  Made by :func:`jsparse.tunix.use_sparse_sync`, which also builds the link. ``update_params``
  calls with Tunix's sync filter go through the link; other calls (Tunix's CPU offloading hands
  the rollout its own state back) go to the wrapped rollout unchanged.

  Args:
    inner: the rollout Tunix built (e.g. ``VanillaRollout``).
    link: carries each sync from the trainer's params to the rollout's receiver.
    filter_types: the ``nnx`` variable types Tunix syncs (``(nnx.Param,)``, or
      ``(nnx.LoRAParam,)`` with LoRA); the plan covers exactly that state.
    structure: how the rollout model holds the plan's rollout tree, when they differ (a qwix
      PTQ model's quantized weights); None: as the receiver holds it.

  Attributes:
    records: one :class:`SyncRecord` per sync, in order.

  >>> import jax.numpy as jnp, jsparse
  >>> from jsparse._src.tunix.links import InProcessLink
  >>> class Printer:  # stands for a Tunix rollout
  ...   def update_params(self, params, filter_types=None):
  ...     print(params['w'].dtype, filter_types)
  >>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
  >>> link = InProcessLink(jsparse.Sender(plan, {'w': jnp.zeros(8)}),
  ...                      jsparse.Receiver(plan, {'w': jnp.zeros(8, jnp.bfloat16)}))
  >>> rollout = SparseRollout(Printer(), link, ('Param',))
  >>> rollout.update_params({'w': jnp.ones(8)}, ('Param',))
  bfloat16 ('Param',)
  >>> rollout.records[0].version, rollout.records[0].changed
  (1, 8)
  """

  def __init__(self, inner: Any, link: Link, filter_types: tuple,  # pylint: disable=super-init-not-called
               structure: RolloutStructure | None = None):
    self.inner = inner
    self.link = link
    self.filter_types = tuple(filter_types)
    self.structure = structure  # how the rollout holds the plan's tree (quantized weights)
    self.records: list[SyncRecord] = []
    plan = link.sender.plan
    self._dense_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in plan.leaves)

  def update_params(self, params: PyTree, filter_types: tuple | None = None) -> None:
    if filter_types is None:  # not a sync: Tunix moving the rollout's own state around
      self.inner.update_params(params, filter_types)
      return
    if tuple(filter_types) != self.filter_types:
      raise ConfigError(f"jsparse.tunix: this rollout syncs {self.filter_types}, but Tunix "
                        f"synced {tuple(filter_types)}; call use_sparse_sync after LoRA is set up")
    start = time.perf_counter()
    # The payload is host bytes by design; Tunix forbids host transfers around its dense
    # device-to-device reshard on CPU, which this sync does not use.
    with jax.transfer_guard("allow"):
      moved = self.link.sync(params)
      params = self.link.receiver.params
      self.inner.update_params(params if self.structure is None
                               else self.structure.to_rollout(params), filter_types)
      jax.block_until_ready(self.link.receiver.params)
    self.records.append(SyncRecord(moved.version, moved.changed, self.link.sender.plan.num_elements,
                                   moved.payload_bytes, self._dense_bytes,
                                   time.perf_counter() - start,
                                   self.link.receiver.digest.hex()))

  def generate(self, prompts, rollout_config, **kwargs):
    return self.inner.generate(prompts, rollout_config, **kwargs)

  def get_per_token_logps(self, prompt_tokens, completion_tokens):
    return self.inner.get_per_token_logps(prompt_tokens, completion_tokens)

  def pad_id(self) -> int:
    return self.inner.pad_id()

  def eos_id(self) -> int:
    return self.inner.eos_id()

  def model(self) -> Any:
    return self.inner.model()

  def __getattr__(self, name: str) -> Any:  # engine-specific extras of the wrapped rollout
    if name == "inner":
      raise AttributeError(name)
    return getattr(self.inner, name)
