"""The only place the benchmarks reach into jsparse's private modules (``jsparse._src``).

The benchmarks otherwise use the public API (``jsparse``, ``jsparse.engine``,
``jsparse.quantized``). What follows they use on purpose: they time and size one stage of a
sync at a time (the jitted device programs of diff and apply, the host's encode and decode, the
the part's coding), count bit flips, and throttle a feed to a link's bandwidth. None of it is API: it may
change with any release, and the benchmarks change with it. Everything a user does (send,
receive, stream, publish, subscribe) goes through the public names, in the benchmarks too.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

# Bit patterns of floats (bit-flip counts, the XOR + zstd baseline, the raw index format).
from jsparse._src.core import bits as bits_lib
# The device programs of diff and apply, their inputs and outputs (times and compiled memory of
# each stage, apart from the host's).
from jsparse._src.core.chunks import chunks_of
from jsparse._src.core.delta import apply_program, diff_program
from jsparse._src.core.placement import layouts_of
from jsparse._src.core.units import owned_units
from jsparse._src.sync import packed_units, programs
from jsparse._src.sync.parts import (PartsReader, changes_of_units, part_records, read_parts,
                                     sparse_inputs)
from jsparse._src.sync.staging import StagedRecords
# The wire: the host's coding and reading of a part, apart from the device stages.
from jsparse._src.wire.packed import PackedRecord
from jsparse._src.wire.parts import PartHeader, encode_part, read_index, read_unit
from jsparse._src.wire.payload import Format, Kind
# A feed throttled to a link's bandwidth (the simulated 1 and 10 Gbit/s links).
from jsparse._src.engine.link import ThrottledFeed, TokenBucket

to_bits = bits_lib.to_bits


@contextlib.contextmanager
def executed_programs() -> Iterator[collections.Counter]:
  """Counts every XLA executable run inside the block, on any thread: a ``Counter`` from the
  executable to its runs (XLA's cost model of each is ``executable.cost_analysis()``).

  JAX runs a compiled program from C++ once it has run it from Python; inside the block those
  fast paths are off, so that every run passes the one Python call that is counted (a
  measurement of the cost model, not of time: dispatch is slower meanwhile). This reaches into
  JAX's internals (``pjit``, ``pxla``) and is for the benchmark only.
  """
  from jax._src import pjit as pjit_lib
  from jax._src import stages
  from jax._src.interpreters import pxla
  runs: collections.Counter = collections.Counter()
  saved = (pxla.ExecuteReplicated.__call__, pjit_lib._get_fastpath_data, stages.Compiled.__call__)
  call = saved[0]

  def counted(self, *args):
    runs[self.xla_executable] += 1
    return call(self, *args)

  def clear_fast_paths() -> None:  # jit's C++ dispatch caches (not its compilations)
    pjit_lib._cpp_pjit_cache_fun_only.clear()
    pjit_lib._cpp_pjit_cache_explicit_attributes.clear()

  pxla.ExecuteReplicated.__call__ = counted
  pjit_lib._get_fastpath_data = lambda *args, **kwargs: None
  stages.Compiled.__call__ = lambda self, *a, **k: stages.Compiled.call(self._params, *a, **k)[0]
  clear_fast_paths()
  try:
    yield runs
  finally:
    (pxla.ExecuteReplicated.__call__, pjit_lib._get_fastpath_data,
     stages.Compiled.__call__) = saved
    clear_fast_paths()


def parts_reader(receiver: Any) -> PartsReader:
  """A reader of streamed parts onto ``receiver``'s leaves, as its ``receive_stream`` makes one
  (the parts' decode timed alone, without the apply)."""
  return PartsReader(receiver.plan, receiver._flat)  # pylint: disable=protected-access


def sender_snapshot(sender: Any) -> Any:
  """The sender's last synced state (what its next diff runs against)."""
  return sender._snapshot  # pylint: disable=protected-access


__all__ = [
    "Format", "Kind", "PackedRecord", "PartHeader", "PartsReader", "StagedRecords",
    "ThrottledFeed", "TokenBucket", "apply_program", "bits_lib", "changes_of_units",
    "chunks_of", "diff_program", "encode_part", "executed_programs", "layouts_of",
    "owned_units", "packed_units", "part_records", "parts_reader", "programs", "read_index",
    "read_parts", "read_unit", "sender_snapshot", "sparse_inputs", "to_bits",
]
