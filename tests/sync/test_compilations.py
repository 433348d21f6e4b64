"""No sync after the first compiles: as a run's density drifts across the slot levels
(``programs.SlotLevels``), the levels a step needs are compiled on a background thread while a
compiled level serves, for whole payloads and streams alike; once compiled, they serve."""

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from jsparse._src.sync import programs
from jsparse._src.wire.parts import read_index
from tests.helpers import drop_queued_compilations

pytestmark = pytest.mark.compile_ahead  # what the suite tests here is compiling ahead

# Densities across the slot levels (capacity 5%: levels at 5, 3.5, 2.5, 1.8, 1.25, 0.88, 0.625%).
DRIFT = (0.04, 0.02, 0.015, 0.01, 0.007, 0.005, 0.002, 0.03, 0.0005, 0.04)  # each level

_COMPILES: collections.Counter = collections.Counter()  # XLA compilations, by thread
_SYNC_COMPILES: list = []  # those on any thread but the slot levels' (e.g. a host pool's)
_BACKGROUND_COMPILES: list = []  # the slot levels' thread's


def _count(event: str, seconds: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[threading.get_ident()] += 1
    if threading.current_thread().name != "jsparse-slot-levels":
      _SYNC_COMPILES.append(kwargs.get("fun_name"))
    else:
      _BACKGROUND_COMPILES.append(kwargs.get("fun_name"))


jax.monitoring.register_event_duration_secs_listener(_count)  # once: listeners stay


def _compiles() -> int:
  """XLA compilations in this thread so far (not the background thread's)."""
  return _COMPILES[threading.get_ident()]


def _tree(rng, rows: int) -> dict:
  """A few leaves; ``rows`` makes the shapes of one test's own (no program compiled before)."""
  return {"w": rng.standard_normal((rows, 96), np.float32),
          "v": rng.standard_normal((128, 128), np.float32),
          "b": rng.standard_normal(96, np.float32),
          "scale": 1 + 0.1 * rng.standard_normal(rows, np.float32)}


def _step(rng, params: dict, density: float) -> dict:
  """``params`` with about ``density`` of the elements of each leaf moved by a few ulps or
  more (their bf16 bits change)."""
  out = {}
  for name, x in params.items():
    x = np.array(x)
    flat = x.reshape(-1)
    at = rng.choice(flat.size, max(1, round(density * flat.size)), replace=False)
    flat[at] += 0.05 * np.abs(flat[at]) + 1e-3
    out[name] = jnp.asarray(x)
  return out


def _drain_slot_levels() -> None:
  """The end of a run: the slot levels it asked for and that have not started are dropped
  (none of its syncs is left to use them), and the one compiling finishes (the background
  thread does not hang)."""
  drop_queued_compilations()
  assert programs.wait_for_slot_levels(timeout=600)


def _sent(sender, receiver, params):
  return receiver.receive(sender.send(params))


def _streamed(sender, receiver, params):
  stream = receiver.open_stream()
  for part in sender.send_stream(params, chunk_bytes=40_000):
    stream.add(part)
  return stream.commit()


@pytest.mark.parametrize("coding, rows", [("ranked", 256), ("packed", 264)])
def test_no_sync_after_the_first_compiles_while_the_density_drifts(coding, rows):
  """Versions sent whole and streamed in parts by turns: the first (whole) compiles what
  every later one runs, in either form."""
  rng = np.random.default_rng(3)
  params = {k: jnp.asarray(v) for k, v in _tree(rng, rows).items()}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.05,
                           bucket_size=4096)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  after_first, densities = None, []
  for k, density in enumerate(DRIFT):
    params = _step(rng, params, density)
    sync = (_sent, _streamed)[k % 2]
    assert_trees_bitwise_equal(sync(sender, receiver, params), plan.cast(params))
    densities.append(sender.last_stats.density)
    if after_first is None:
      after_first = _compiles()  # the first sync compiles (its level, the fallback level 0)
  assert _compiles() == after_first, f"steps after the first compiled (densities {densities})"
  assert max(densities) > 0.025 and min(densities) < 0.00625  # across every level
  _drain_slot_levels()


