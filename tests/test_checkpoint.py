"""Orbax persistence: resumable Sender/Receiver state and delta checkpoint chains."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse
from jsparse._src.core.bits import np_to_bits
from jsparse._src.wire import parts as parts_wire
from jsparse._src.wire.payload import Mode
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies

SHAPES = {"w": (64, 96), "emb": (128, 48), "b": (96,), "scalar": ()}


def _steps(seed: int, num: int, density: float = 0.02):
  """``num`` fp32 trees with special values, each a sparse random update of the one before."""
  rng = np.random.default_rng(seed)
  tree = {k: strategies.with_specials(rng, rng.normal(size=s).astype(np.float32))
          for k, s in SHAPES.items()}
  out = [tree]
  for _ in range(num - 1):
    tree = {k: strategies.with_specials(rng, strategies.perturb(rng, v, density))
            for k, v in tree.items()}
    out.append(tree)
  return [jax.tree.map(jnp.asarray, t) for t in out]


def _plan(tree, **options):
  return jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, capacity=0.05, bucket_size=1024,
                           **options)


def _sharded(tree, mesh_shape, names, specs):
  mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:int(np.prod(mesh_shape))])
  return {k: NamedSharding(mesh, specs.get(k, P())) for k in tree}


@pytest.mark.parametrize("coding", ["positioned", "packed", "auto"])
def test_chain_restores_every_step_exactly_with_rebasing_onto_another_mesh(tmp_path, coding):
  trees = _steps(0, 9)
  trainer = _sharded(trees[0], (8,), ("fsdp",), {"w": P("fsdp", None), "emb": P("fsdp", None)})
  trees = [{k: jax.device_put(v, trainer[k]) for k, v in t.items()} for t in trees]
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, rebase_every=3, coding=coding) as chain:
    kinds = [chain.save(step, t).kind for step, t in enumerate(trees)]
    assert kinds == ["base", "delta", "delta", "delta"] * 2 + ["base"]
    assert chain.chain(6) == [4, 5, 6]
    rollout = _sharded(trees[0], (2, 4), ("data", "tensor"),
                       {"w": P(None, "tensor"), "emb": P("tensor", None)})
    for step, tree in enumerate(trees):
      restored = chain.restore(step, shardings=rollout)
      assert_trees_bitwise_equal(restored, plan.cast(tree))
      for k, leaf in restored.items():
        assert leaf.sharding.is_equivalent_to(rollout[k], leaf.ndim), k


def test_deltas_are_small_and_overflow_goes_dense(tmp_path):
  """(In the ranked coding: the other codings' chains are restored in the tests above.)"""
  trees = _steps(1, 3, density=0.01)
  trees.append({**trees[-1], "w": trees[-1]["w"] + 1.0})  # every element of w changes
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, rebase_every=10, coding="ranked") as chain:
    stats = [chain.save(step, t) for step, t in enumerate(trees)]
    assert [s.kind for s in stats] == ["base", "delta", "delta", "delta"]
    assert [s.coding for s in stats[1:]] == ["ranked"] * 3
    w_segment = plan.leaf_segment()[[l.path for l in plan.leaves].index("['w']")][0]
    (part,) = _stored_parts(chain, 3)
    modes = {e.unit.segment: e.mode for e in parts_wire.read_index(plan, part).entries}
    assert modes[w_segment] == Mode.DENSE
    assert_trees_bitwise_equal(chain.restore(3), plan.cast(trees[3]))
  assert stats[1].bytes < stats[0].bytes


def test_retention_never_deletes_what_a_kept_step_needs(tmp_path):
  trees = _steps(2, 12)
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, rebase_every=4, max_to_keep=3) as chain:
    for step, tree in enumerate(trees):
      chain.save(step, tree)
      kept = chain.all_steps()
      for s in kept[-3:]:
        assert set(chain.chain(s)) <= set(kept)
    # bases at 0, 5, 10; the newest three steps 9, 10, 11 need 5..9 and 10..11
    assert chain.all_steps() == [5, 6, 7, 8, 9, 10, 11]
    for step in (9, 10, 11):
      assert_trees_bitwise_equal(chain.restore(step), plan.cast(trees[step]))


