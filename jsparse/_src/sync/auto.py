"""``coding="auto"``: the coding that syncs fastest over a given link, from times measured on
the sender's own tree.

A sync's time is its coding's work on both sides plus its bytes over the link. The work of a
coding depends on the tree (its leaves' sizes, how the plan chunks them) and on the machine as
much as on the changes, so it is measured where it will run: at the first delta of a
``coding="auto"`` sender, every candidate coding syncs that delta once to a throwaway receiver
(:func:`calibrate`: one run to compile, the best of a few timed), giving its seconds and its
bytes per change. Each send then predicts, for the ``k`` changes of the send before it (or of
the calibration's), and before its diff (which ranks the changes only for a ranked coding)::

  seconds(coding) = measured seconds + k * bytes_per_change * 8 / bandwidth

and takes the least. Measured once per plan and process; the receiver is assumed to run on
hardware like the sender's (its stages are timed here). Slow links favour the fewest bytes
(``ranked``), fast links the least work. The calibration holds two more copies of the rollout
weights while it runs, one coding at a time.

>>> rates = {Coding.RANKED: CodingRate(0.050, 1.0), Coding.LISTS: CodingRate(0.030, 4.0)}
>>> choose(rates, 10**6, link_gbit=0.1).value, choose(rates, 10**6, link_gbit=100.0).value
('ranked', 'lists')
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from jsparse._src.wire.payload import Coding

CANDIDATES = (Coding.PACKED, Coding.PACKED_POSITIONED, Coding.RANKED, Coding.POSITIONED,
              Coding.LISTS)
DEFAULT_LINK_GBIT = 10.0


@dataclasses.dataclass(frozen=True)
class CodingRate:
  """What a coding cost on the sender's tree, measured on its first delta.

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
class Calibration:
  """What :func:`calibrate` measured on a tree: each candidate's :class:`CodingRate`, and the
  changes of the update it synced."""

  rates: dict
  changes: int


_LOCK = threading.Lock()
_RATES: dict[Any, Calibration] = {}  # by plan


# ``(coding, plan, old, new) -> (best seconds of a sync of old to new, payload bytes, changes)``
TimedSync = Callable[[Coding, Any, Any, Any], tuple[float, int, int]]


def calibrate(plan, old: Any, new: Any, timed_sync: TimedSync) -> Calibration:
  """Each candidate coding's :class:`CodingRate` for ``plan``, syncing ``old`` (the rollout's
  tree) to ``new`` (params) with ``timed_sync`` (the protocol's: this module knows no sender):
  measured at the first call for a plan in this process (one at a time), then returned as
  measured."""
  with _LOCK:
    if plan not in _RATES:
      started = time.perf_counter()
      rates = {}
      for coding in CANDIDATES:
        seconds, size, changes = timed_sync(coding, plan, old, new)
        rates[coding] = CodingRate(seconds, size / max(1, changes))
      logging.getLogger("jsparse").info(
          "jsparse: coding='auto' measured %d codings on this tree in %.1f s: %s", len(rates),
          time.perf_counter() - started,
          ", ".join(f"{c.value} {1e3 * r.seconds:.1f} ms {r.bytes_per_change:.2f} B/change"
                    for c, r in rates.items()))
      _RATES[plan] = Calibration(rates, changes)
    return _RATES[plan]


def measured(plan) -> Calibration | None:
  """What :func:`calibrate` measured for ``plan`` in this process (None: not yet)."""
  with _LOCK:
    return _RATES.get(plan)
