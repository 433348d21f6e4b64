"""A feed in Ray's object store: parts are Ray objects, put once by the trainer process that
made them; a small registry actor lists which versions are complete and hands out the object
references. Every rollout actor pulls the parts it needs from the object store (zero-copy on its
node), so fanning out to N rollouts does not multiply the trainer's egress.

Reads have a timeout; a part whose owner died (the trainer process that put it), or that the
object store lost, is a :class:`~jsparse.engine.PartsLostError`, which a subscriber answers by
asking for an anchor. (The example is :class:`RayFeed`'s.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
from ray import exceptions as ray_errors

from jsparse._src.engine.feed import KINDS, Entry, PartsLostError


@ray.remote(num_cpus=0)
class _Registry:
  """The feed's bookkeeping: per entry, the references of the parts put so far."""

  def __init__(self):
    self._parts: dict[Entry, dict[int, Any]] = {}
    self._anchor_requested = False
    self._run: bytes | None = None

  def put(self, entry: Entry, part: int, ref: list) -> None:
    self._parts.setdefault(entry, {})[part] = ref[0]  # in a list: Ray keeps it a reference

  def entries(self) -> list[Entry]:
    done = [e for e, parts in self._parts.items() if len(parts) == e.parts]
    return sorted(done, key=lambda e: (e.version, KINDS.index(e.kind)))

  def pending(self) -> list[Entry]:
    begun = [e for e, parts in self._parts.items() if len(parts) < e.parts]
    return sorted(begun, key=lambda e: (e.version, KINDS.index(e.kind)))

  def refs(self, entry: Entry) -> list | None:
    parts = self._parts.get(entry)
    return None if parts is None else [[parts[i] for i in range(entry.parts)]]

  def remove(self, entry: Entry) -> None:
    self._parts.pop(entry, None)  # the objects are freed once no reader holds them

  def run_id(self) -> bytes | None:
    return self._run

  def claim_run(self, run_id: bytes) -> bytes:
    if self._run is None:
      self._run = bytes(run_id)
    return self._run

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
  >>> feed.entries(), bytes(feed.parts(Entry(1, "delta", 0, 1))[0])
  ([Entry(version=1, kind='delta', base=0, parts=1)], b'part')
  >>> feed.put(Entry(2, "delta", 1, 2), 0, b"half")  # a publish that failed half-way
  >>> feed.pending()
  [Entry(version=2, kind='delta', base=1, parts=2)]
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
    ref = ray.put(np.frombuffer(data, np.uint8))
    self._call("put", entry, part, [ref])

  def entries(self) -> list[Entry]:
    """The committed entries (every part put), by version."""
    return self._call("entries")

  def pending(self) -> list[Entry]:
    """The entries with some parts put and not all (e.g. a publish that failed), by version:
    :meth:`remove` drops them (their objects are freed once no reader holds them)."""
    return self._call("pending")

  def parts(self, entry: Entry) -> list[np.ndarray]:
    """The parts of ``entry`` as read-only byte arrays (sliced by the receiver).

    Raises:
      PartsLostError: the entry was removed, a part's owner died or the store lost it, or a
        read timed out.
    """
    refs = self._call("refs", entry)
    if refs is None:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) is no longer in the feed")
    try:
      return ray.get(refs[0], timeout=self.timeout)
    except (ray_errors.ObjectLostError, ray_errors.GetTimeoutError, ray_errors.RayTaskError,
            ray_errors.WorkerCrashedError) as e:
      raise PartsLostError(f"version {entry.version} ({entry.kind}): a part is lost "
                           f"({type(e).__name__})") from e

  def remove(self, entry: Entry) -> None:
    """Drops an entry, committed or pending, from the registry."""
    self._call("remove", entry)

  def run_id(self) -> bytes | None:
    """The id of the run this feed belongs to (None before a publisher claimed it)."""
    return self._call("run_id")

  def claim_run(self, run_id: bytes) -> bytes:
    """Makes ``run_id`` the feed's run unless it has one (the registry serializes claims);
    returns the feed's run."""
    return self._call("claim_run", bytes(run_id))

  def request_anchor(self) -> None:
    self._call("request_anchor")

  def take_anchor_request(self) -> bool:
    return self._call("take_anchor_request")