@pytest.mark.parametrize("coding", ["positioned", "packed", "auto"])
def test_reopened_manager_continues_the_chain(tmp_path, coding):
  trees = _steps(3, 6)
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, coding=coding) as chain:
    for step in range(3):
      chain.save(step, trees[step])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, coding=coding) as chain:
    assert chain.save(3, trees[3]).kind == "delta"
    with pytest.raises(jsparse.CheckpointError, match="newer"):
      chain.save(3, trees[3])
    chain.save(5, trees[5])
    assert chain.chain(5) == [0, 1, 2, 3, 5]
    for step in (0, 1, 2, 3, 5):
      assert_trees_bitwise_equal(chain.restore(step), plan.cast(trees[step]))


def _stored_parts(chain, step: int) -> list[bytes]:
  """The parts a delta step stores, as saved."""
  lengths = chain.meta(step)["lengths"]
  target = ocp.args.StandardRestore({"bytes": np.zeros((len(lengths), max(lengths)), np.uint8)})
  rows = chain._restore_item(step, "parts", target)["bytes"]
  return [np.asarray(row[:n]).tobytes() for row, n in zip(rows, lengths)]


def _delta_files(root: Path, step: int) -> list[Path]:
  return [f for f in (root / str(step) / "parts").rglob("*") if f.is_file() and f.stat().st_size]


def test_missing_or_corrupted_delta_is_named_never_a_wrong_restore(tmp_path):
  trees = _steps(4, 6)
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, rebase_every=10) as chain:
    for step, tree in enumerate(trees):
      chain.save(step, tree)
  # Corrupt every data file of step 2's delta (flip bytes in the middle of each).
  for f in _delta_files(tmp_path, 2):
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 8)):
      data[i] ^= 0x5A
    f.write_bytes(bytes(data))
  with jsparse.DeltaCheckpointManager(tmp_path, plan) as chain:
    assert_trees_bitwise_equal(chain.restore(1), plan.cast(trees[1]))
    for step in (2, 3):
      with pytest.raises(jsparse.CheckpointError, match="step 2"):
        chain.restore(step)
  # A missing delta.
  import shutil
  shutil.rmtree(tmp_path / "4")
  with jsparse.DeltaCheckpointManager(tmp_path, plan) as chain:
    with pytest.raises(jsparse.CheckpointError, match="step 4 is missing"):
      chain.restore(5)
    with pytest.raises(jsparse.CheckpointError, match="step 4 is not"):
      chain.restore(4)


def test_chain_saved_with_another_plan_is_refused(tmp_path):
  trees = _steps(5, 2)
  with jsparse.DeltaCheckpointManager(tmp_path, _plan(trees[0])) as chain:
    chain.save(0, trees[0])
  other = jsparse.make_plan(trees[0], rollout_dtype=jnp.float16)
  with jsparse.DeltaCheckpointManager(tmp_path, other) as chain:
    with pytest.raises(jsparse.CheckpointError, match="another plan"):
      chain.restore(0)


_CHILD = """
import os, signal, sys
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
import jsparse
from tests.test_checkpoint import _plan, _steps
directory, crash_step, mode, num = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
trees = _steps(6, num)
chain = jsparse.DeltaCheckpointManager(directory, _plan(trees[0]), rebase_every=3)
for step, tree in enumerate(trees):
  if step == crash_step and mode == "before-commit":
    def die(*args, **kwargs):  # everything of the step is written, nothing committed yet
      os.kill(os.getpid(), signal.SIGKILL)
    ocp.handlers.JsonCheckpointHandler.finalize = die
  chain.save(step, tree)
  print("saved", step, flush=True)
"""


@pytest.mark.parametrize("crash_step", [3, 5])  # a base (3) and a delta (5)
def test_save_killed_before_commit_leaves_last_complete_step_restorable(tmp_path, crash_step):
  root = Path(__file__).resolve().parents[1]
  proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(crash_step),
                         "before-commit", "8"], cwd=root, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  assert proc.stdout.split() [-1] == str(crash_step - 1)
  leftovers = [p.name for p in tmp_path.iterdir() if "tmp" in p.name]
  assert leftovers, "the kill should land inside the save"
  trees = _steps(6, 8)
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, rebase_every=3) as chain:
    assert chain.all_steps() == list(range(crash_step))
    for step in range(crash_step):
      assert_trees_bitwise_equal(chain.restore(step), plan.cast(trees[step]))
    chain.save(crash_step, trees[crash_step])  # the chain goes on where it stopped
    assert_trees_bitwise_equal(chain.restore(crash_step), plan.cast(trees[crash_step]))


