"""``coding="auto"``: the coding that syncs fastest over a given link, from rates measured here.

A sync's time is its coding's work on both sides plus its bytes over the link. The work of each
coding is measured once per process (:func:`measured_rates`: a sender and a receiver on a
sample leaf of :data:`SAMPLE_ELEMENTS` fp32 weights, synced at two RL-like densities, ~1% and
~4%, each the best of a few runs), as seconds per element, seconds per change and bytes per
change. :func:`choose` then predicts, for a tree of ``n`` elements with ``k`` changes::

  seconds(coding) = n * per_element + k * per_change + k * bytes_per_change * 8 / bandwidth

and takes the least. The receiver is assumed to run on hardware like the sender's (its stages
are timed here). Slow links favour the fewest bytes (``ranked``); fast links on an accelerator
favour the least work (``packed`` or ``lists``).

>>> rates = {Coding.RANKED: CodingRate(1e-9, 1e-7, 1.0), Coding.LISTS: CodingRate(1e-9, 2e-8, 4.0)}
>>> choose(rates, 10**8, 10**6, link_gbit=0.1).value, choose(rates, 10**8, 10**6, 100.0).value
('ranked', 'lists')
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.wire.payload import Coding

CANDIDATES = (Coding.PACKED, Coding.PACKED_POSITIONED, Coding.RANKED, Coding.POSITIONED,
              Coding.LISTS)
SAMPLE_ELEMENTS = 1 << 20
DEFAULT_LINK_GBIT = 10.0
_STEPS = (1.5e-6, 6e-6)  # update sizes of the two samples: ~1% and ~4% of bf16 elements change
_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class CodingRate:
  """What a coding costs on this machine.

  Attributes:
    seconds_per_element: the sync's work per element of the tree (both sides).
    seconds_per_change: its work per changed element (both sides).
    bytes_per_change: payload bytes per changed element.
  """

  seconds_per_element: float
  seconds_per_change: float
  bytes_per_change: float

  def seconds(self, elements: int, changes: int, link_gbit: float) -> float:
    """Predicted seconds of a sync of ``changes`` among ``elements`` over the link."""
    return (elements * self.seconds_per_element + changes * self.seconds_per_change
            + changes * self.bytes_per_change * 8 / (link_gbit * 1e9))


def choose(rates: dict, elements: int, changes: int, link_gbit: float) -> Coding:
  """The coding of ``rates`` with the least predicted seconds (ties: the earlier)."""
  return min(rates, key=lambda c: rates[c].seconds(elements, changes, link_gbit))


def _sample(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {"w": (0.02 * rng.standard_normal(SAMPLE_ELEMENTS)).astype(np.float32)}


def _stepped(params: dict, step: float, seed: int) -> dict:
  sign = np.where(np.random.default_rng(seed).random(SAMPLE_ELEMENTS) < 0.5, -1.0, 1.0)
  return {"w": (params["w"] - step * sign).astype(np.float32)}


def _timed_sync(coding: Coding, plan, base: dict, new: dict) -> tuple[float, int, int]:
  """Best seconds of a send and a receive of ``base`` to ``new``, the payload bytes, and the
  changes."""
  from jsparse._src.sync.receiver import Receiver
  from jsparse._src.sync.sender import Sender
  best, size = float("inf"), 0
  for _ in range(_REPEATS + 1):  # the first compiles
    sender, receiver = Sender(plan, base, coding=coding), Receiver(plan, plan.cast(base))
    start = time.perf_counter()
    data = sender.send(new)
    jax.block_until_ready(receiver.receive(data))
    best, size = min(best, time.perf_counter() - start), len(data)
  return best, size, sender.last_stats.changed


_CALIBRATION = threading.Lock()


def measured_rates(backend: str | None = None) -> dict:
  """Each candidate coding's :class:`CodingRate` on ``backend`` (default: JAX's default),
  measured once per process (one thread at a time; most of it compiling: 15 s on an idle
  2-core CPU, more when it is busy). A sender with ``coding="auto"`` measures at its first
  delta; call this at start-up to measure earlier."""
  with _CALIBRATION:
    return _measured_rates(backend)


@functools.lru_cache(maxsize=None)
def _measured_rates(backend: str | None) -> dict:
  from jsparse._src.core.plan import make_plan
  with jax.default_device(jax.devices(backend)[0]):
    base = _sample(0)
    plan = make_plan(base, rollout_dtype=jnp.bfloat16, capacity=0.2)
    news = [_stepped(base, step, k + 1) for k, step in enumerate(_STEPS)]
    rates = {}
    for coding in CANDIDATES:
      (t1, b1, k1), (t2, b2, k2) = (_timed_sync(coding, plan, base, new) for new in news)
      per_change = (t2 - t1) / max(1, k2 - k1)
      per_element = (t1 - per_change * k1) / SAMPLE_ELEMENTS
      if per_change <= 0 or per_element < 0:  # timing noise: charge it all per change
        per_change, per_element = t2 / max(1, k2), 0.0
      rates[coding] = CodingRate(per_element, per_change, (b1 + b2) / max(1, k1 + k2))
  return rates
