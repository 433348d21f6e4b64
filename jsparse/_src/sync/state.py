"""The resumable state of a :class:`~jsparse.Sender` or :class:`~jsparse.Receiver`.

:class:`SyncState` is a tree of arrays that Orbax saves as it is (``ocp.args.StandardSave``):
the version, the 64-bit digest of the synced params' bit patterns, the plan fingerprint and the
params. A restarted trainer or rollout restores it (onto any sharding, with
:func:`abstract_sync_state` as the target) and resumes without a full resend; the restored
params are checked against the saved digest.

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(3)}, rollout_dtype=jnp.bfloat16)
>>> state = jsparse.Sender(plan, {'w': jnp.zeros(3)}).state()
>>> int(state.version), state.params['w'].dtype
(0, dtype(bfloat16))
>>> jsparse.Receiver.restore(plan, state, donate=False).version
0
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np

from jsparse._src.core.plan import Plan
from jsparse._src.errors import IntegrityError, PlanMismatchError, VersionError
from jsparse._src.pytree import PyTree


class SyncState(NamedTuple):
  """What a sender or receiver needs to resume.

  Attributes:
    version: ``int64`` scalar, the synced version.
    digest: ``uint32[2]``, the digest of ``params``' bit patterns (payloads carry it bound to
      the version, see :func:`versioned_digest`).
    plan: ``uint8[16]``, the plan's fingerprint.
    params: the synced tree, in rollout dtypes; a zero-size leaf is stored as a one-element
      placeholder (Orbax refuses zero-size arrays), restored to its shape on resume.
    run: ``uint8[16]``, the identity of the run (the feed) the state belongs to; zeros: none
      known (a sender or receiver that never joined a feed).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(3)})
  >>> state = jsparse.SyncState.of(plan, 5, bytes(8), {'w': jnp.zeros(3)})
  >>> int(state.version), state.digest.tolist(), state._fields
  (5, [0, 0], ('version', 'digest', 'plan', 'params', 'run'))
  """

  version: Any
  digest: Any
  plan: Any
  params: PyTree
  run: Any = None

  @classmethod
  def of(cls, plan: Plan, version: int, digest: bytes, params: PyTree,
         run: bytes | None = None) -> "SyncState":
    """The state of ``params`` at ``version`` with an 8-byte ``digest``, of run ``run`` (16
    bytes, or None)."""
    return cls(np.array(version, np.int64), np.frombuffer(digest, "<u4").astype(np.uint32),
               np.frombuffer(plan.fingerprint, np.uint8).copy(), storable(plan, params),
               np.frombuffer(run or bytes(RUN_BYTES), np.uint8).copy())


RUN_BYTES = 16


def state_run(state: Any) -> bytes | None:
  """The run id a :class:`SyncState` (or its mapping) belongs to; None if none is known (zeros,
  or a state saved without one)."""
  run = state.get("run") if isinstance(state, Mapping) else getattr(state, "run", None)
  if run is None:
    return None
  run = np.asarray(run, np.uint8).tobytes()
  if len(run) != RUN_BYTES:
    raise PlanMismatchError(f"sync state: run must be uint8[{RUN_BYTES}], got {len(run)} bytes "
                            "(damaged, or not a jsparse.SyncState): restore another step")
  return run if any(run) else None


def abstract_sync_state(plan: Plan, shardings: PyTree | None = None) -> SyncState:
  """The abstract target to restore a :class:`SyncState` onto, its params placed by
  ``shardings`` (a tree of shardings with the plan's structure; None: the default device).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(3)}, rollout_dtype=jnp.bfloat16)
  >>> jsparse.abstract_sync_state(plan).params['w'].dtype
  dtype(bfloat16)
  """
  return SyncState(np.zeros((), np.int64), np.zeros(2, np.uint32), np.zeros(16, np.uint8),
                   storable_shapes(plan, shardings), np.zeros(RUN_BYTES, np.uint8))


def storable(plan: Plan, tree: PyTree) -> PyTree:
  """``tree`` with every zero-size leaf replaced by a one-element placeholder of its dtype:
  what Orbax can save (it refuses zero-size arrays)."""
  flat = plan.treedef.flatten_up_to(tree)
  return jax.tree.unflatten(plan.treedef, [
      np.zeros((1,), leaf.rollout_dtype) if leaf.size == 0 else x
      for x, leaf in zip(flat, plan.leaves)])


def storable_shapes(plan: Plan, shardings: PyTree | None = None) -> PyTree:
  """The abstract target of a :func:`storable` rollout tree (see ``Plan.rollout_shapes``)."""
  default = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
  flat = jax.tree.leaves(plan.rollout_shapes(shardings))
  return jax.tree.unflatten(plan.treedef, [
      jax.ShapeDtypeStruct((1,), s.dtype, sharding=default) if leaf.size == 0 else s
      for s, leaf in zip(flat, plan.leaves)])


def from_storable(plan: Plan, tree: PyTree) -> PyTree:
  """Inverse of :func:`storable`: placeholders become zero-size leaves of the plan's shapes."""
  flat = plan.treedef.flatten_up_to(tree)
  return jax.tree.unflatten(plan.treedef, [
      np.zeros(leaf.shape, leaf.rollout_dtype) if leaf.size == 0 else x
      for x, leaf in zip(flat, plan.leaves)])


def check_version(version: Any) -> int:
  """``version`` as an int in [0, 2**63), else :class:`VersionError`."""
  if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)) \
      or not 0 <= version < 2**63:
    raise VersionError(f"a version must be an int in [0, 2**63), got {version!r}")
  return int(version)