def test_save_killed_at_random_moments_never_leaves_a_bad_step(tmp_path):
  root = Path(__file__).resolve().parents[1]
  trees = _steps(6, 40)
  plan = _plan(trees[0])
  rng = np.random.default_rng(0)
  for attempt in range(3):
    directory = tmp_path / f"run{attempt}"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), "-1", "none", "40"],
                            cwd=root, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait for a couple of complete steps, then kill mid-run
      if line.strip() == "saved 2":
        break
    time.sleep(float(rng.uniform(0.0, 0.3)))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    with jsparse.DeltaCheckpointManager(directory, plan, rebase_every=3) as chain:
      steps = chain.all_steps()
      assert steps == list(range(len(steps))) and 3 <= len(steps) < 40, steps
      for step in steps:
        assert_trees_bitwise_equal(chain.restore(step), plan.cast(trees[step]))


def test_sender_and_receiver_resume_from_orbax_without_a_full_resend(tmp_path):
  trees = _steps(7, 6)
  rollout = _sharded(trees[0], (2, 2), ("data", "tensor"), {"w": P(None, "tensor")})
  plan = _plan(trees[0])
  sender = jsparse.Sender(plan, trees[0])
  receiver = jsparse.Receiver(plan, plan.cast(trees[0]))
  for tree in trees[1:3]:
    receiver.receive(sender.send(tree))
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  for name, side in (("trainer", sender), ("rollout", receiver)):
    with ocp.CheckpointManager(tmp_path / name, options=options) as manager:
      manager.save(2, args=ocp.args.Composite(sync=ocp.args.StandardSave(side.state())))
  # Restarted processes: the rollout restores onto another mesh than it ran on.
  with ocp.CheckpointManager(tmp_path / "trainer", options=options) as manager:
    state = manager.restore(2, args=ocp.args.Composite(
        sync=ocp.args.StandardRestore(jsparse.abstract_sync_state(plan))))["sync"]
    sender = jsparse.Sender.restore(plan, state)
  with ocp.CheckpointManager(tmp_path / "rollout", options=options) as manager:
    state = manager.restore(2, args=ocp.args.Composite(
        sync=ocp.args.StandardRestore(jsparse.abstract_sync_state(plan, rollout))))["sync"]
    receiver = jsparse.Receiver.restore(plan, state)
  assert sender.version == receiver.version == 2
  for tree in trees[3:]:
    data = sender.send(tree)
    assert sender.last_stats.anchor is False
    assert len(data) < plan.rollout_bytes / 4
    out = receiver.receive(data)
    assert_trees_bitwise_equal(out, plan.cast(tree))
  assert out["w"].sharding.is_equivalent_to(rollout["w"], 2)


def test_restored_sync_state_is_checked():
  trees = _steps(8, 2)
  plan = _plan(trees[0])
  state = jsparse.Sender(plan, trees[0]).state()
  tampered = state._replace(params={**state.params, "b": state.params["b"].at[3].add(1)})
  with pytest.raises(jsparse.IntegrityError, match="digest"):
    jsparse.Receiver.restore(plan, tampered)
  other = jsparse.make_plan(trees[0], rollout_dtype=jnp.float16)
  with pytest.raises(jsparse.PlanMismatchError, match="another plan"):
    jsparse.Sender.restore(other, state)
  with pytest.raises(jsparse.PlanMismatchError, match="SyncState"):
    jsparse.Sender.restore(plan, {"params": state.params})
  assert jsparse.Sender.restore(plan, state._asdict()).version == 0  # as Orbax returns it


@pytest.mark.parametrize("options", [{"rebase_every": True}, {"rebase_every": -1},
                                     {"max_to_keep": 0}, {"max_to_keep": 1.5},
                                     {"coding": "bogus"}])
def test_bad_manager_options_are_config_errors_and_create_nothing(tmp_path, options):
  plan = _plan(_steps(9, 1)[0])
  with pytest.raises(jsparse.ConfigError):
    jsparse.DeltaCheckpointManager(tmp_path / "chain", plan, **options)
  assert not (tmp_path / "chain").exists()


# --- hardening --------------------------------------------------------------------------------

import json  # noqa: E402
import shutil  # noqa: E402
import zlib  # noqa: E402

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@pytest.fixture(scope="module")
def pristine_chain(tmp_path_factory):
  """A chain of 5 steps (a base, 4 deltas), and its trees."""
  root = tmp_path_factory.mktemp("pristine")
  trees = _steps(11, 5)
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(root, plan, rebase_every=10) as chain:
    for step, tree in enumerate(trees):
      chain.save(step, tree)
  return root, plan, trees