def test_levels_compiled_in_the_background_then_serve(monkeypatch):
  """Once a level is compiled, the programs run at the slots the changes need (not the
  capacity), still without compiling in the sync's thread."""
  rng = np.random.default_rng(4)
  params = {k: jnp.asarray(v) for k, v in _tree(rng, 304).items()}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.05,
                           bucket_size=4096)
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  # The second asks for the matrices' last level (an eighth), and for the diff to narrow
  # from its first delta's wider slots back to the capacity (compiled by the third, used
  # from the fourth, :class:`programs.DiffWidths`), which the fourth's programs then serve.
  for density in (0.04, 0.005, 0.005, 0.005):
    params = _step(rng, params, density)
    assert_trees_bitwise_equal(_sent(sender, receiver, params), plan.cast(params))
    assert programs.wait_for_slot_levels(timeout=600)
  sent, applied = [], []
  sparse_program, apply_program = programs.sparse_program, programs.apply_program
  monkeypatch.setattr(programs, "sparse_program", lambda chunk_plan, slots, *args: (
      sent.append(slots), sparse_program(chunk_plan, slots, *args))[1])
  monkeypatch.setattr(programs, "apply_program", lambda donate: lambda *args: (
      applied.append(tuple(len(i) for i in args[3])), apply_program(donate)(*args))[1])
  before = _compiles()
  params = _step(rng, params, 0.005)
  data = sender.send(params)
  assert_trees_bitwise_equal(receiver.receive(data), plan.cast(params))
  assert _compiles() == before
  wanted = programs.slots_needed(plan, [e.count for e in read_index(plan, data).entries])
  assert sorted(n for slots in sent for n in slots) == sorted(wanted)
  assert sorted(n for slots in applied for n in slots) == sorted(wanted)
  assert max(wanted) < max(seg.capacity for seg in plan.segments) // 4  # the last level


def _model_tree(rng, width: int) -> dict:
  """Shaped like a small trained model: matrices (segments of their own), and biases near
  zero and norm scales (pooled) whose tiny ulps make them change at a high density."""
  return {"embed": 0.02 * rng.standard_normal((4 * width, width), np.float32),
          "up": 0.05 * rng.standard_normal((width, 4 * width), np.float32),
          "down": 0.05 * rng.standard_normal((4 * width, width), np.float32),
          "up_bias": 1e-4 * rng.standard_normal(4 * width, np.float32),
          "down_bias": 1e-4 * rng.standard_normal(width, np.float32),
          "norm": 1 + 0.01 * rng.standard_normal(width, np.float32)}


def _model_step(rng, params: dict, density: float) -> dict:
  """An update changing about ``density`` of the matrices' bf16 elements and ten times that
  (at most all) of the biases'."""
  return {name: x + jnp.asarray(_moved(rng, np.asarray(x), density if x.ndim == 2
                                       else min(1.0, 10 * density))) for name, x in params.items()}


def _moved(rng, x: np.ndarray, density: float) -> np.ndarray:
  """A step for ``x`` that moves about ``density`` of its elements by a few bf16 ulps."""
  step = np.zeros_like(x)
  at = rng.random(x.shape) < density
  step[at] = 0.03 * np.abs(x[at]) + 1e-7
  return step


@pytest.mark.parametrize("coding", list(jsparse.Coding))
def test_no_sync_after_the_first_compiles_on_a_model_like_tree(coding):
  """At the default settings, for every coding, neither side compiles in a sync after the
  first, whatever the density (1%, 4%, 10%: past the capacity, 0.05%, 1%): the programs of every slot level, and of
  whatever else the density changes, compile on the background thread only."""
  rng = np.random.default_rng(5)
  # One tree for every coding (the programs they share compile once: a quicker test; each
  # coding's own programs are its own).
  params = {k: jnp.asarray(v) for k, v in _model_tree(rng, 128).items()}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  compiled, densities = [], []
  for density in (0.01, 0.04, 0.1, 0.0005, 0.01):
    params = _model_step(rng, params, density)
    before = len(_SYNC_COMPILES)
    assert_trees_bitwise_equal(_sent(sender, receiver, params), plan.cast(params))
    compiled.append(_SYNC_COMPILES[before:])
    densities.append(sender.last_stats.density)
    assert programs.wait_for_slot_levels(timeout=600)
  assert all(not c for c in compiled[1:]), f"compiled after the first sync: {compiled[1:]}"
  assert densities[2] > 2 * densities[1] > 4 * densities[0] > 16 * densities[3], densities


