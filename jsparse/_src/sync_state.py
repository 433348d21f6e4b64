"""The resumable state of a :class:`~jsparse.Sender` or :class:`~jsparse.Receiver`.

A tree of arrays that Orbax saves as it is (``ocp.args.StandardSave``): the version, the
64-bit digest of the synced params' bit patterns, the plan fingerprint and the params. A
restarted trainer or rollout restores it (onto any sharding, see :func:`abstract_sync_state`)
and resumes without a full resend; the restored params are checked against the saved digest.

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(3)}, rollout_dtype=jnp.bfloat16)
>>> sorted(jsparse.Sender(plan, {'w': jnp.zeros(3)}).state())
['digest', 'params', 'plan', 'version']
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jsparse._src.errors import IntegrityError, PlanMismatchError, VersionError
from jsparse._src.plan import Plan

PyTree = Any


def check_version(version: Any) -> int:
  if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)) \
      or not 0 <= version < 2**63:
    raise VersionError(f"a version must be an int in [0, 2**63), got {version!r}")
  return int(version)


def sync_state(plan: Plan, version: int, digest: bytes, params: PyTree) -> dict[str, Any]:
  """The resumable state of a sender or receiver, as a tree of arrays Orbax saves as it is.

  Keys: ``version`` (int64 scalar), ``digest`` (uint32[2], of ``params``' bit patterns),
  ``plan`` (uint8[16], the plan's fingerprint) and ``params`` (the synced tree, in rollout
  dtypes).
  """
  return {"version": np.array(version, np.int64),
          "digest": np.frombuffer(digest, "<u4").astype(np.uint32),
          "plan": np.frombuffer(plan.fingerprint, np.uint8).copy(),
          "params": params}


def abstract_sync_state(plan: Plan, shardings: PyTree | None = None) -> dict[str, Any]:
  """The abstract target to restore a :func:`sync_state` onto, its params placed by
  ``shardings`` (a tree of shardings with the plan's structure; None: the default device).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(3)}, rollout_dtype=jnp.bfloat16)
  >>> abstract_sync_state(plan)['params']['w'].dtype
  dtype(bfloat16)
  """
  return {"version": np.zeros((), np.int64), "digest": np.zeros(2, np.uint32),
          "plan": np.zeros(16, np.uint8), "params": plan.rollout_shapes(shardings)}


def check_state(plan: Plan, state: Any, *, rollout_only: bool) -> tuple[int, bytes, PyTree]:
  if not isinstance(state, dict) or set(state) != {"version", "digest", "plan", "params"}:
    raise PlanMismatchError("sync state: expected a dict with keys version, digest, plan, params"
                            f", got {sorted(state) if isinstance(state, dict) else type(state)}")
  if np.asarray(state["plan"], np.uint8).tobytes() != plan.fingerprint:
    raise PlanMismatchError("sync state: it was saved for another plan (fingerprint differs)")
  plan.flatten(state["params"], what="sync state params", rollout_only=rollout_only)
  digest = np.asarray(state["digest"], np.uint32)
  if digest.shape != (2,):
    raise PlanMismatchError(f"sync state: digest must be uint32[2], got {digest.shape}")
  return check_version(int(state["version"])), digest.astype("<u4").tobytes(), state["params"]


def check_digest(actual: bytes, saved: bytes, version: int) -> None:
  if actual != saved:
    raise IntegrityError(f"restored sync state of version {version}: its params do not match "
                         "the digest saved with them (corrupted or from another run)")


def digest_bytes(digest: jax.Array) -> bytes:
  return np.asarray(digest, np.uint32).astype("<u4").tobytes()


