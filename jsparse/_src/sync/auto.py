"""``coding="auto"``: the coding that syncs fastest over a given link, from times measured on
the sender's own tree, re-decided as the workload moves.

A sync's time is its coding's work on both sides plus its bytes over the link. The work of a
coding depends on the tree (its leaves' sizes, how the plan chunks them) and on the machine as
much as on the changes, so it is measured where it will run: a *calibration* syncs one delta in
every candidate coding to a throwaway receiver (:func:`calibrate`: one run to compile, the best
of a few timed), giving each its seconds and its bytes per change. Each send then predicts, for
the changes of the delta before it::

  seconds(coding) = measured seconds + changes * bytes_per_change * 8 / bandwidth

and takes the least (:class:`AutoCoding`). Bytes per change depend on the density, and a
delta with almost no change, or one whose segments mostly overflowed (carried densely: every
coding sends the same dense bytes), tells the codings apart by nothing but fixed costs. So a
calibration counts only when it is *representative* (enough changes, most of them sparse);
until one is, the policy sends the fewest bytes (``ranked``), which is never far from the best
on a slow link. It calibrates again when the density moves by more than ``drift`` times from
the calibrated one, and the chosen coding's bytes per change follow what its sends really
carried. The link rate is read at every send (``Sender.link_gbit`` may change). Calibrations
are shared by the senders of one plan in a process (:func:`measured`). In a job of several
processes every process calibrates at once, on the whole tree: each receives every process's
part, a coding's seconds are the slowest process's and its bytes those of all parts, and
every process sends in process 0's choice; their bytes per change follow the calibration
alone (a process's part is not the version). The receiver is assumed to run on hardware like the sender's (its stages are timed
here). A calibration holds two more copies of the rollout weights while it runs, one coding at
a time.

>>> rates = {Coding.RANKED: CodingRate(0.050, 1.0), Coding.POSITIONED: CodingRate(0.030, 1.4)}
>>> choose(rates, 10**6, link_gbit=0.1).value, choose(rates, 10**6, link_gbit=100.0).value
('ranked', 'positioned')
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from jsparse._src.options import float_option
from jsparse._src.wire.payload import Coding

CANDIDATES = (Coding.PACKED, Coding.RANKED, Coding.POSITIONED)
FEWEST_BYTES = Coding.RANKED  # the choice until a representative calibration
DEFAULT_LINK_GBIT = 10.0
DEFAULT_DRIFT = 4.0
# A representative calibration: at least this many changes, or this share of the elements...
MIN_CHANGES = 1000
MIN_DENSITY = 1e-4
# ... of which at most this share overflowed (carried densely).
MAX_OVERFLOWED_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class CodingRate:
  """What a coding cost on the sender's tree, measured on a delta.

  Attributes:
    seconds: the work of one sync, sender and receiver (without the link).
    bytes_per_change: payload bytes per changed element.
  """

  seconds: float
  bytes_per_change: float

  def predict(self, changes: int, link_gbit: float) -> float:
    """Predicted seconds of a sync of ``changes`` over the link."""
    return self.seconds + changes * self.bytes_per_change * 8 / (link_gbit * 1e9)


def choose(rates: dict, changes: int, link_gbit: float) -> Coding:
  """The coding of ``rates`` with the least predicted seconds (ties: the earlier)."""
  return min(rates, key=lambda c: rates[c].predict(changes, link_gbit))


@dataclasses.dataclass(frozen=True)
class Update:
  """What a delta changed: its changes, the elements of the tree, the changes of segments that
  overflowed their capacity (carried densely)."""

  changes: int
  elements: int
  overflowed_changes: int = 0

  @property
  def density(self) -> float:
    return self.changes / max(1, self.elements)

  @property
  def representative(self) -> bool:
    """Whether the codings' bytes per change on this update tell them apart: enough changes,
    most of them coded sparsely."""
    return (self.changes >= min(MIN_CHANGES, MIN_DENSITY * self.elements)
            and self.changes > 0
            and self.overflowed_changes <= MAX_OVERFLOWED_SHARE * self.changes)


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What :func:`calibrate` measured: each candidate's :class:`CodingRate`, and the update it
  synced."""

  rates: dict
  update: Update

  @property
  def changes(self) -> int:
    return self.update.changes


# ``(coding, plan, old, new) -> (best seconds of a sync of old to new, payload bytes, update)``
TimedSync = Callable[[Coding, Any, Any, Any], tuple[float, int, Update]]

_LOCK = threading.Lock()
_RATES: dict[Any, Calibration] = {}  # by plan: the latest calibration