def _on_fsdp8(tree: dict) -> dict:
  """``tree`` on 8 devices, its matrices split into blocks along one axis (as FSDP holds
  them), the rest replicated."""
  mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
  specs = {"embed": P("fsdp", None), "up": P(None, "fsdp"), "down": P("fsdp", None)}
  return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in tree.items()}


@pytest.mark.parametrize("coding, placed", [(c, None) for c in jsparse.Coding] + [
    ("ranked", _on_fsdp8), ("packed", _on_fsdp8)], ids=lambda x: getattr(x, "value", x) or (
        "fsdp8" if x else "single"))
def test_no_stream_after_the_first_compiles_on_a_model_like_tree(coding, placed):
  """As above, for versions streamed in parts (``Sender.send_stream``, ``Receiver.open_stream``:
  the packed coding packs and unpacks each unit of a part on its own), on one device and with
  the matrices split over a mesh (the parts' units are blocks)."""
  rng = np.random.default_rng(6)
  placed = placed or (lambda tree: tree)
  params = placed({k: jnp.asarray(v) for k, v in _model_tree(rng, 120).items()})
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  compiled, densities = [], []
  for density in (0.01, 0.04, 0.1, 0.0005, 0.01):
    params = placed(_model_step(rng, params, density))
    before = len(_SYNC_COMPILES)
    assert_trees_bitwise_equal(_streamed(sender, receiver, params), plan.cast(params))
    compiled.append(_SYNC_COMPILES[before:])
    densities.append(sender.last_stats.density)
    assert programs.wait_for_slot_levels(timeout=600)
  assert all(not c for c in compiled[1:]), f"compiled after the first sync: {compiled[1:]}"
  assert densities[2] > 2 * densities[1] > 4 * densities[0] > 16 * densities[3], densities
  assert receiver.last_read.parts > 1


# The drift of a run at the default settings: 1%, then 4% (the denser matrix near its 5%
# capacity), 12% (past it: sparse if the sender's diff widened in time, else dense), 0.05% (the
# last slot level), a step with no change, 1% again.
DEFAULT_DRIFT = (0.01, 0.04, 0.12, 0.0005, 0.0, 0.01)


def _drift_tree(rng, rows: int) -> dict:
  """Two matrices (``gate`` changes 1.5x as often as ``up``; over 2**16 elements, so each its
  own segment at the default ``bucket_size``), a bias near zero and a norm scale (pooled);
  ``rows`` makes the shapes of one test's own (no program compiled before)."""
  return {"up": 0.05 * rng.standard_normal((rows, 512), np.float32),
          "gate": 0.05 * rng.standard_normal((rows, 512), np.float32),
          "bias": 1e-4 * rng.standard_normal(512, np.float32),
          "norm": 1 + 0.01 * rng.standard_normal(rows, np.float32)}


def _drift_step(rng, params: dict, density: float) -> dict:
  """About ``density`` of ``up``'s bf16 elements moved, 1.5x that of ``gate``'s, ten times
  that of the small leaves' (at most all); none for ``density`` 0."""
  def moved(name, x):
    scale = 1.5 if name == "gate" else 1 if x.ndim == 2 else 10
    return x + jnp.asarray(_moved(rng, np.asarray(x), min(1.0, scale * density)))
  return {name: moved(name, x) for name, x in params.items()}


