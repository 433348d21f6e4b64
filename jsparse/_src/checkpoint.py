"""Delta checkpoint chains with Orbax: a base checkpoint plus one small delta per step.

Every step is an ordinary Orbax checkpoint, written by ``ocp.CheckpointManager`` with its atomic
commit: a *base* step holds the full tree in rollout dtypes (``params``), a *delta* step holds
only what changed since the step before it: the version a :class:`~jsparse.Sender` sends
(``parts``: each process's part of it, :meth:`~jsparse.Sender.send`, as one row of a byte
array), in the chain's coding (for ``"auto"``, the one chosen for the step). Both carry a small
JSON ``meta`` item: the step the delta applies to, the chain's base, the plan fingerprint and
the 64-bit digest of the bit patterns after the step. In a multi-controller job (params
spanning processes) every process calls ``save`` and ``restore``, and any process count
restores what any process count saved, onto any sharding. Restoring step ``s`` restores its
base onto the shardings asked for, then applies the deltas in order, checking every digest, so
a restore is bit-exact or an error that names the step at fault. Chains that older versions of
jsparse wrote (delta steps as arrays of a positioned payload) are restored too.

>>> import tempfile, jax.numpy as jnp, jsparse
>>> params = {'w': jnp.zeros((1000,), jnp.float32)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> with DeltaCheckpointManager(tempfile.mkdtemp(), plan, rebase_every=4) as chain:
...   for step in range(6):
...     params = {'w': params['w'].at[step].set(1.0)}
...     _ = chain.save(step, params)
...   restored = chain.restore(3)
...   chain.all_steps(), chain.chain(5), float(restored['w'][:4].sum())
([0, 1, 2, 3, 4, 5], [5], 4.0)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jsparse._src import chain_meta
from jsparse._src.core.plan import Plan
from jsparse._src.errors import CheckpointError, ForeignPlanError, JsparseError
from jsparse._src.options import float_option, int_option
from jsparse._src.pytree import PyTree
from jsparse._src.sync.auto import DEFAULT_LINK_GBIT
from jsparse._src.sync.receiver import Receiver
from jsparse._src.sync.sender import Sender, coding_option
from jsparse._src.sync.state import from_storable, storable, storable_shapes
from jsparse._src.wire.payload import (Coding, Kind, Mode, Payload, SegmentPayload,
                                       check_records)


class SaveInfo(NamedTuple):
  """What :meth:`DeltaCheckpointManager.save` wrote.

  Attributes:
    step: the saved step.
    kind: ``"base"`` (the full tree) or ``"delta"`` (the changes since the step before).
    changed: elements that changed since the step before (a base: every element).
    bytes: the step's bytes on disk.
    coding: the coding of a delta step's changes (with ``coding="auto"``: the one chosen for
      the step); None for a base.

  >>> import tempfile, jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(100)})
  >>> with jsparse.DeltaCheckpointManager(tempfile.mkdtemp(), plan) as chain:
  ...   _ = chain.save(0, {'w': jnp.zeros(100)})
  ...   info = chain.save(1, {'w': jnp.ones(100)})
  >>> info.step, info.kind, info.changed, info.coding
  (1, 'delta', 100, 'positioned')
  """

  step: int
  kind: str
  changed: int
  bytes: int
  coding: str | None = None


def _payload_from_arrays(plan: Plan, meta: dict, arrays: dict) -> Payload:
  """The payload of a ``"delta"`` step (what jsparse wrote before its chains stored parts):
  ``gaps`` (int32: per sparse segment, the first position, then each position minus the
  previous one minus 1) and ``values`` (per bit dtype, in segment order: ulp codes of sparse
  segments, bits of dense ones), each padded with one element, read with the modes and counts
  kept in ``meta``."""
  gaps, values = arrays["gaps"], arrays["values"]
  if np.any(gaps < 0):
    raise CheckpointError(f"step {meta['step']}: negative position gaps (corrupted)")
  gap_at, value_at = 0, dict.fromkeys(values, 0)
  segments = []
  for seg, mode_name, count in zip(plan.segments, meta["modes"], meta["counts"]):
    mode = chain_meta.MODE_IDS[mode_name]
    count = seg.size if mode == Mode.DENSE else int(count)
    name = seg.bit_dtype.name
    part_values = values[name][value_at[name]:value_at[name] + count]
    value_at[name] += count
    positions = None
    if mode != Mode.DENSE:
      positions = (np.cumsum(gaps[gap_at:gap_at + count].astype(np.int64) + 1) - 1)
      positions = positions.astype(np.int32) if count else np.zeros(0, np.int32)
      gap_at += count
    segments.append(SegmentPayload(mode, positions, part_values))
  return Payload(Kind.DELTA, meta["parent"], meta["step"], bytes.fromhex(meta["parent_digest"]),
                 bytes.fromhex(meta["digest"]), tuple(segments))


def _delta_target(plan: Plan, meta: dict) -> dict[str, Any]:
  """numpy targets of the right sizes, so that Orbax restores a delta's arrays on the host."""
  num_gaps, num_values = 1, {}
  for seg, mode, count in zip(plan.segments, meta["modes"], meta["counts"]):
    n = seg.size if mode == "dense" else int(count)
    num_gaps += 0 if mode == "dense" else n
    num_values[seg.bit_dtype.name] = num_values.get(seg.bit_dtype.name, 1) + n
  return {"gaps": np.zeros(num_gaps, np.int32),
          "values": {k: np.zeros(n, np.dtype(k)) for k, n in num_values.items()}}