def calibrate(plan, old: Any, new: Any, timed_sync: TimedSync) -> Calibration:
  """Each candidate coding's :class:`CodingRate` for ``plan``, syncing ``old`` (the rollout's
  tree) to ``new`` (params) with ``timed_sync`` (the protocol's: this module knows no sender),
  one coding at a time; kept as the plan's latest (:func:`measured`)."""
  with _LOCK:
    started = time.perf_counter()
    rates, update = {}, None
    for coding in CANDIDATES:
      seconds, size, update = timed_sync(coding, plan, old, new)
      rates[coding] = CodingRate(seconds, size / max(1, update.changes))
    logging.getLogger("jsparse").info(
        "jsparse: coding='auto' measured %d codings on this tree in %.1f s (%d changes, %s): "
        "%s", len(rates), time.perf_counter() - started, update.changes,
        "representative" if update.representative else "not representative",
        ", ".join(f"{c.value} {1e3 * r.seconds:.1f} ms {r.bytes_per_change:.2f} B/change"
                  for c, r in rates.items()))
    _RATES[plan] = Calibration(rates, update)
    return _RATES[plan]


def measured(plan) -> Calibration | None:
  """The latest :func:`calibrate` of ``plan`` in this process (None: none yet)."""
  with _LOCK:
    return _RATES.get(plan)


class AutoCoding:
  """The policy behind ``coding="auto"``: per send, the candidate predicted fastest over the
  link (see the module docstring), calibrated when needed.

  Args:
    link_gbit: the link's bandwidth in Gbit/s (an attribute: set it when the link changes).
    drift: calibrate again when a delta's density moves more than this factor from the
      calibrated one.

  >>> policy = AutoCoding(link_gbit=1e-3)
  >>> empty = Calibration({c: CodingRate(0.01, 100.0) for c in CANDIDATES}, Update(0, 10**6))
  >>> policy.choose(None, lambda: empty).value  # nothing measured that tells codings apart
  'ranked'
  >>> rl = Calibration({Coding.RANKED: CodingRate(0.05, 1.0),
  ...                   Coding.POSITIONED: CodingRate(0.03, 1.4)}, Update(10_000, 10**6))
  >>> policy.choose(Update(10_000, 10**6), lambda: rl).value, policy.rates_used[Coding.POSITIONED]
  ('ranked', CodingRate(seconds=0.03, bytes_per_change=1.4))
  >>> policy.link_gbit = 1e3; policy.choose(Update(10_000, 10**6), lambda: rl).value
  'positioned'
  """

  def __init__(self, link_gbit: float = DEFAULT_LINK_GBIT, *, drift: float = DEFAULT_DRIFT):
    self.link_gbit = link_gbit
    self.drift = float_option("drift", drift, minimum=1.0)
    self.calibration: Calibration | None = None
    self.calibrations = 0  # how many this policy ran
    self.rates_used: dict | None = None  # the rates of the last choice (None: no calibration)
    self._observed: dict[Coding, float] = {}  # bytes per change its sends carried

  @property
  def link_gbit(self) -> float:
    return self._link_gbit

  @link_gbit.setter
  def link_gbit(self, value: float) -> None:
    self._link_gbit = float_option("link_gbit", value, minimum=1e-6)

  def _stale(self, last: Update | None) -> bool:
    """Whether to calibrate on this send, given the delta before it."""
    c = self.calibration
    if c is None:
      return True
    if last is None or not last.representative:
      return False  # what came last tells nothing new: keep what is measured
    if not c.update.representative:
      return True
    ratio = last.density / c.update.density
    return not 1 / self.drift <= ratio <= self.drift

  def choose(self, last: Update | None, calibrate: Callable[[], Calibration]) -> Coding:
    """The coding for a send whose previous delta was ``last`` (None: the first delta);
    ``calibrate()`` measures the candidates on this send's update when needed."""
    if self._stale(last):
      self.calibration = calibrate()
      self.calibrations += 1
      self._observed = {}
    c = self.calibration
    if not c.update.representative:
      self.rates_used = None
      return FEWEST_BYTES
    self.rates_used = {coding: CodingRate(r.seconds, self._observed.get(coding,
                                                                        r.bytes_per_change))
                       for coding, r in c.rates.items()}
    changes = last.changes if last is not None and last.representative else c.changes
    return choose(self.rates_used, changes, self.link_gbit)

  def observe(self, coding: Coding, update: Update, payload_bytes: int) -> None:
    """Records what a send in ``coding`` carried: its bytes per change replace the calibrated
    ones for the next choices (while the calibration holds)."""
    if update.representative:
      self._observed[coding] = payload_bytes / update.changes

  def adopt(self, calibration: Calibration | None, last: Update | None) -> None:
    """Takes another sender's calibration of the same plan, if this policy has none that is
    representative and it fits the density of ``last``."""
    if calibration is None or not calibration.update.representative:
      return
    if self.calibration is not None and self.calibration.update.representative:
      return
    if last is not None and last.representative:
      ratio = last.density / calibration.update.density
      if not 1 / self.drift <= ratio <= self.drift:
        return
    self.calibration, self._observed = calibration, {}
