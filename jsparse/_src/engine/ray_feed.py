"""A feed in Ray's object store: parts are Ray objects, put once by the trainer process that
made them; a small registry actor lists which versions are complete and hands out the object
references. Every rollout actor pulls the parts it needs from the object store (zero-copy on its
node), so fanning out to N rollouts does not multiply the trainer's egress.

Reads have a timeout; a part whose owner died (the trainer process that put it), or that the
object store lost, is a :class:`~jsparse.engine.PartsLostError`, which a subscriber answers by
asking for an anchor. (The example is :class:`RayFeed`'s.)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import ray
from ray import exceptions as ray_errors

from jsparse._src.engine.feed import (ROLLOUT_ID, STATUS_BYTES, Entry, _sort_key, check_checksums,
                                      check_part_number, check_run_id, check_sizes)
from jsparse._src.errors import ConfigError, PartsLostError


@ray.remote(num_cpus=0)
class _Registry:
  """The feed's bookkeeping: per entry, the references of the parts put so far."""

  def __init__(self):
    self._parts: dict[Entry, dict[int, Any]] = {}
    self._commits: dict[Entry, bytes] = {}
    self._generations: dict[int, bytes] = {}
    self._statuses: dict[str, bytes] = {}
    self._anchor_requested = False
    self._run: bytes | None = None

  def put(self, entry: Entry, part: int, ref: list) -> None:
    self._parts.setdefault(entry, {})[part] = ref[0]  # in a list: Ray keeps it a reference

  def commit(self, entry: Entry, record: bytes) -> bytes | None:
    if len(self._parts.get(entry, ())) != entry.parts:
      return None
    return self._commits.setdefault(entry, bytes(record))

  def entries(self) -> list[Entry]:
    return sorted(self._commits, key=_sort_key)

  def read_commit(self, entry: Entry) -> bytes | None:
    return self._commits.get(entry)

  def remove_commit(self, entry: Entry) -> None:
    self._commits.pop(entry, None)

  def pending(self) -> list[Entry]:
    return sorted((e for e in self._parts if e not in self._commits), key=_sort_key)

  def refs(self, entry: Entry) -> list | None:
    parts = self._parts.get(entry)
    if entry not in self._commits or parts is None:
      return None
    return [[parts[i] for i in range(entry.parts)]]

  def remove(self, entry: Entry) -> None:
    self._parts.pop(entry, None)  # the objects are freed once no reader holds them
    self._commits.pop(entry, None)

  def generations(self) -> list[int]:
    return sorted(self._generations)

  def read_generation(self, generation: int) -> bytes | None:
    return self._generations.get(generation)

  def claim_generation(self, generation: int, record: bytes) -> bool:
    if generation in self._generations:
      return False
    self._generations[generation] = bytes(record)
    return True

  def run_id(self) -> bytes | None:
    return self._run

  def claim_run(self, run_id: bytes) -> bytes:
    if self._run is None:
      self._run = bytes(run_id)
    return self._run

  def put_status(self, rollout: str, record: bytes) -> None:
    self._statuses[rollout] = bytes(record)

  def statuses(self) -> dict[str, bytes]:
    return dict(self._statuses)

  def remove_status(self, rollout: str) -> None:
    self._statuses.pop(rollout, None)

  def request_anchor(self) -> None:
    self._anchor_requested = True

  def take_anchor_request(self) -> bool:
    requested, self._anchor_requested = self._anchor_requested, False
    return requested