def _on_mesh8(tree: dict) -> dict:
  """``tree`` on 8 devices, its matrices split into blocks along their rows (as FSDP holds
  them), the small leaves replicated."""
  mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
  return {k: jax.device_put(v, NamedSharding(mesh, P("fsdp", None) if v.ndim == 2 else P()))
          for k, v in tree.items()}


def _send(sender, params):
  return sender.send(params)


def _receive(receiver, data):
  return receiver.receive(data)


def _send_stream(sender, params):
  return list(sender.send_stream(params, chunk_bytes=100_000))


def _receive_stream(receiver, parts):
  stream = receiver.open_stream()
  for part in parts:
    stream.add(part)
  return stream.commit()


PATHS = {"send": (_send, _receive), "stream": (_send_stream, _receive_stream)}


def _drift_run(send, receive, coding: str, placed, rows: int) -> list:
  """Syncs :data:`DEFAULT_DRIFT` from a new sender to a new receiver of the default plan of a
  :func:`_drift_tree` (``placed``), each step bit-exact; returns what each step after the first
  compiled, on either side (``(step, side, programs)``)."""
  rng = np.random.default_rng(7)
  params = placed({k: jnp.asarray(v) for k, v in _drift_tree(rng, rows).items()})
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  compiled, stats = [], []
  for density in DEFAULT_DRIFT:
    params = placed(_drift_step(rng, params, density))
    start = len(_SYNC_COMPILES)
    data = send(sender, params)
    middle = len(_SYNC_COMPILES)
    out = receive(receiver, data)
    compiled.append((_SYNC_COMPILES[start:middle], _SYNC_COMPILES[middle:]))
    stats.append(sender.last_stats)
    assert_trees_bitwise_equal(out, plan.cast(params))
  densities = [s.density for s in stats]
  assert (densities[2] > 2 * densities[1] > 4 * densities[0] > 16 * densities[3] > 0
          == densities[4]), densities
  return [(step, side, names) for step, sides in enumerate(compiled[1:], 1)
          for side, names in zip(("sender", "receiver"), sides) if names]


@pytest.mark.parametrize("mesh", ["single", "mesh8"])
def test_no_compile_after_the_first_sync_on_either_side_at_default_settings(mesh):
  """At the default plan, for ``ranked`` and ``packed``, through ``send`` (a version of one
  part) and streams, each a run of its own: as the density drifts (1%, 4%, 12% with the matrices
  past their capacity, 0.05%, no change, 1%), neither side compiles in a sync after the first, without
  waiting for the background thread between steps (its compilations are the mechanism; every
  other thread's count). On one device, and with the matrices split over 8.

  The runs share one tree, and one test: as in a process syncing through several paths and
  codings, the programs they share compile once, and a run's first sync may find the slot
  levels of other runs compiled, but not for its own programs. (Between tests the suite may
  drop every compiled program, which the slot levels do not see: no shape here is another
  test's, the two meshes' included.)"""
  placed, rows = (_on_mesh8, 144) if mesh == "mesh8" else ((lambda tree: tree), 136)
  late = {}
  for path, (send, receive) in PATHS.items():
    for coding in ("ranked", "packed"):
      late[path, coding] = _drift_run(send, receive, coding, placed, rows)
  _drain_slot_levels()
  late = {run: steps for run, steps in late.items() if steps}
  assert not late, f"compiled after the first sync, (path, coding): (step, side, programs): {late}"


def test_distinct_programs_compile_side_by_side_and_the_calls_find_them(monkeypatch):
  """``compile_distinct`` compiles each distinct program once, on its own threads: the calls
  that follow compile nothing on the calling thread, and a key seen before compiles nothing."""
  from jsparse._src.sync import compile_side_by_side
  monkeypatch.setenv("JSPARSE_THREADS", "2")
  shift = jax.jit(lambda x, k: x + k, static_argnums=1)
  calls = [((shift, n, k), shift, (jnp.zeros(n, jnp.float32), k), {})
           for n in (171, 173) for k in (3, 5) for _ in range(2)]
  before = _compiles()
  assert compile_side_by_side.compile_distinct(calls) == 4
  assert _compiles() == before  # compiled on the pool's threads
  outs = [fn(*args) for _, fn, args, _ in calls]
  assert _compiles() == before, "a call compiled its program again"
  assert [int(o[0]) for o in outs] == [3, 3, 5, 5] * 2
  assert compile_side_by_side.compile_distinct(calls) == 0