def _rows_of_parts(part: bytes) -> tuple[jax.Array, list[int]]:
  """Every process's ``part`` as row ``process`` of one ``uint8[processes, longest]`` global
  array (what Orbax saves from every process), and the parts' lengths."""
  lengths = [int(n) for n in np.asarray(multihost_utils.process_allgather(
      np.array([len(part)], np.int64))).reshape(-1)]
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.sharding.Mesh(np.array(devices).reshape(jax.process_count(), -1),
                           ("process", "local"))
  row = np.zeros((1, max(lengths)), np.uint8)
  row[0, :len(part)] = np.frombuffer(part, np.uint8)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process", None))
  return jax.make_array_from_process_local_data(sharding, row, (len(lengths), max(lengths))), \
      lengths


class DeltaCheckpointManager:
  """Saves a tree every step as a base checkpoint or a small delta on the previous step.

  Args:
    directory: where the Orbax ``CheckpointManager`` keeps the steps.
    plan: the plan of the saved trees; trees are stored in its rollout dtypes.
    rebase_every: a delta chain holds at most this many deltas, then the next save is a base.
    max_to_keep: keep the newest ``max_to_keep`` steps restorable (None: all); a base or a delta
      that a kept step needs is never deleted.
    coding: how delta steps are coded: ``"positioned"`` (the default: the least work on
      either side), ``"ranked"`` (the fewest bytes, coded on the host), ``"packed"``
      (bit-packed on the devices: no per-change work on the host, as few bytes), or ``"auto"``
      (per step, the coding that stores fastest at ``link_gbit``); see
      :class:`~jsparse.Coding`.
    link_gbit: for ``coding="auto"``, the storage's write bandwidth in Gbit/s.

  Saves are synchronous: ``save`` returns once the step is committed. A manager reopened on an
  existing directory continues the newest chain (it restores the newest step to diff against).

  Raises:
    ConfigError: a bad ``rebase_every``, ``max_to_keep`` or ``coding``.

  >>> import tempfile, jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(1000)}, rollout_dtype=jnp.bfloat16)
  >>> with jsparse.DeltaCheckpointManager(tempfile.mkdtemp(), plan, rebase_every=2) as chain:
  ...   infos = [chain.save(step, {'w': jnp.full(1000, step, jnp.float32)}) for step in range(4)]
  ...   restored = chain.restore(2)
  >>> [info.kind for info in infos], float(restored['w'][0])
  (['base', 'delta', 'delta', 'base'], 2.0)
  """

  def __init__(self, directory: str | os.PathLike, plan: Plan, *, rebase_every: int = 10,
               max_to_keep: int | None = None, coding: Coding | str = Coding.POSITIONED,
               link_gbit: float = DEFAULT_LINK_GBIT):
    self.coding = coding_option(coding)
    self.link_gbit = float_option("link_gbit", link_gbit, minimum=1e-6)
    self.rebase_every = int_option("rebase_every", rebase_every, minimum=0)
    self.max_to_keep = int_option("max_to_keep", max_to_keep, minimum=1, optional=True)
    self.directory = Path(directory).absolute()  # (Orbax refuses a relative path)
    self.plan = plan
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False, create=True))
    self._meta: dict[int, dict] = {}
    self._sender: Sender | None = None  # diffs against the newest step; None: resume lazily

  def __enter__(self) -> "DeltaCheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    self._manager.close()

  def all_steps(self) -> list[int]:
    """The committed steps, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_bytes(self, step: int) -> int:
    """Bytes on disk of one step's checkpoint."""
    root = self.directory / str(step)
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())

  def meta(self, step: int) -> dict:
    """The JSON metadata of a step: ``kind`` ("base" or "delta"; "parts" in older chains),
    ``base``, ``parent`` ...

    Raises:
      CheckpointError: the step is missing or its metadata unreadable.
    """
    if step not in self._meta:
      if step not in self._manager.all_steps():
        raise CheckpointError(f"step {step} is not in {self.directory}")
      try:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
      except Exception as e:  # Orbax raises many kinds for a damaged directory
        raise CheckpointError(f"step {step}: metadata unreadable ({type(e).__name__}: {e})") from e
      self._meta[step] = chain_meta.check(dict(meta) if isinstance(meta, dict) else meta, step,
                                          self.plan)
    return self._meta[step]

  def chain(self, step: int) -> list[int]:
    """The steps to restore ``step`` from: its base, then each delta up to ``step``.

    Raises:
      CheckpointError: a step of the chain is missing or unreadable (named in the message).
    """
    steps = [step]
    while self.meta(steps[-1])["kind"] != "base":  # parents are earlier steps: this ends
      meta = self.meta(steps[-1])
      parent = meta["parent"]
      if parent not in self._manager.all_steps():
        raise CheckpointError(f"step {parent} is missing: step {steps[-1]} is a delta on it, so "
                              f"step {step} cannot be restored")
      if self.meta(parent)["base"] != meta["base"] or self.meta(parent)["digest"] != \
          meta["parent_digest"]:
        raise CheckpointError(f"step {steps[-1]}: its parent {parent} is not the step it was "
                              "saved on (another chain's step, or corrupted)")
      steps.append(parent)
    return steps[::-1]

  def save(self, step: int, params: PyTree, *, force_base: bool = False) -> SaveInfo:
    """Saves ``params`` (trainer or rollout dtypes) as ``step``, newer than every saved step.

    Returns:
      A :class:`SaveInfo`: the kind of step written, the changed elements, the bytes on disk.

    Raises:
      CheckpointError: ``step`` is not newer than the latest saved step.
      PlanMismatchError: ``params`` do not match the plan (the leaf is named).
    """
    step = int_option("step", step, minimum=0)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise CheckpointError(f"step {step} must be newer than the latest saved step {latest}")
    sender = self._resume(params) if self._sender is None else self._sender
    self._sender = None  # until this step is committed
    chain_length = len(self.chain(sender.version)) if sender is not None else 0
    if force_base or sender is None or chain_length > self.rebase_every:
      sender = self._sender_of(params, step)
      meta = chain_meta.base_meta(self.plan, step=step, digest=sender.digest)
      items = {"params": ocp.args.StandardSave(storable(self.plan, sender.snapshot))}
      if not self.plan.leaves:
        items = {}  # Orbax refuses an empty item; the meta says it all
    else:  # the version's parts, one per process
      parent, parent_digest = sender.version, sender.digest
      part = sender.send(params, version=step)
      rows, lengths = _rows_of_parts(part)
      meta = chain_meta.parts_meta(self.plan, step=step, parent=parent,
                                   base=self.meta(parent)["base"], parent_digest=parent_digest,
                                   digest=sender.digest, changed=sender.last_stats.changed,
                                   lengths=lengths)
      items = {"parts": ocp.args.StandardSave({"bytes": rows})}
    self._manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items),
                       force=True)
    self._manager.wait_until_finished()
    self._meta[step] = meta
    self._sender = sender
    self._apply_retention()
    coding = None if meta["kind"] == "base" else sender.last_stats.coding
    return SaveInfo(step, meta["kind"], meta["changed"], self.step_bytes(step), coding)

  def restore(self, step: int | None = None, *, shardings: PyTree | None = None) -> PyTree:
    """Restores ``step`` (default: the newest) bit-exactly, in rollout dtypes.

    Args:
      step: the step to restore.
      shardings: a tree of shardings (the plan's structure) to restore onto, e.g. another mesh
        than the one the steps were saved from; None: the default device.

    Raises:
      CheckpointError: a step of the chain is missing, unreadable or corrupted (named), or the
        chain was saved with another plan.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.directory}")
    steps = self.chain(step)
    base = self.plan.rollout_shapes(shardings)  # an empty tree, when the plan has no leaves
    if self.plan.leaves:
      target = ocp.args.StandardRestore(storable_shapes(self.plan, shardings))
      base = from_storable(self.plan, self._restore_item(steps[0], "params", target))
    try:
      receiver = Receiver(self.plan, base, version=steps[0])
    except JsparseError as e:
      raise CheckpointError(f"step {steps[0]}: restored base does not fit the plan: {e}") from e
    self._check_digest(steps[0], receiver)
    for s in steps[1:]:
      meta = self.meta(s)
      try:
        if "lengths" in meta:  # the version's parts (every step this jsparse writes)
          rows = np.zeros((len(meta["lengths"]), max(meta["lengths"])), np.uint8)
          rows = self._restore_item(s, "parts", ocp.args.StandardRestore({"bytes": rows}))
          receiver.receive([np.asarray(row[:n]).tobytes()
                            for row, n in zip(rows["bytes"], meta["lengths"])])
          continue
        # Arrays of a positioned payload, which chains stored before they stored parts.
        target = ocp.args.StandardRestore(_delta_target(self.plan, meta))
        arrays = self._restore_item(s, "delta", target)
        receiver.receive(check_records(self.plan, _payload_from_arrays(self.plan, meta, arrays)))
      except JsparseError as e:
        raise CheckpointError(f"step {s}: delta is corrupted ({e}); steps up to {s - 1} of "
                              "this chain are restorable") from e
    return receiver.params

  def _restore_item(self, step: int, name: str, target: Any) -> Any:
    try:
      return self._manager.restore(step, args=ocp.args.Composite(**{name: target}))[name]
    except Exception as e:  # a damaged step surfaces as various Orbax/tensorstore errors
      raise CheckpointError(f"step {step}: cannot read its {name} "
                            f"({type(e).__name__}: {e})") from e

  def _check_digest(self, step: int, receiver: Receiver) -> None:
    if receiver.digest.hex() != self.meta(step)["digest"]:
      raise CheckpointError(f"step {step}: restored base does not match its digest (corrupted)")

  def _resume(self, params: PyTree) -> Sender | None:
    """A sender holding the newest step, restored where ``params`` live (None: start a base)."""
    latest = self.latest_step()
    if latest is None:
      return None
    shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x, jax.Array) else None, params)
    try:
      restored = self.restore(latest, shardings=shardings)
    except ForeignPlanError as e:
      raise CheckpointError(f"{self.directory} holds steps saved with another plan; save this "
                            f"plan's chain in another directory ({e})") from e
    except CheckpointError as e:
      logging.warning("jsparse: cannot continue the chain of step %d (%s); starting a base",
                      latest, e)
      return None
    return self._sender_of(restored, latest)

  def _sender_of(self, params: PyTree, step: int) -> Sender:
    """A sender of this chain's deltas, holding ``params`` as ``step``."""
    return Sender(self.plan, params, version=step, coding=self.coding, link_gbit=self.link_gbit)

  def _apply_retention(self) -> None:
    if self.max_to_keep is None:
      return
    steps = self.all_steps()
    keep = set()
    for step in steps[-self.max_to_keep:]:
      try:
        keep.update(self.chain(step))
      except CheckpointError as e:  # a damaged old step: delete nothing, say so
        logging.warning("jsparse: retention skipped, step %d's chain is unreadable (%s)", step, e)
        return
    for step in steps:
      if step not in keep:
        self._manager.delete(step)
        self._meta.pop(step, None)