class RayFeed:
  """A feed of parts held in Ray's object store (see the module docstring). Picklable: pass it
  to trainer and rollout actors.

  Args:
    registry: the registry actor's handle (use :meth:`create` or :meth:`connect`).
    timeout: seconds a read waits for a part before it counts as lost.

  >>> import ray
  >>> _ = ray.init(address="local", num_cpus=1, include_dashboard=False,
  ...              _node_ip_address="127.0.0.1", log_to_driver=False)
  >>> feed = RayFeed.create("doctest-feed")  # pass it to the trainer and rollout actors
  >>> feed.put(Entry(1, "delta", 0, 1), 0, b"part")
  >>> feed.commit(Entry(1, "delta", 0, 1), b"its commit")
  b'its commit'
  >>> [e.version for e in feed.entries()], bytes(feed.parts(Entry(1, "delta", 0, 1))[0])
  ([1], b'part')
  >>> feed.put(Entry(2, "delta", 1, 2), 0, b"half")  # a publish that failed half-way
  >>> [e.version for e in feed.pending()]
  [2]
  >>> ray.shutdown()
  """

  def __init__(self, registry, *, timeout: float = 60.0):
    self._registry = registry
    self.timeout = timeout

  @classmethod
  def create(cls, name: str = "jsparse-feed", *, timeout: float = 60.0) -> "RayFeed":
    """A new feed whose registry is the named actor ``name`` (in the current namespace)."""
    return cls(_Registry.options(name=name).remote(), timeout=timeout)

  @classmethod
  def connect(cls, name: str = "jsparse-feed", *, timeout: float = 60.0) -> "RayFeed":
    """The feed another process created under ``name``."""
    return cls(ray.get_actor(name), timeout=timeout)

  def _call(self, method: str, *args):
    try:
      return ray.get(getattr(self._registry, method).remote(*args), timeout=self.timeout)
    except (ray_errors.RayActorError, ray_errors.GetTimeoutError) as e:
      raise PartsLostError(f"the feed's registry did not answer {method}: {e}") from e

  def put(self, entry: Entry, part: int, data: bytes) -> None:
    """Puts ``data`` into the object store (owned by this process) and registers it."""
    check_part_number(entry, part)
    ref = ray.put(np.frombuffer(data, np.uint8))
    self._call("put", entry, part, [ref])

  def commit(self, entry: Entry, record: bytes) -> bytes:
    """Commits ``entry`` with ``record`` unless it is committed already; returns the record it
    holds.

    Raises:
      PartsLostError: a part was not registered, or the registry did not answer.
    """
    held = self._call("commit", entry, bytes(record))
    if held is None:
      raise PartsLostError(f"not every part of version {entry.version} ({entry.kind}) is "
                           "registered: not committed")
    return held

  def entries(self) -> list[Entry]:
    """The committed entries, by version."""
    return self._call("entries")

  def read_commit(self, entry: Entry) -> bytes:
    """The commit record of ``entry``.

    Raises:
      PartsLostError: it is not committed (or was removed).
    """
    held = self._call("read_commit", entry)
    if held is None:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) is no longer in the feed")
    return held

  def remove_commit(self, entry: Entry) -> None:
    """Drops ``entry``'s commit (e.g. a forged one), not its parts."""
    self._call("remove_commit", entry)

  def generations(self) -> list[int]:
    """The generations claimed in this feed, ascending."""
    return self._call("generations")

  def read_generation(self, generation: int) -> bytes:
    """The record of a generation's claim."""
    held = self._call("read_generation", generation)
    if held is None:
      raise PartsLostError(f"generation {generation} is not claimed in this feed")
    return held

  def claim_generation(self, generation: int, record: bytes) -> bool:
    """Claims ``generation`` with ``record`` (the registry serializes claims): True if this
    call made the claim."""
    return self._call("claim_generation", generation, bytes(record))

  def pending(self) -> list[Entry]:
    """The entries with some parts put and not all (e.g. a publish that failed), by version:
    :meth:`remove` drops them (their objects are freed once no reader holds them)."""
    return self._call("pending")

  def parts(self, entry: Entry, expected: Sequence | None = None,
            check_digests: bool = True) -> list[np.ndarray]:
    """The parts of ``entry`` as read-only byte arrays (sliced by the receiver), each checked
    against its commit (``expected``: size and checksum; parts arrive whole, so the checksum
    is always checked when given).

    Raises:
      PartsLostError: the entry was removed, a part's owner died or the store lost it, a read
        timed out, or a part is not what its commit says.
    """
    refs = self._call("refs", entry)
    if refs is None:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) is no longer in the feed")
    try:
      found = ray.get(refs[0], timeout=self.timeout)
    except (ray_errors.ObjectLostError, ray_errors.GetTimeoutError, ray_errors.RayTaskError,
            ray_errors.WorkerCrashedError) as e:
      raise PartsLostError(f"version {entry.version} ({entry.kind}): a part is lost "
                           f"({type(e).__name__})") from e
    if expected is not None:
      check_sizes(found, expected, entry)
      check_checksums(found, expected, entry)
    return found

  def remove(self, entry: Entry) -> None:
    """Drops an entry, committed or pending, from the registry."""
    self._call("remove", entry)

  def run_id(self) -> bytes | None:
    """The id of the run this feed belongs to (None before a publisher claimed it)."""
    return self._call("run_id")

  def claim_run(self, run_id: bytes) -> bytes:
    """Makes ``run_id`` the feed's run unless it has one (the registry serializes claims);
    returns the feed's run."""
    check_run_id(run_id)
    return self._call("claim_run", bytes(run_id))

  def put_status(self, rollout: str, record: bytes) -> None:
    """Replaces rollout ``rollout``'s status with ``record``."""
    if not ROLLOUT_ID.match(rollout) or len(record) > STATUS_BYTES:
      raise ConfigError(f"a status of rollout {rollout!r:.80}: bad id, or over {STATUS_BYTES} B")
    self._call("put_status", rollout, bytes(record))

  def statuses(self) -> dict[str, bytes]:
    """Every rollout's status record, by rollout id."""
    return {k: v for k, v in self._call("statuses").items()
            if ROLLOUT_ID.match(k) and len(v) <= STATUS_BYTES}

  def remove_status(self, rollout: str) -> None:
    """Deletes rollout ``rollout``'s status."""
    self._call("remove_status", rollout)

  def request_anchor(self) -> None:
    self._call("request_anchor")

  def take_anchor_request(self) -> bool:
    return self._call("take_anchor_request")
