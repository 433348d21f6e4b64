"""The rollout side of a sync: :class:`Receiver` applies payloads to its params.

``receive`` takes a version's parts (one, from a one-process trainer): it checks every part's
index (checksum, plan, versions, which units it covers) and the version's base (versions,
digest), then decodes the unit bodies this process holds (``parts.py``), staging each sparse
record on the device as it is decoded (``staging.py``) and keeping the dense ones; once all
are in, it writes the dense records, applies the sparse ones in one device stage
(``programs.apply_inputs``, in place when donated), and verifies the digest of the result
against the sender's. Nothing is written before the last record is in and checked.

>>> import jax.numpy as jnp, jsparse
>>> params = {'w': jnp.zeros((1000,), jnp.float32)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> sender = jsparse.Sender(plan, params)
>>> receiver = jsparse.Receiver(plan, plan.cast(params))
>>> data = sender.send({'w': params['w'].at[7].set(1.0)})
>>> float(receiver.receive(data)['w'][7]), receiver.version
(1.0, 1)
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import jax
import numpy as np

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.placement import commit_leaves, layouts_of, owned_leaves
from jsparse._src.core.layout import mesh_neutral
from jsparse._src.core.plan import Plan
from jsparse._src.errors import (ArgumentError, IntegrityError, JsparseError, PayloadError,
                                 VersionError)
from jsparse._src.options import typed_argument
from jsparse._src.pytree import PyTree
from jsparse._src.sync import parts as parts_lib
from jsparse._src.sync import programs, staging
from jsparse._src.sync.state import (SyncState, check_digest, check_state, check_version,
                                     digest_bytes, digest_words, state_run,
                                     versioned_digest)
from jsparse._src.wire.parts import split_parts
from jsparse._src.wire.payload import (Kind, Mode, Payload, SegmentPayload,
                                       ranked_segments)


# What a receiver that missed versions, or holds params of no version of the sender's, needs.
NEEDS_ANCHOR = ("this receiver needs an anchor: a Subscriber asks for one by itself; with a bare "
                "Receiver, have the trainer send one (sender.send(params, anchor=True))")


def _bytes_like(data) -> bool:
  """Whether ``data`` (with ``len`` and indexing) is bytes (e.g. an ``mmap``: it indexes to
  ints), not a sequence of parts."""
  if isinstance(data, (bytes, bytearray, memoryview)):
    return True
  return len(data) > 0 and isinstance(data[0], (int, np.integer))


class Receiver:
  """Rollout side of a sync: applies payloads from a :class:`Sender` to its params.

  With ``donate=True`` (the default) the receiver copies ``params`` once and then updates its
  own arrays in place: the arrays handed in stay valid, but :attr:`params` returned by one
  receive are dead after the next. Every payload is
  validated in full before anything is written (checksum, structure, versions, the base
  digest); the digest of the result is checked after. A payload that fails that last check
  (it passed the checksum, so it was built wrong, not damaged in transit) leaves a
  non-donating receiver unchanged, and a donating one out of sync until an anchor. Each leaf
  keeps the sharding of the array it was given; a leaf split into blocks over a mesh is updated
  block by block, each device keeping only the changes inside its own block.

  A receiver is safe to share between threads: it applies one version at a time (a lock), so a
  second thread delivering the same payload waits, then gets a :class:`VersionError`.

  Args:
    plan: the sender's plan.
    params: the rollout params at ``version``, in the plan's rollout dtypes.
    version: the version ``params`` hold.
    donate: update params in place (buffer donation).

  Raises:
    PlanMismatchError: ``params`` are not in the plan's rollout dtypes and shapes (named).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
  >>> receiver = jsparse.Receiver(plan, {'w': jnp.zeros(8, jnp.bfloat16)}, version=3)
  >>> receiver.version, receiver.params['w'].dtype
  (3, dtype(bfloat16))
  """

  @mesh_neutral
  def __init__(self, plan: Plan, params: PyTree, *, version: int = 0, donate: bool = True):
    self.plan = typed_argument("plan", plan, Plan, "a jsparse.Plan (from make_plan)")
    self.version = check_version(version)
    self._flat = commit_leaves(plan.flatten(params, what="params", rollout_only=True))
    if donate:  # the receiver donates its buffers: they must be its own
      self._flat = owned_leaves(self._flat)
    self._layouts = layouts_of(plan, self._flat)
    self._donate = donate
    self._bits = digest_bytes(programs.leaves_digest(plan, self._flat, self._layouts))
    self.last_read: parts_lib.ReadStats | None = None  # of the last version received as parts
    self.run_id: bytes | None = None  # the run (feed) its version belongs to, once known
    self._lock = threading.Lock()  # one version applied at a time

  @property
  def params(self) -> PyTree:
    """The current rollout params."""
    return jax.tree.unflatten(self.plan.treedef, self._flat)

  @property
  def digest(self) -> bytes:
    """The 8-byte digest of this receiver's state (its params' bit patterns and version), as
    payloads carry it."""
    return versioned_digest(self._bits, self.version)

  @property
  def layouts(self) -> tuple:
    """The block layout of each leaf this receiver holds (None: not split)."""
    return self._layouts

  def state(self) -> SyncState:
    """What a restarted rollout needs to resume without a full resend. The arrays are the live
    params: save them before the next ``receive``."""
    return SyncState.of(self.plan, self.version, self._bits, self.params, self.run_id)

  def detach(self) -> None:
    """Forgets which version this receiver holds: its params stay, at version 0, and it then
    accepts an anchor, or a delta whose base digest matches its params. For params that belong
    to no version of the run being followed (e.g. restored from another run's state).

    >>> import jax.numpy as jnp, jsparse
    >>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
    >>> receiver = jsparse.Receiver(plan, {'w': jnp.zeros(8, jnp.bfloat16)}, version=8)
    >>> receiver.detach()
    >>> receiver.version
    0
    """
    with self._lock:
      self.version = 0

  @classmethod
  def restore(cls, plan: Plan, state: SyncState, *, donate: bool = True) -> "Receiver":
    """A receiver that resumes from ``state`` (from :meth:`state`, e.g. restored by Orbax onto
    the rollout shardings, see :func:`~jsparse.abstract_sync_state`).

    Raises:
      PlanMismatchError: the state belongs to another plan.
      IntegrityError: the restored params do not match the digest saved with them.
    """
    version, digest, params = check_state(plan, state, rollout_only=True)
    receiver = cls(plan, params, version=version, donate=donate)
    check_digest(receiver._bits, digest, version)
    receiver.run_id = state_run(state)
    return receiver

  def receive(self, data: "bytes | Sequence | Payload") -> PyTree:
    """Applies one version and returns the new params.

    ``data`` is what the sender sent of the version, in any of its forms: the bytes of
    :meth:`Sender.send` of a one-process trainer (a version of one part), a list or tuple of
    every part of the version (one per trainer process, or a :meth:`Sender.send_stream`'s),
    the parts as one payload (:meth:`Version.join`; several processes' joined, in any order),
    or a decoded ``Payload`` (what a delta checkpoint restores). A part may be ``bytes`` or
    anything with ``len`` and slicing (e.g. an ``mmap`` of a file): of each part this reads
    its index, then only the units that overlap the blocks this process holds
    (:attr:`last_read` says how many). Parts are applied only when every part is present
    once, intact and of the same version, and, in a rollout job of several processes (each
    calling this with the same parts), only when every process accepted its reads. To apply
    parts as they arrive, use :meth:`open_stream`.

    Raises:
      PayloadError: the bytes are corrupt, truncated, or for another plan; a part is missing,
        repeated, or of another version.
      VersionError: a delta for another base version (missed, replayed or reordered).
      IntegrityError: the receiver's state is not the one the delta was computed against, or
        the result does not match the sender's digest (see the class docstring).
      Except for a donating receiver's failed end-to-end check, nothing was changed.

    >>> import jax.numpy as jnp, jsparse
    >>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
    >>> sender = jsparse.Sender(plan, {'w': jnp.zeros(8)})
    >>> receiver = jsparse.Receiver(plan, {'w': jnp.zeros(8, jnp.bfloat16)})
    >>> _ = receiver.receive(sender.send({'w': jnp.ones(8)}))  # a version of one part
    >>> _ = receiver.receive(list(sender.send_stream({'w': jnp.full(8, 2.0)})))  # its parts
    >>> receiver.version, float(receiver.params['w'][0])
    (2, 2.0)
    """
    if isinstance(data, Payload):
      return self._apply_records(data, data.segments)
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__") or \
        isinstance(data, str):
      raise ArgumentError("jsparse: data must be the bytes of a part (what Sender.send "
                          "returns), a list of a version's parts, or a decoded Payload; got "
                          f"{type(data).__name__}")
    if not _bytes_like(data):  # a sequence of parts
      return self._apply_parts(data)
    return self._apply_parts(split_parts(data))  # one part, or several joined

  @mesh_neutral
  def _apply_records(self, header: Payload, records: Iterable[SegmentPayload]) -> PyTree:
    """Applies a payload whose ``header`` (versions, digests) is checked and whose
    ``records`` are taken one at a time: each sparse one is staged on the devices as it comes
    (``staging.py``), and nothing is written before the last has come."""
    with self._lock:
      return self._apply_records_locked(header, records)

  def _apply_records_locked(self, header: Payload, records: Iterable[SegmentPayload]) -> PyTree:
    self._check_base(header)
    staged, dense, modes = staging.stage_records(self.plan, self._flat, records)
    flat = self._write_dense(dense)
    inputs = None if all(mode == Mode.DENSE for mode in modes) else staged.inputs(
        ranked=ranked_segments(self.plan, modes),
        dense=staging.dense_in_delta(header, modes))
    return self._apply_and_commit(header, flat, inputs)

  def _apply_and_commit(self, header: Payload, flat: list,
                        inputs: programs.ReceiverInputs | None) -> PyTree:
    """What every form of a version ends in, whatever its coding: its staged sparse
    ``inputs`` (None: it has none) applied to ``flat`` (its dense records written), the
    digest of the result checked against the sender's, and the new params committed."""
    if inputs is None:
      digest = programs.leaves_digest(self.plan, flat, self._layouts)
    else:
      flat, digest = programs.apply_inputs(self.plan, self._layouts, flat, inputs,
                                           donate=self._donate, base=self._base(header))
    self._verify_and_commit(header, flat, digest_bytes(digest))
    return self.params

  def open_stream(self) -> "ReceiveStream":
    """Starts receiving one version part by part, as the parts arrive (e.g. from
    :meth:`Sender.send_stream`): :meth:`ReceiveStream.add` checks and decodes each part on
    arrival, :meth:`ReceiveStream.commit` applies the version once every part is in. Nothing
    is applied before the commit, and a stream that is dropped or fails changes nothing.

    >>> import jax.numpy as jnp, jsparse
    >>> plan = jsparse.make_plan({'a': jnp.zeros(70000), 'b': jnp.zeros(70000)},
    ...                          rollout_dtype=jnp.bfloat16)
    >>> sender = jsparse.Sender(plan, {'a': jnp.zeros(70000), 'b': jnp.zeros(70000)})
    >>> receiver = jsparse.Receiver(plan, sender.snapshot)
    >>> stream = receiver.open_stream()
    >>> for part in sender.send_stream({'a': jnp.ones(70000), 'b': jnp.zeros(70000)},
    ...                                chunk_bytes=150_000):
    ...   _ = stream.add(part)
    >>> float(stream.commit()['a'][0]), receiver.version, receiver.last_read.parts
    (1.0, 1, 2)
    """
    return ReceiveStream(self)

  def _apply_parts(self, parts: Sequence) -> PyTree:
    error, read = None, None
    try:
      read = parts_lib.read_parts(self.plan, parts, self._flat)
    except JsparseError as e:
      error = e
    except Exception as e:  # noqa: BLE001 - e.g. a part's reader failed: agreed, then raised
      error = PayloadError(f"the parts could not be read: {e!r}; nothing was applied: read them "
                           "again")
      error.__cause__ = e
    return self._apply_read(read, error)

  @mesh_neutral
  def _apply_read(self, read: "parts_lib.PartsRead | None", error: JsparseError | None
                  ) -> PyTree:
    """Applies a version read from parts, if every process of the rollout read it (``error``:
    why this process did not)."""
    with self._lock:
      return self._apply_read_locked(read, error)

  def _apply_read_locked(self, read: "parts_lib.PartsRead | None", error: JsparseError | None
                         ) -> PyTree:
    try:
      if error is None:
        self._check_base(read.header)
    except JsparseError as e:
      error = e
    parts_lib.agree(error, self._flat)
    self.last_read = read.stats
    flat = parts_lib.write_dense_units(self.plan, self._flat, read)
    return self._apply_and_commit(read.header, flat, parts_lib.sparse_inputs(self.plan, read))

  def _check_base(self, payload: Payload) -> None:
    """Refuses a payload for another base version or state."""
    if payload.kind == Kind.ANCHOR and payload.version <= self.version:
      raise VersionError(f"an anchor of version {payload.version} is not newer than this "
                         f"receiver's version {self.version} (replayed or reordered): nothing was "
                         "applied; drop it, this receiver is ahead of it")
    if payload.kind == Kind.DELTA:
      if payload.base_version != self.version:
        behind = payload.base_version > self.version
        raise VersionError(
            f"payload turns version {payload.base_version} into {payload.version}, but this "
            f"receiver holds version {self.version}: nothing was applied; " + (
                f"it missed the versions after {self.version}: deliver them in order, or "
                f"{NEEDS_ANCHOR}" if behind else
                "the payload is replayed or reordered: drop it, this receiver is past it"))
      if payload.base_digest != self.digest:
        raise IntegrityError(f"this receiver's params differ from the sender's version "
                             f"{self.version} (changed outside it, or restored from another "
                             f"run): nothing was applied; {NEEDS_ANCHOR}")

  def _write_dense(self, dense: dict[int, np.ndarray]) -> list:
    """The leaves with every dense record (segment → its bits) written (dense segments have no
    sparse entries)."""
    flat = list(self._flat)
    for s, values in dense.items():
      seg = self.plan.segments[s]
      for leaf_id, offset in zip(seg.leaf_ids, seg.offsets):
        leaf = self.plan.leaves[leaf_id]
        host = bits_lib.np_from_bits(values[offset:offset + leaf.size], leaf.rollout_dtype)
        flat[leaf_id] = jax.device_put(host.reshape(leaf.shape), self._flat[leaf_id].sharding)
    return flat

  def _base(self, payload: Payload) -> tuple[list, np.ndarray] | None:
    """What a delta's digest is updated from (``programs.apply_inputs``): the leaves it
    changes and their digest; None for an anchor (digested whole)."""
    return (self._flat, digest_words(self._bits)) if payload.kind == Kind.DELTA else None

  def _verify_and_commit(self, payload: Payload, flat: list, bits: bytes) -> None:
    if versioned_digest(bits, payload.version) != payload.new_digest:
      message = (f"version {payload.version} reconstructed with a digest that differs from the "
                 "sender's (a payload that passed its checksum but not the end-to-end check)")
      if not self._donate:
        raise IntegrityError(f"{message}; nothing was applied")
      # The old buffers were donated: keep what was built, under its own digest (digested
      # whole: the changes that built it are suspect), so that no delta matches it and only
      # an anchor is accepted.
      self._flat = flat
      self._bits = digest_bytes(programs.leaves_digest(self.plan, flat, self._layouts))
      raise IntegrityError(f"{message}; this receiver kept the result and is out of sync: "
                           f"{NEEDS_ANCHOR}")
    self._flat = flat
    self.version, self._bits = payload.version, bits


class ReceiveStream:
  """One version arriving part by part at a :class:`Receiver` (from
  :meth:`Receiver.open_stream`). Parts may come in any order; each is checked (checksums,
  plan, version) and decoded when added, and the version is applied at :meth:`commit`, all
  or nothing, as :meth:`Receiver.receive` applies it.

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
  >>> sender = jsparse.Sender(plan, {'w': jnp.zeros(8)})
  >>> stream = jsparse.Receiver(plan, sender.snapshot).open_stream()
  >>> [stream.add(part) for part in sender.send_stream({'w': jnp.ones(8)})]
  [0]
  >>> float(stream.commit()['w'][0])
  1.0
  """

  def __init__(self, receiver: Receiver):
    self._receiver = receiver
    self._reader = parts_lib.PartsReader(receiver.plan, receiver._flat)
    self._error: JsparseError | None = None
    self._done = False

  def add(self, part) -> int:
    """Checks and decodes one part; returns its number.

    Raises:
      PayloadError: a corrupt or foreign part, one of another version, or one added twice
        (the stream is then refused at commit; nothing is applied).
    """
    if self._done:
      raise VersionError("this stream was committed: open a new one (receiver.open_stream()) for "
                         "the next version")
    try:
      return self._reader.add(part).header.part
    except JsparseError as e:
      self._error = self._error or e
      raise

  def commit(self) -> PyTree:
    """Applies the version and returns the new params. In a rollout job of several processes
    every process commits, and the version is applied only where every process read it.

    Raises:
      PayloadError: a part is missing or was refused; VersionError, IntegrityError: as
        :meth:`Receiver.receive`. Nothing is applied, except as :meth:`Receiver.receive` says
        for a donating receiver.
    """
    if self._done:
      raise VersionError("this stream was committed already: open a new one "
                         "(receiver.open_stream()) for the next version")
    self._done = True
    read, error = None, self._error
    if error is None:
      try:
        read = self._reader.finish()
      except JsparseError as e:
        error = e
    return self._receiver._apply_read(read, error)
