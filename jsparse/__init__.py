"""jsparse: lossless sparse weight synchronization for JAX.

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros((4,))}, rollout_dtype=jnp.bfloat16)
>>> delta = jsparse.diff(plan, {'w': jnp.zeros((4,))}, {'w': jnp.ones((4,))})
>>> delta.counts.tolist()
[4]
"""

from jsparse._src.checkpoint import DeltaCheckpointManager
from jsparse._src.delta import Delta, apply, diff
from jsparse._src.digest import bits_digest
from jsparse._src.errors import (CheckpointError, IntegrityError, JsparseError, PayloadError,
                                 PlanError, PlanMismatchError, VersionError)
from jsparse._src.plan import LeafSpec, Plan, Segment, make_plan
from jsparse._src.sync import Receiver, Sender
from jsparse._src.sync_state import abstract_sync_state, sync_state

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "Delta", "DeltaCheckpointManager", "IntegrityError", "JsparseError",
    "LeafSpec", "PayloadError", "Plan", "PlanError", "PlanMismatchError", "Receiver", "Segment",
    "Sender", "VersionError", "abstract_sync_state", "apply", "bits_digest", "diff", "make_plan",
    "sync_state",
]