_FIELDS = ["jsparse_chain", "step", "plan", "kind", "digest", "changed", "base", "parent",
           "parent_digest", "lengths"]
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=3), max_leaves=5)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 4), st.sampled_from(_FIELDS + ["<delete>"]), _JSON, st.booleans())
def test_random_metadata_corruptions_are_named_never_a_loop_or_a_wrong_restore(
    pristine_chain, step, field, value, reseal):
  import signal
  root, plan, trees = pristine_chain
  work = Path(str(root) + "-work")
  shutil.rmtree(work, ignore_errors=True)
  shutil.copytree(root, work)
  path = work / str(step) / "meta" / "metadata"
  meta = json.loads(path.read_text())
  if field == "<delete>":
    meta.pop("parent", None)
  else:
    meta[field] = value
  if reseal:  # a forger that recomputes the checksum
    body = {k: v for k, v in meta.items() if k != "crc"}
    meta["crc"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
  path.write_text(json.dumps(meta))
  signal.alarm(60)  # a cyclic chain walk would hang: fail loudly instead
  try:
    with jsparse.DeltaCheckpointManager(work, plan, max_to_keep=10) as chain:
      for s in range(5):
        try:
          assert_trees_bitwise_equal(chain.restore(s), plan.cast(trees[s]))
        except jsparse.CheckpointError as e:
          assert s >= step and f"step {step}" in str(e), (s, str(e))
  finally:
    signal.alarm(0)


def test_zero_size_leaves_and_an_empty_tree_are_saved_and_restored(tmp_path):
  for name, tree in [("zero", {"w": jnp.zeros((4, 0)), "b": jnp.ones(3), "e": jnp.zeros(0)}),
                     ("empty", {})]:
    plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16)
    with jsparse.DeltaCheckpointManager(tmp_path / name, plan, rebase_every=1) as chain:
      steps = [tree, jax.tree.map(lambda x: x + 1, tree), jax.tree.map(lambda x: x + 2, tree)]
      assert [chain.save(i, t).kind for i, t in enumerate(steps)] == ["base", "delta", "base"]
      for i, t in enumerate(steps):
        assert_trees_bitwise_equal(chain.restore(i), plan.cast(t))
    sender = jsparse.Sender(plan, tree)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / f"{name}-state", options=options) as manager:
      manager.save(0, args=ocp.args.Composite(sync=ocp.args.StandardSave(sender.state())))
      target = ocp.args.StandardRestore(jsparse.abstract_sync_state(plan))
      state = manager.restore(0, args=ocp.args.Composite(sync=target))["sync"]
    receiver = jsparse.Receiver.restore(plan, state)
    assert_trees_bitwise_equal(receiver.params, plan.cast(tree))


def test_reopening_a_directory_of_another_plan_writes_nothing(tmp_path):
  trees = _steps(12, 3)
  with jsparse.DeltaCheckpointManager(tmp_path, _plan(trees[0])) as chain:
    chain.save(0, trees[0])
    chain.save(1, trees[1])
  other = jsparse.make_plan(trees[0], rollout_dtype=jnp.float16)
  with jsparse.DeltaCheckpointManager(tmp_path, other, max_to_keep=1) as chain:
    with pytest.raises(jsparse.CheckpointError, match="another plan"):
      chain.save(2, trees[2])
    assert chain.all_steps() == [0, 1]


def test_abstract_sync_state_without_shardings_restores_onto_the_default_device(tmp_path):
  mesh = jax.make_mesh((8,), ("fsdp",))
  tree = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("fsdp")))}
  plan = jsparse.make_plan(tree)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    manager.save(0, args=ocp.args.Composite(
        sync=ocp.args.StandardSave(jsparse.Sender(plan, tree).state())))
    target = ocp.args.StandardRestore(jsparse.abstract_sync_state(plan))
    state = manager.restore(0, args=ocp.args.Composite(sync=target))["sync"]
  assert state.params["w"].sharding.device_set == {jax.devices()[0]}
  assert jsparse.Sender.restore(plan, state).snapshot["w"].sharding.is_equivalent_to(
      tree["w"].sharding, 1)  # placed back on the plan's layout to send


def test_numpy_integer_steps_are_accepted(tmp_path):
  trees = _steps(13, 2)
  with jsparse.DeltaCheckpointManager(tmp_path, _plan(trees[0])) as chain:
    assert chain.save(np.int64(1), trees[0]).step == 1
    assert chain.save(np.int32(2), trees[1]).kind == "delta"