def check_state(plan: Plan, state: Any, *, rollout_only: bool) -> tuple[int, bytes, PyTree]:
  """(version, digest bytes, params) of a :class:`SyncState` (or a mapping with its fields, as
  Orbax restores it without a target), checked against ``plan``."""
  if isinstance(state, Mapping) and set(state) in (set(SyncState._fields),
                                                   set(SyncState._fields) - {"run"}):
    state = SyncState(**state)
  if not isinstance(state, SyncState):
    raise PlanMismatchError(f"sync state: expected a jsparse.SyncState (from .state() of a Sender "
                            f"or Receiver, restored onto jsparse.abstract_sync_state(plan)), got "
                            f"{type(state).__name__}")
  if np.asarray(state.plan, np.uint8).tobytes() != plan.fingerprint:
    raise PlanMismatchError("sync state: it was saved for another plan (fingerprint differs): "
                            "restore it with the plan it was saved with (make_plan of the same "
                            "tree and options), or start from fresh params and take an anchor")
  try:
    params = from_storable(plan, state.params)
  except (ValueError, TypeError) as e:
    raise PlanMismatchError(f"sync state params: {plan.structure_difference(state.params)}") \
        from e
  plan.flatten(params, what="sync state params", rollout_only=rollout_only)
  digest = np.asarray(state.digest, np.uint32)
  if digest.shape != (2,):
    raise PlanMismatchError(f"sync state: digest must be uint32[2], got {digest.shape} "
                            "(damaged, or not a jsparse.SyncState): restore another step")
  return check_version(int(state.version)), digest.astype("<u4").tobytes(), params


def check_digest(actual: bytes, saved: bytes, version: int) -> None:
  if actual != saved:
    raise IntegrityError(f"restored sync state of version {version}: its params do not match "
                         "the digest saved with them (corrupted or from another run): restore "
                         "another step, or start from fresh params and take an anchor (a "
                         "Subscriber with start_with_anchor=True)")


def digest_words(digest: bytes) -> np.ndarray:
  """An 8-byte digest as ``uint32[2]`` (the inverse of :func:`digest_bytes`)."""
  return np.frombuffer(digest, "<u4").astype(np.uint32)


def digest_bytes(digest: Any) -> bytes:
  """A device digest of bit patterns (``uint32[2]``) as 8 bytes."""
  return np.asarray(digest, np.uint32).astype("<u4").tobytes()


def versioned_digest(bits_digest: bytes, version: int) -> bytes:
  """The digest a payload carries for a state: its bit patterns' digest bound to its version,
  so that a payload whose version fields were altered fails the end-to-end check.

  >>> versioned_digest(bytes(8), 1) != versioned_digest(bytes(8), 2)
  True
  """
  return hashlib.blake2b(bits_digest + version.to_bytes(8, "little"), digest_size=8).digest()
