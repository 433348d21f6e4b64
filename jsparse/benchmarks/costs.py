"""XLA's cost model of one sync: the bytes that the device programs of a send and of a receive
access, against the same measure of their floors.

Every XLA program that runs during a ``Sender.send`` (the sender's side) and during the
``Receiver.receive`` of its payload (the receiver's) is counted, on any thread, and its
``cost_analysis()["bytes accessed"]`` summed, once per run. The floors are measured the same
way: for the send, a jitted compare-and-count of the old bf16 tree and the new params (every
element read once, nothing written); for the receive, a jitted dense cast and copy of the params.
Unlike a timing, the result is the same on every run on one kind of machine: the best measure
of how far a pass is from its floor until an accelerator times it. Bytes accessed is XLA's
estimate (loops count each trip; fused operands once per fusion).

>>> import jax.numpy as jnp, jsparse
>>> params = {'w': jnp.arange(4096.0)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> row = sync_cost(plan, params, {'w': params['w'].at[::64].add(1.0)}, jsparse.Coding.RANKED)
>>> row['send_bytes'] > 0 and row['receive_bytes'] > 0 and row['send_programs'] >= 1
True
"""

from __future__ import annotations

import collections
from typing import Any, Iterable

import jax

import jsparse
from jsparse.benchmarks import _internals, sync

FIXED_CODINGS = tuple(c for c in jsparse.Coding if c is not jsparse.Coding.AUTO)
# the default, the fewest bytes (whose receiver builds class tables) and the device-coded one
LARGE_STEP_CODINGS = (jsparse.Coding.POSITIONED, jsparse.Coding.RANKED, jsparse.Coding.PACKED)


COUNT_PASS = "jit_counts_program"  # what only a sender's first delta runs


def _name(executable: Any) -> str:
  try:
    return executable.hlo_modules()[0].name
  except Exception:  # noqa: BLE001 - an executable that does not say
    return ""


def first_delta_only(runs: collections.Counter) -> tuple[collections.Counter,
                                                          collections.Counter]:
  """The counted runs split in two: what any delta runs, and the counting pass that only a
  sender's first delta runs (it sizes the diff's slots; later deltas are sized by the last)."""
  steady, first = collections.Counter(), collections.Counter()
  for executable, count in runs.items():
    (first if _name(executable) == COUNT_PASS else steady)[executable] += count
  return steady, first


def bytes_accessed(runs: collections.Counter) -> float:
  """The bytes XLA's cost model says the counted runs access (each run of a program counts)."""
  total = 0.0
  for executable, count in runs.items():
    analysis = executable.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # one per device program, on older jaxlibs
      analysis = analysis[0] if analysis else {}
    total += count * float(analysis.get("bytes accessed", 0.0))
  return total


def floor_costs(plan: jsparse.Plan, before: Any, after: Any) -> dict:
  """Bytes accessed by the two floors (compiled first, outside the count)."""
  snapshot = plan.cast(before)
  floor, dense_copy = sync._floor_programs(plan)  # pylint: disable=protected-access
  jax.block_until_ready((floor(plan, snapshot, after), dense_copy(after)))
  with _internals.executed_programs() as compare:
    jax.block_until_ready(floor(plan, snapshot, after))
  with _internals.executed_programs() as copy:
    jax.block_until_ready(dense_copy(after))
  return {"compare-and-count": bytes_accessed(compare), "dense copy": bytes_accessed(copy)}


def sync_cost(plan: jsparse.Plan, before: Any, after: Any, coding: jsparse.Coding,
              floors: dict | None = None) -> dict:
  """One sync of ``before`` to ``after`` in ``coding``, counted once its programs are
  compiled (a first sync compiles them, and the slot levels it asks for are waited for):
  bytes accessed and program runs per side, and each side over its floor. The send is a
  sender's first delta, less its counting pass (``first_delta_bytes``), which later deltas
  do not run: what every delta's send runs."""
  floors = floors or floor_costs(plan, before, after)
  snapshot = plan.cast(before)

  def fresh() -> tuple:
    return (jsparse.Sender(plan, before, coding=coding),
            jsparse.Receiver(plan, jax.tree.map(lambda x: x.copy(), snapshot)))

  sender, receiver = fresh()
  jax.block_until_ready(receiver.receive(sender.send(after)))
  _internals.programs.SLOT_LEVELS.wait(timeout=600)
  sender, receiver = fresh()
  jax.block_until_ready((sender.snapshot, receiver.params))
  with _internals.executed_programs() as sent:
    data = sender.send(after)
  with _internals.executed_programs() as received:
    jax.block_until_ready(receiver.receive(data))
  sent, counting = first_delta_only(sent)
  send, receive = bytes_accessed(sent), bytes_accessed(received)
  return {"send_bytes": send, "receive_bytes": receive,
          "first_delta_bytes": bytes_accessed(counting),
          "send_programs": sum(sent.values()), "receive_programs": sum(received.values()),
          "send_x_floor": send / floors["compare-and-count"],
          "receive_x_floor": receive / floors["dense copy"], "payload_bytes": len(data),
          "changed": sender.last_stats.changed}


def cost_table(plan: jsparse.Plan, before: Any, after: Any,
               codings: Iterable[jsparse.Coding] = FIXED_CODINGS) -> dict:
  """:func:`sync_cost` of every coding of ``codings`` on one update, and the floors."""
  floors = floor_costs(plan, before, after)
  return {"params": plan.num_elements, "floors": floors,
          "codings": {c.value: sync_cost(plan, before, after, c, floors) for c in codings}}


def print_cost_table(name: str, table: dict) -> None:
  floors = table["floors"]
  print(f"\nXLA's cost model of one sync, {name} ({table['params']:,} parameters): bytes "
        f"accessed by the device programs; floors: compare-and-count "
        f"{floors['compare-and-count'] / 1e6:,.1f} MB, dense cast+copy "
        f"{floors['dense copy'] / 1e6:,.1f} MB")
  print(f"{'coding':<20}{'send MB':>10}{'x floor':>9}{'runs':>6}{'receive MB':>12}{'x floor':>9}"
        f"{'runs':>6}")
  for coding, r in table["codings"].items():
    print(f"{coding:<20}{r['send_bytes'] / 1e6:>10,.1f}{r['send_x_floor']:>9.2f}"
          f"{r['send_programs']:>6}{r['receive_bytes'] / 1e6:>12,.1f}"
          f"{r['receive_x_floor']:>9.2f}{r['receive_programs']:>6}")
  first = max((r.get("first_delta_bytes", 0.0) for r in table["codings"].values()), default=0)
  print(f"(a sender's first delta also counts its changes: {first / 1e6:,.1f} MB, "
        f"{first / floors['compare-and-count']:.2f}x the floor, once)")