def test_64_bit_leaves_with_large_jumps_are_saved_and_restored(tmp_path):
  with jax.enable_x64(True):
    tree = {"f": np.linspace(-1, 1, 300), "i": np.arange(300, dtype=np.int64)}
    steps = [tree, {"f": tree["f"] * 2.0, "i": tree["i"] + 2**40},
             {"f": -tree["f"], "i": tree["i"] - 2**62}]
    plan = jsparse.make_plan(tree, capacity=1.0)
    with jsparse.DeltaCheckpointManager(tmp_path, plan) as chain:
      assert [chain.save(s, t).kind for s, t in enumerate(steps)] == ["base", "delta", "delta"]
      for s, t in enumerate(steps):
        assert_trees_bitwise_equal(chain.restore(s), t)


@pytest.mark.parametrize("link_gbit", [1e-5, 1e3])
def test_an_auto_chain_stores_each_delta_in_the_coding_its_policy_chose(tmp_path, link_gbit):
  """Over slow storage ``auto`` stores the fewest bytes; over fast storage the least work."""
  trees = _steps(11, 4)
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager(tmp_path, plan, coding="auto", link_gbit=link_gbit,
                                      rebase_every=5) as chain:
    infos = [chain.save(step, t) for step, t in enumerate(trees)]
    rates = chain._sender.last_stats.coding_rates
    for step, tree in enumerate(trees):
      assert_trees_bitwise_equal(chain.restore(step), plan.cast(tree))
  assert [i.kind for i in infos] == ["base", "delta", "delta", "delta"]
  assert infos[0].coding is None
  changes = infos[-2].changed  # the policy predicts from the delta before
  predicted = {c: seconds + changes * per_change * 8 / (link_gbit * 1e9)
               for c, (seconds, per_change) in rates.items()}
  assert infos[-1].coding == min(predicted, key=predicted.get)
  if link_gbit < 1e-3:
    fewest = min(rates, key=lambda c: rates[c][1])
    assert infos[-1].coding == fewest


DATA = Path(__file__).parent / "data"


def test_a_chain_of_an_older_jsparse_restores_exactly(tmp_path):
  """A chain whose delta steps are arrays of a positioned payload (as jsparse 0.2 development
  versions stored them; its steps: a base, a sparse delta, one in which ``w`` overflowed, a
  sparse delta) restores bit-exactly, and a manager continues it with a delta of parts."""
  import shutil
  shutil.copytree(DATA / "chain_arrays", tmp_path / "chain")
  expected = np.load(DATA / "chain_arrays_expected.npz")
  # The shapes, dtypes and options of the chain's plan.
  tree = {"w": np.zeros((64, 48), np.float32), "b": np.zeros(48, np.float32),
          "i": np.zeros(40, np.int32)}
  plan = jsparse.make_plan(jax.tree.map(jnp.asarray, tree), rollout_dtype=jnp.bfloat16,
                           capacity=0.05, bucket_size=1024)
  with jsparse.DeltaCheckpointManager(tmp_path / "chain", plan) as chain:
    assert [chain.meta(s)["kind"] for s in range(4)] == ["base", "delta", "delta", "delta"]
    assert "modes" in chain.meta(1)  # the older arrays
    for step in range(4):
      restored = chain.restore(step)
      for k, x in restored.items():
        np.testing.assert_array_equal(np_to_bits(np.asarray(x)), expected[f"{step}/{k}"])
    nxt = {k: v.astype(np.float32) if v.dtype == jnp.bfloat16 else v
           for k, v in chain.restore(3).items()}
    nxt["w"] = nxt["w"].at[0, :5].add(1.0)
    info = chain.save(4, nxt)
    assert info.kind == "delta" and "lengths" in chain.meta(4) and chain.chain(4) == [0, 1, 2,
                                                                                   3, 4]
    assert_trees_bitwise_equal(chain.restore(4), plan.cast(nxt))


def test_a_relative_directory_is_taken_as_from_the_working_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  trees = _steps(12, 2)
  plan = _plan(trees[0])
  with jsparse.DeltaCheckpointManager("chains/run", plan) as chain:
    assert [chain.save(s, t).kind for s, t in enumerate(trees)] == ["base", "delta"]
  assert (tmp_path / "chains" / "run" / "1").is_dir()
