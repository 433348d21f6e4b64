"""The JSON metadata of a delta checkpoint chain step: built once per save, checksummed, and
checked field by field when read, so that a damaged step is a :class:`~jsparse.CheckpointError`
naming it (never a ``KeyError``, a loop over a cyclic chain, or a wrong restore).

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(10)})
>>> meta = base_meta(plan, step=3, digest=bytes(8))
>>> check(meta, 3, plan)['kind']
'base'
>>> check(dict(meta, step=4), 3, plan)
Traceback (most recent call last):
...
jsparse.errors.CheckpointError: step 3: metadata corrupted (checksum mismatch)
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from jsparse._src.core.plan import Plan
from jsparse._src.errors import CheckpointError, ForeignPlanError
from jsparse._src.wire.parts import MAX_PARTS
from jsparse._src.wire.payload import Mode

FORMAT = 3
# The records of a "delta" step (arrays of a positioned payload), which chains stored before
# they stored parts: still read.
MODE_IDS = {"empty": Mode.EMPTY, "sparse": Mode.BY_POSITION, "dense": Mode.DENSE}


def _crc(meta: dict) -> int:
  body = {k: v for k, v in meta.items() if k != "crc"}
  return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _sealed(meta: dict) -> dict:
  return dict(meta, crc=_crc(meta))


def _common(plan: Plan, step: int, kind: str, digest: bytes, changed: int) -> dict:
  return {"jsparse_chain": FORMAT, "step": step, "plan": plan.fingerprint.hex(), "kind": kind,
          "digest": digest.hex(), "changed": changed}


def base_meta(plan: Plan, *, step: int, digest: bytes) -> dict:
  """The metadata of a base step holding the whole tree, whose bits digest to ``digest``."""
  return _sealed(dict(_common(plan, step, "base", digest, plan.num_elements), base=step,
                      parent=None))


def parts_meta(plan: Plan, *, step: int, parent: int, base: int, parent_digest: bytes,
               digest: bytes, changed: int, lengths: list[int]) -> dict:
  """The metadata of a delta step: the parts of the version from its parent (one per process
  of the job that saved it, ``lengths`` bytes each)."""
  return _sealed(dict(_common(plan, step, "delta", digest, changed), base=base, parent=parent,
                      parent_digest=parent_digest.hex(), lengths=lengths))


def _is_int(value: Any) -> bool:
  return type(value) is int  # bools and floats are not steps or counts


def _is_digest(value: Any) -> bool:
  if not isinstance(value, str) or len(value) != 16:
    return False
  try:
    bytes.fromhex(value)
  except ValueError:
    return False
  return True


def check(meta: Any, step: int, plan: Plan) -> dict:
  """Returns ``meta`` if it is the intact metadata of ``step`` of a chain of ``plan``.

  Raises:
    ForeignPlanError: the step was saved with another plan.
    CheckpointError: anything else: not a chain step, a checksum mismatch, a field missing or
      of the wrong type, a parent that is not an earlier step, counts that do not fit the plan.
  """
  def bad(why: str) -> CheckpointError:
    return CheckpointError(f"step {step}: metadata corrupted ({why})")

  if not isinstance(meta, dict) or meta.get("jsparse_chain") != FORMAT:
    raise CheckpointError(f"step {step}: not a jsparse chain step of format {FORMAT}")
  if meta.get("crc") != _crc(meta):
    raise bad("checksum mismatch")
  if meta.get("plan") != plan.fingerprint.hex():
    raise ForeignPlanError(f"step {step} was saved with another plan (fingerprint differs)")
  if meta.get("step") != step or meta.get("kind") not in ("base", "delta", "parts"):
    raise bad("step or kind")
  if not _is_digest(meta.get("digest")) or not _is_int(meta.get("changed")) \
      or meta["changed"] < 0:
    raise bad("digest or changed")
  if meta["kind"] == "base":
    if meta.get("base") != step or meta.get("parent") is not None:
      raise bad("a base must be its own base and have no parent")
    return meta
  parent, base = meta.get("parent"), meta.get("base")
  if not (_is_int(parent) and _is_int(base) and 0 <= base <= parent < step):
    raise bad(f"parent {parent!r} and base {base!r} must be earlier steps")
  if not _is_digest(meta.get("parent_digest")):
    raise bad("parent digest")
  if meta["kind"] == "parts" or "lengths" in meta:  # parts ("parts": as older chains said)
    lengths = meta.get("lengths")
    if not (isinstance(lengths, list) and 0 < len(lengths) <= MAX_PARTS
            and all(_is_int(n) and 0 < n < 2**40 for n in lengths)):
      raise bad("lengths of the parts")
    return meta
  modes, counts = meta.get("modes"), meta.get("counts")  # arrays, as older chains stored
  if not (isinstance(modes, list) and isinstance(counts, list)
          and len(modes) == len(counts) == len(plan.segments)):
    raise bad("modes and counts must have one entry per segment of the plan")
  for seg, mode, count in zip(plan.segments, modes, counts):
    if not isinstance(mode, str) or mode not in MODE_IDS or not _is_int(count):
      raise bad(f"mode {mode!r}, count {count!r}")
    limit = {"empty": 0, "dense": 0}.get(mode, seg.capacity)
    if not 0 <= count <= limit:
      raise bad(f"a {mode} record of {count} changes (capacity {seg.capacity})")
  return meta
