"""Reading and re-coding a version's part in tests (``wire/parts.py``): its index, every unit's
record, and a part made of chosen records (to craft a part that is well formed but wrong)."""

from __future__ import annotations

import dataclasses

from jsparse._src.wire import parts as parts_wire


def read_part(plan, data) -> tuple:
  """``(index, records)`` of a part: its checked index and every unit's decoded record."""
  index = parts_wire.read_index(plan, data)
  return index, [parts_wire.read_unit(plan, index, data, i) for i in range(len(index.entries))]


def kind_of(plan, data):
  """The kind (delta or anchor) a part states."""
  return parts_wire.read_index(plan, data).header.kind


def modes_of(plan, data) -> list:
  """Each unit's mode, in the part's order (one unit per segment of a one-process sender)."""
  return [e.mode for e in parts_wire.read_index(plan, data).entries]


def recoded(plan, index, records, units=None, **header) -> bytes:
  """A part of ``records`` over ``units`` (default: the index's) under ``index``'s header with
  ``header``'s fields replaced."""
  units = [e.unit for e in index.entries] if units is None else units
  return parts_wire.encode_part(plan, dataclasses.replace(index.header, **header), units,
                                records)
