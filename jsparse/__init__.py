"""jsparse: lossless sparse weight synchronization for JAX.

The data flow, one module each (``jsparse/_src/``)::

  make_plan ─► Plan ─► diff (jit) ─► Delta ─► Sender: records ─► bytes ─► Receiver ─► apply (jit)
  core/plan.py          core/delta.py         sync/sender.py   wire/    sync/receiver.py

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros((4,))}, rollout_dtype=jnp.bfloat16)
>>> delta = jsparse.diff(plan, {'w': jnp.zeros((4,))}, {'w': jnp.ones((4,))})
>>> delta.counts.tolist()
[4]
"""

from typing import Any

from jsparse._src.core.delta import Delta, apply, diff
from jsparse._src.core.digest import bits_digest
from jsparse._src.core.plan import LeafSpec, Plan, Segment
from jsparse._src.planning import make_plan
from jsparse import errors
from jsparse.errors import (ArgumentError, CheckpointError, ConfigError, IntegrityError,
                            JsparseError, PayloadError, PlanError, PlanMismatchError,
                            VersionError)
from jsparse._src.sync.receiver import ReceiveStream, Receiver
from jsparse._src.sync.sender import SendStats, Sender
from jsparse._src.sync.state import SyncState, abstract_sync_state
from jsparse._src.sync.stream import Version
from jsparse._src.wire.payload import Coding

__version__ = "0.2.0.dev0"

_LAZY = {"DeltaCheckpointManager", "SaveInfo"}  # Orbax is imported on first use only


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    from jsparse._src import checkpoint
    return getattr(checkpoint, name)
  raise AttributeError(f"module 'jsparse' has no attribute {name!r}")


__all__ = [
    "ArgumentError", "CheckpointError", "Coding", "ConfigError", "Delta", "DeltaCheckpointManager",
    "IntegrityError", "JsparseError", "LeafSpec", "PayloadError", "Plan",
    "PlanError", "PlanMismatchError", "ReceiveStream", "Receiver", "SaveInfo", "Segment",
    "SendStats", "Sender", "SyncState", "Version",
    "VersionError", "abstract_sync_state", "apply", "bits_digest", "diff", "errors", "make_plan",
]
