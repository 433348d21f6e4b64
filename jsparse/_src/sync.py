"""End-to-end sync: :class:`Sender` (trainer side) and :class:`Receiver` (rollout side).

The sender keeps the last synced state in rollout dtypes; each ``send`` diffs the new params
against it in one jitted step (which also produces the next snapshot and its digest), moves the
small fixed-size Delta to the host, carries overflowed segments densely and serializes. The
receiver validates the whole payload before touching anything, then applies it with its params
donated (in place) and checks the digest of the result against the sender's.

>>> import jax.numpy as jnp, jsparse
>>> params = {'w': jnp.zeros((1000,), jnp.float32)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> sender = jsparse.Sender(plan, params)
>>> receiver = jsparse.Receiver(plan, plan.cast(params))
>>> new = {'w': params['w'].at[7].set(1.0)}
>>> data = sender.send(new)
>>> float(receiver.receive(data)['w'][7]), receiver.version
(1.0, 1)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src import bits as bits_lib
from jsparse._src import compact, sync_steps, ulp, wire
from jsparse._src.delta import Delta, commit_leaves, receiver_layouts
from jsparse._src.errors import IntegrityError, PlanMismatchError, VersionError
from jsparse._src.plan import Plan
from jsparse._src.sync_state import (check_digest, check_state, check_version, digest_bytes,
                                     sync_state)

PyTree = Any


def host_segments(plan: Plan, wire_format: int, delta: Delta, old_values: tuple, ranks: tuple, *,
                  dense: Any, full: bool = False) -> tuple[wire.SegmentPayload, ...]:
  """The payload records of a (host) delta: overflowed segments, and all when ``full``, carry
  ``dense(s)``; the others their changes, coded for ``wire_format`` (by rank in the ordered
  segments when ``ranks`` are given)."""
  lists = wire_format == wire.LISTS
  segments = []
  for s, seg in enumerate(plan.segments):
    if full or delta.overflow[s]:
      segments.append(wire.SegmentPayload(wire.DENSE, None, dense(s)))
      continue
    count = int(delta.counts[s])
    indices, values, old = delta.indices[s], delta.values[s], old_values[s]
    if seg.blocks > 1:  # ascending per block, unused slots between blocks: merge the blocks
      order = np.argsort(indices, kind="stable")
      indices, values, old = indices[order], values[order], old[order]
    indices, values, old = indices[:count], values[:count], old[:count]
    if lists:
      segments.append(wire.SegmentPayload(wire.sparse_mode(seg.size, count), indices, values))
      continue
    codes = ulp.step_codes(old, values, seg.dtype, np)
    by_rank = ranks is not None and seg.ordered
    if by_rank:  # rank order: by class, then position (a stable radix sort by class)
      order = np.argsort(ulp.exponent_class(old, seg.dtype, np), kind="stable")
      indices, codes = ranks[s][:count][order], codes[order]
    segments.append(wire.SegmentPayload(wire.ORDERED if by_rank else wire.NATURAL,
                                        indices, codes))
  return tuple(segments)


def _segment_host_bits(plan: Plan, segment_id: int, flat: list) -> np.ndarray:
  seg = plan.segments[segment_id]
  parts = [bits_lib.np_to_bits(np.asarray(flat[i])).reshape(-1) for i in seg.leaf_ids]
  return parts[0] if len(parts) == 1 else np.concatenate(parts)


class Sender:
  """Trainer side of a sync: turns successive params into payloads for a :class:`Receiver`.

  Args:
    plan: from :func:`jsparse.make_plan`.
    params: the params the receiver starts from, in trainer or rollout dtypes.
    version: the version ``params`` are (the receiver must start from the same one).
    anchor_every: if set, every ``anchor_every``-th version is sent as a full (dense) anchor.
    wire_format: 2 (compact, the default: ~1 byte per change on RL updates, and the receiver
      makes one pass over its params per payload) or 1 (lists: 4 bytes per change for 16-bit
      dtypes, no pass; for fast links). See ``jsparse/_src/wire.py``.
    ranked: in format 2, name changes by rank in the exponent-class order where the plan
      allows (the compact choice); False names them by position (no pass over the params on
      either side, ~0.25 B more per change).
  """

  def __init__(self, plan: Plan, params: PyTree, *, version: int = 0,
               anchor_every: int | None = None, wire_format: int = wire.COMPACT,
               ranked: bool = True):
    if anchor_every is not None and (not isinstance(anchor_every, int) or anchor_every < 1):
      raise ValueError(f"anchor_every must be a positive int or None, got {anchor_every!r}")
    if wire_format not in (wire.LISTS, wire.COMPACT):
      raise ValueError(f"wire_format must be 1 or 2, got {wire_format!r}")
    self.wire_format = wire_format
    self.ranked = ranked
    self.plan = plan
    self.version = check_version(version)
    self.anchor_every = anchor_every
    flat = commit_leaves(plan.flatten(params, what="params"))
    self._snapshot, digest = sync_steps.snapshot_and_digest(plan, flat)
    self._digest = digest_bytes(digest)
    self.last_stats: dict[str, Any] = {}

  def state(self) -> dict[str, Any]:
    """What a restarted trainer needs to resume without a full resend (see :func:`sync_state`).
    The arrays are the live snapshot: save them before the next ``send``."""
    return sync_state(self.plan, self.version, self._digest, self.snapshot)

  @classmethod
  def restore(cls, plan: Plan, state: dict[str, Any], *, anchor_every: int | None = None,
              wire_format: int = wire.COMPACT, ranked: bool = True) -> "Sender":
    """A sender that resumes from ``state`` (from :meth:`state`, e.g. restored by Orbax).

    Raises:
      PlanMismatchError: the state belongs to another plan.
      IntegrityError: the restored snapshot does not match the digest saved with it.
    """
    version, digest, params = check_state(plan, state, rollout_only=False)
    sender = cls(plan, params, version=version, anchor_every=anchor_every,
                 wire_format=wire_format, ranked=ranked)
    check_digest(sender._digest, digest, version)
    return sender

  @property
  def snapshot(self) -> PyTree:
    """The last synced state, in rollout dtypes (what the receiver holds)."""
    return jax.tree.unflatten(self.plan.treedef, self._snapshot)

  def send(self, params: PyTree, *, full: bool = False, version: int | None = None) -> bytes:
    """Returns the bytes that bring a receiver from the current version to the next.

    Args:
      params: the new params (trainer or rollout dtypes, the plan's structure and shapes).
      full: send a dense anchor that a receiver accepts on any base version.
      version: the version these params are (e.g. the trainer step); default current + 1.
    """
    data = wire.encode(self.plan, self.payload(params, full=full, version=version))
    self.last_stats["payload_bytes"] = len(data)
    return data

  def payload(self, params: PyTree, *, full: bool = False,
              version: int | None = None) -> wire.Payload:
    """Like :meth:`send`, but returns the decoded :class:`wire.Payload` (what a
    :class:`Receiver` applies with :meth:`Receiver.apply_payload`), not its bytes."""
    version = self.version + 1 if version is None else check_version(version)
    if version <= self.version:
      raise VersionError(f"version {version} must be newer than the sender's {self.version}")
    plan = self.plan
    ranked = self.wire_format == wire.COMPACT and self.ranked
    full = full or (self.anchor_every is not None and version % self.anchor_every == 0)
    flat = commit_leaves(plan.flatten(params, what="params"))
    snapshot_ids = {id(x) for x in self._snapshot}  # the snapshot is donated below
    flat = [jnp.copy(x) if id(x) in snapshot_ids else x for x in flat]
    delta, old_values, tables, snapshot, digest = sync_steps.sender_step(
        plan, ranked, self._snapshot, flat)
    self._snapshot = snapshot
    ranks = None
    if ranked and not full:  # ranks need only as many slots as this step's changes
      slots = sync_steps.slots_needed(plan, np.asarray(delta.counts))
      ranks = sync_steps.ranks(plan, slots, tables, delta.indices, old_values)
    delta, old_values, ranks = jax.device_get((delta, old_values, ranks))
    segments = host_segments(plan, self.wire_format, delta, old_values, ranks,
                             dense=lambda s: _segment_host_bits(plan, s, snapshot), full=full)
    new_digest = digest_bytes(digest)
    payload = wire.Payload(wire.ANCHOR if full else wire.DELTA, self.version, version,
                           self._digest, new_digest, tuple(segments), self.wire_format)
    self.version, self._digest = version, new_digest
    self.last_stats = {
        "version": version, "changed": int(np.sum(delta.counts)),
        "elements": plan.num_elements,
        "dense_bytes": plan.rollout_bytes, "overflowed_segments": int(np.sum(delta.overflow)),
        "anchor": full}
    return payload


class Receiver:
  """Rollout side of a sync: applies payloads from a :class:`Sender` to its params.

  The receiver owns ``params``: with ``donate=True`` (the default) each receive updates the
  arrays in place, and arrays handed in earlier must not be used afterwards. Every payload is
  validated in full before anything is written (checksum, structure, versions, the base
  digest); the digest of the result is checked after. A payload that fails that last check
  (it passed the checksum, so it was built wrong, not damaged in transit) leaves a
  non-donating receiver unchanged, and a donating one out of sync until an anchor. Each leaf
  keeps the sharding of the array it was given; a leaf split into blocks over a mesh is updated
  block by block, each device keeping only the changes inside its own block.

  Args:
    plan: the sender's plan.
    params: the rollout params at ``version``, in the plan's rollout dtypes.
    version: the version ``params`` hold.
    donate: update params in place (buffer donation).
  """

  def __init__(self, plan: Plan, params: PyTree, *, version: int = 0, donate: bool = True):
    self.plan = plan
    self.version = check_version(version)
    self._flat = commit_leaves(plan.flatten(params, what="params", rollout_only=True))
    self._layouts = receiver_layouts(plan, self._flat)
    self._donate = donate
    self._digest = digest_bytes(sync_steps.digest(self._flat, self._layouts))

  @property
  def params(self) -> PyTree:
    """The current rollout params."""
    return jax.tree.unflatten(self.plan.treedef, self._flat)

  def state(self) -> dict[str, Any]:
    """What a restarted rollout needs to resume without a full resend (see :func:`sync_state`).
    The arrays are the live params: save them before the next ``receive``."""
    return sync_state(self.plan, self.version, self._digest, self.params)

  @classmethod
  def restore(cls, plan: Plan, state: dict[str, Any], *, donate: bool = True) -> "Receiver":
    """A receiver that resumes from ``state`` (from :meth:`state`, e.g. restored by Orbax onto
    the rollout shardings, see :func:`abstract_sync_state`).

    Raises:
      PlanMismatchError: the state belongs to another plan.
      IntegrityError: the restored params do not match the digest saved with them.
    """
    version, digest, params = check_state(plan, state, rollout_only=True)
    receiver = cls(plan, params, version=version, donate=donate)
    check_digest(receiver._digest, digest, version)
    return receiver

  def receive(self, data: bytes) -> PyTree:
    """Applies a payload and returns the new params.

    Raises:
      PayloadError: the bytes are corrupt, truncated, or for another plan.
      VersionError: a delta for another base version (missed, replayed or reordered).
      IntegrityError: the receiver's state is not the one the delta was computed against.
      In all three cases nothing was changed.
    """
    return self.apply_payload(wire.decode(self.plan, data))

  def apply_payload(self, payload: wire.Payload) -> PyTree:
    """:meth:`receive` for an already decoded (and validated) payload."""
    plan = self.plan
    if payload.kind == wire.DELTA:
      if payload.base_version != self.version:
        raise VersionError(f"payload turns version {payload.base_version} into "
                           f"{payload.version}, but this receiver holds version {self.version}")
      if payload.base_digest != self._digest:
        raise IntegrityError(f"this receiver's params differ from the sender's version "
                             f"{self.version}: resync with an anchor (sender.send(p, full=True))")
    for s, part in enumerate(payload.segments):
      split = [plan.leaves[i].path for i in plan.segments[s].leaf_ids if self._layouts[i]]
      if part.mode == wire.ORDERED and split:
        raise PlanMismatchError(
            f"this receiver splits leaf {split[0]} into blocks, but the plan codes its changes "
            "in an order of the whole leaf: make the plan with rollout_shardings=<the rollout's "
            "shardings> (or send with wire_format=1)")
    dense = {s: p.values for s, p in enumerate(payload.segments) if p.mode == wire.DENSE}
    flat = self._replace_dense(list(self._flat), dense)  # dense segments have no sparse entries
    if len(dense) == len(plan.segments):
      digest = sync_steps.digest(flat, self._layouts)
    elif payload.format == wire.COMPACT:
      keys, codes, counts = self._padded(payload)
      ranked = compact.ranked_segments(plan, [p.mode for p in payload.segments])
      indices = sync_steps.positions(plan, ranked, flat, keys, counts)
      flat, digest = sync_steps.apply_steps[self._donate](plan, self._layouts, flat, indices,
                                                          codes, counts)
    else:
      keys, values, counts = self._padded(payload)
      delta = Delta(keys, values, counts, np.zeros(counts.shape, bool))
      flat, digest = sync_steps.apply_bits[self._donate](plan, self._layouts, flat, delta)
    if digest_bytes(digest) != payload.new_digest:
      message = (f"version {payload.version} reconstructed with a digest that differs from the "
                 "sender's (a payload that passed its checksum but not the end-to-end check)")
      if not self._donate:
        raise IntegrityError(f"{message}; nothing was applied")
      # The old buffers were donated: keep what was built, under its own digest, so that no
      # delta matches it and only an anchor is accepted.
      self._flat, self._digest = flat, digest_bytes(digest)
      raise IntegrityError(f"{message}; this receiver is out of sync until it gets an anchor "
                           "(sender.send(params, full=True))")
    self._flat = flat
    self.version, self._digest = payload.version, payload.new_digest
    return self.params

  def _padded(self, payload: wire.Payload) -> tuple[tuple, tuple, np.ndarray]:
    """Per segment: keys (positions or ranks; the segment size where unused) and values padded
    to :func:`sync_steps.slots_needed`, and the counts (0 for dense segments, which are written
    already)."""
    counts = np.array([0 if p.mode == wire.DENSE else len(p.indices) for p in payload.segments],
                      np.int32)
    slots = sync_steps.slots_needed(self.plan, counts)
    indices, values = [], []
    for seg, part, n, count in zip(self.plan.segments, payload.segments, slots, counts):
      idx = np.full(n, seg.size, np.int32)
      val = np.zeros(n, seg.bit_dtype)
      idx[:count] = part.indices[:count] if count else idx[:0]
      val[:count] = part.values[:count] if count else val[:0]
      indices.append(idx)
      values.append(val)
    return tuple(indices), tuple(values), counts

  def _replace_dense(self, flat: list, dense: dict[int, np.ndarray]) -> list:
    for s, seg_bits in dense.items():
      seg = self.plan.segments[s]
      for leaf_id, offset in zip(seg.leaf_ids, seg.offsets):
        leaf = self.plan.leaves[leaf_id]
        host = bits_lib.np_from_bits(seg_bits[offset:offset + leaf.size], leaf.rollout_dtype)
        flat[leaf_id] = jax.device_put(host.reshape(leaf.shape), self._flat[leaf_id].sharding)
    return flat