def _levels_compiling(queued: int):
  """Slot levels of which level 1 is compiling (until ``release`` is set) and levels 2 to
  ``queued + 1`` are queued; ``ran``: the levels whose jobs ran."""
  levels, started, release, ran = programs.SlotLevels(), threading.Event(), threading.Event(), []

  def first():
    started.set()
    release.wait(timeout=60)
    ran.append(1)

  levels.ran("family", 0)
  levels.request("family", 1, first)
  for level in range(2, queued + 2):
    levels.request("family", level, lambda level=level: ran.append(level))
  assert started.wait(timeout=60)
  return levels, release, ran


def test_forgetting_the_compiled_levels_drops_those_not_started():
  """After ``jax.clear_caches()`` (``staging.forget_compiled``): the level compiling finishes,
  those still queued are never compiled, and every level is unknown again."""
  levels, release, ran = _levels_compiling(queued=1)
  forgetting = threading.Thread(target=levels.forget)
  forgetting.start()
  release.set()
  forgetting.join(timeout=60)
  assert not forgetting.is_alive() and ran == [1]
  assert levels.wait(timeout=0) and levels.ready("family") == set()
  assert levels.wanted("family", 2) and levels.choose("family", needed=2) == 0


def test_cancelled_levels_are_not_compiled_and_are_wanted_again():
  """``cancel`` (between tests): the level compiling finishes and is ready; those queued are
  dropped, never run, and can be requested again."""
  levels, release, ran = _levels_compiling(queued=2)
  assert not levels.wanted("family", 2)
  assert levels.cancel() == 2
  release.set()
  assert levels.wait(timeout=60) and ran == [1]
  assert levels.ready("family") == {0, 1}
  assert levels.wanted("family", 2) and levels.wanted("family", 3)
  levels.request("family", 2, lambda: ran.append(2))
  assert levels.wait(timeout=60) and ran == [1, 2] and levels.ready("family") == {0, 1, 2}


def test_with_compiling_ahead_off_a_call_runs_at_a_compiled_level_or_compiles_its_own():
  """``JSPARSE_COMPILE_AHEAD=0`` (``programs.compile_ahead(False)``): nothing compiles in the
  background; a call runs at a compiled level that holds its changes, or compiles a wider one
  itself. A sender's diff widens at the sync after a density jump: sparse again at once, bit for
  bit."""
  levels = programs.SlotLevels(ahead=False)
  levels.ran("family", 0)
  levels.request("family", 3, lambda: pytest.fail("compiled ahead"))
  assert levels.wait(timeout=0) and not levels.wanted("family", 3)
  assert levels.choose("family", needed=3) == 0 and levels.choose("family", needed=-2) == -2
  previous = programs.compile_ahead(False)
  try:
    assert programs.wait_for_slot_levels(timeout=600)  # one an earlier test left compiling
    rng = np.random.default_rng(7)
    params = {"w": rng.standard_normal((256, 392), np.float32)}  # one segment
    plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
    sender, receiver = jsparse.Sender(plan, params), jsparse.Receiver(plan, plan.cast(params))
    background, overflowed = len(_BACKGROUND_COMPILES), []
    for density in (0.01, 0.12, 0.12, 0.12):
      params = _step(rng, params, density)
      _sent(sender, receiver, params)
      assert_trees_bitwise_equal(receiver.params, plan.cast(params))
      overflowed.append(sender.last_stats.overflowed_segments)
    assert len(_BACKGROUND_COMPILES) == background
    assert overflowed[0] == 0 and overflowed[1] > 0 and overflowed[2:] == [0, 0], overflowed
  finally:
    programs.compile_ahead(previous)
