"""Tunix's own GRPO learner (``tunix.rl.grpo``) on a tiny random Qwen3 from Tunix's model zoo,
fp32 trainer and bf16 ``VanillaRollout`` on two meshes, with jsparse syncs: every sync leaves the
rollout bit-identical to the trainer's params cast to bf16, and the run (losses, rewards, every
synced state) equals the same seeded run with Tunix's dense sync. With qwix LoRA only the
adapters travel. A rollout job in another process follows the trainer's feed to the same bits.
Each run happens once per module."""

import logging
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jsparse
from jsparse import engine
from jsparse.testing import assert_trees_bitwise_equal, host_device_flags
from jsparse import tunix as jtunix
from jsparse._src.engine import records
from jsparse._src.tunix import compat
from jsparse.examples import tunix_grpo

STEPS = 3
FOLLOW_STEPS = 2  # versions the rollout job in another process follows
FOLLOW_TIMEOUT = 240  # seconds for the rollout job


def _bits(x: np.ndarray) -> np.ndarray:
  return np.asarray(x).view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _cast_bits(trainer_state: dict) -> dict:
  return {k: _bits(v.astype(ml_dtypes.bfloat16)) for k, v in trainer_state.items()}


@pytest.fixture(scope="module")
def dense():
  return tunix_grpo.run_grpo(sparse=False, steps=STEPS)


@pytest.fixture(scope="module")
def sparse():
  return tunix_grpo.run_grpo(sparse=True, steps=STEPS)


def test_every_sync_leaves_the_rollout_bit_identical_to_the_trainer_cast_to_bf16(sparse):
  assert len(sparse.synced) == STEPS
  for trainer, rollout in sparse.synced:
    assert {v.dtype for v in rollout.values()} == {np.dtype(ml_dtypes.bfloat16)}
    expected = _cast_bits(trainer)
    assert rollout.keys() == expected.keys()
    for name, bits in expected.items():
      np.testing.assert_array_equal(_bits(rollout[name]), bits, err_msg=name)
  records = sparse.sparse.records
  assert [r.version for r in records] == list(range(1, STEPS + 1))
  for r in records:  # a delta of the changed elements, far below Tunix's fp32 copy
    assert 0 < r.changed < 0.2 * r.elements and r.payload_bytes < 0.5 * r.dense_bytes, r
  # Every sync records the digest of the weights generated with after it: one per version.
  assert records[-1].digest == sparse.sparse.link.receiver.digest.hex()
  assert len({r.digest for r in records}) == STEPS and all(len(r.digest) == 16 for r in records)


def test_the_run_equals_the_same_run_with_tunix_dense_sync(dense, sparse):
  assert len(dense.losses) == len(sparse.losses) == STEPS
  assert sparse.losses == dense.losses and sparse.rewards == dense.rewards
  assert len(set(dense.losses)) > 1  # the policy moved (the comparison can fail)
  for (d_trainer, d_rollout), (s_trainer, s_rollout) in zip(dense.synced, sparse.synced, strict=True):
    for name in d_rollout:
      np.testing.assert_array_equal(_bits(s_trainer[name]), _bits(d_trainer[name]), err_msg=name)
      np.testing.assert_array_equal(_bits(s_rollout[name]), _bits(d_rollout[name]), err_msg=name)


def test_a_rollout_job_in_another_process_follows_the_trainer_feed(tmp_path):
  feed_dir, out = tmp_path / "feed", tmp_path / "rollout.npz"
  feed = engine.DirectoryFeed(feed_dir)
  env = dict(os.environ, XLA_FLAGS=host_device_flags(4))
  job = subprocess.Popen(
      [sys.executable, "-m", "jsparse.examples.tunix_grpo", "--feed", str(feed_dir),
       "--until", str(FOLLOW_STEPS), "--out", str(out)], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  try:
    run = tunix_grpo.run_grpo(sparse=True, steps=FOLLOW_STEPS, feed=feed, chunk_bytes=64 << 10)
    output, _ = job.communicate(timeout=FOLLOW_TIMEOUT)
  finally:
    job.kill()
  assert job.returncode == 0, output[-3000:]
  assert f"rollout job at version {FOLLOW_STEPS}" in output
  trainer, local = run.synced[-1]
  expected = _cast_bits(trainer)
  with np.load(out) as remote:
    assert sorted(remote.files) == sorted(expected)
    for name, bits in expected.items():
      np.testing.assert_array_equal(remote[name], bits, err_msg=name)
      np.testing.assert_array_equal(_bits(local[name]), bits, err_msg=name)
  assert [r.version for r in run.sparse.records] == list(range(1, FOLLOW_STEPS + 1))
  assert all(r.payload_bytes > 0 for r in run.sparse.records)


def test_with_lora_only_the_adapters_travel_and_every_param_stays_bit_exact():
  run = tunix_grpo.run_grpo(sparse=True, steps=2, lora_rank=4)
  assert run.sparse.filter_types == (nnx.LoRAParam,)
  paths = [leaf.path for leaf in run.sparse.link.sender.plan.leaves]
  assert paths and all("_lora_" in p for p in paths)
  for trainer, rollout in run.synced:  # the adapters synced, the frozen base cast once at start
    for name, bits in _cast_bits(trainer).items():
      np.testing.assert_array_equal(_bits(rollout[name]), bits, err_msg=name)
  (first, _), (second, _) = run.synced
  assert any(not np.array_equal(first[k], second[k]) for k in first if "_lora_" in k)
  assert all(np.array_equal(first[k], second[k]) for k in first if "_lora_" not in k)
  assert all(0 < r.changed and r.elements == sum(np.size(first[k]) for k in first
                                                  if "_lora_" in k) for r in run.sparse.records)


def test_a_sync_of_other_variables_is_refused_before_anything_moves(sparse):
  rollout = sparse.sparse
  version = rollout.link.receiver.version
  before = jax.tree.map(np.asarray, rollout.link.receiver.params)
  with pytest.raises(jsparse.ConfigError, match="LoRAParam"):
    rollout.update_params({}, (nnx.LoRAParam,))
  assert rollout.link.receiver.version == version == rollout.link.sender.version
  assert_trees_bitwise_equal(rollout.link.receiver.params, before)


def test_a_changed_tunix_api_names_the_tested_version():
  with pytest.raises(jtunix.TunixVersionError, match=r"google-tunix==0\.1\.7.*installed: 0\.1\.7"):
    compat.tunix_attr("tunix.rl.rollout.base_rollout", "RenamedRollout")
  with pytest.raises(jtunix.TunixVersionError, match="cannot import tunix.rl.moved"):
    compat.tunix_attr("tunix.rl.moved", "BaseRollout")
  with pytest.raises(jtunix.TunixVersionError, match="RLCluster has no attribute 'actor_trainer'"):
    jtunix.use_sparse_sync(object())
  assert jtunix.TESTED_TUNIX_VERSION == compat.installed_version()


def test_a_plan_between_unlike_states_names_the_leaf():
  with pytest.raises(jsparse.PlanMismatchError, match=r"\['w'\] \(3,\).*\(4,\)"):
    jtunix.tunix_plan({"w": np.zeros(3, np.float32)}, {"w": np.zeros(4, ml_dtypes.bfloat16)})


@pytest.mark.parametrize("through_feed", [False, True], ids=["in_process", "feed"])
def test_a_rollout_that_holds_other_bits_starts_from_an_anchor(through_feed, tmp_path, caplog):
  """The trainer's base and the rollout's params differ (e.g. another checkpoint): the digests
  tell, the first sync is an anchor (only an anchor: nothing the rollout must refuse, no
  warning), and the rollout then holds the trainer's bits."""
  import jax.numpy as jnp
  from jsparse._src.tunix.links import FeedLink, InProcessLink
  from jsparse._src.tunix.rollout import SparseRollout

  class Installed:  # stands for a Tunix rollout
    params = None

    def update_params(self, params, filter_types=None):
      self.params = params

  trainer = {"w": jnp.linspace(-1, 1, 64, dtype=jnp.float32)}
  plan = jtunix.tunix_plan(trainer, {"w": jnp.zeros(64, jnp.bfloat16)})
  sender = jsparse.Sender(plan, trainer)
  receiver = jsparse.Receiver(plan, {"w": jnp.zeros(64, jnp.bfloat16)})
  assert sender.digest != receiver.digest
  link = (FeedLink(sender, receiver, engine.DirectoryFeed(tmp_path), anchor_first=True)
          if through_feed else InProcessLink(sender, receiver, anchor_first=True))
  rollout = SparseRollout(Installed(), link, ("Param",))
  with caplog.at_level(logging.WARNING, "jsparse"):
    for step in range(1, 3):
      trainer = {"w": trainer["w"] * 1.01}
      rollout.update_params(trainer, ("Param",))
      assert_trees_bitwise_equal(rollout.inner.params, plan.cast(trainer))
      assert receiver.version == sender.version == step
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
  first = rollout.records[0]  # the anchor alone: 128 B of bf16 and its framing
  assert plan.rollout_bytes <= first.payload_bytes < plan.rollout_bytes + 300
  if through_feed:
    assert link.subscriber.stats.skipped == 0 and link.subscriber.stats.anchors == 1


def test_a_quantized_rollout_fed_from_a_mesh_syncs_its_scales_without_overflow_warnings(
    tmp_path, caplog):
  """The feed link of a rollout serving int8 weights, the trainer's weights on a mesh (as Tunix
  lays them out) and the rollout holding other bits (an anchor first). Every RL step moves every
  per-channel scale, and a scale leaf is small: split over the mesh, it once got the large
  leaves' capacity (5%), so the second sync (the first delta) overflowed and logged a warning.
  It takes the small leaves' capacity now: two syncs, no warning, nothing carried densely."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jsparse import quantized
  from jsparse._src.tunix.links import FeedLink

  mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
  on_mesh = lambda w: {"w": jax.device_put(w, NamedSharding(mesh, P(None, "tp")))}  # noqa: E731
  rng = np.random.default_rng(0)
  master = (rng.normal(size=(256, 512)) * 0.02).astype(np.float32)  # codes: a large leaf
  plan = jsparse.make_plan(on_mesh(master), quantize=quantized.int8_per_channel())
  sender = jsparse.Sender(plan, on_mesh(master))
  receiver = jsparse.Receiver(plan, plan.cast(on_mesh(master * 0.5)))
  link = FeedLink(sender, receiver, engine.DirectoryFeed(tmp_path), anchor_first=True)
  with caplog.at_level(logging.WARNING, "jsparse"):
    for step in range(1, 3):
      master = (master * (1 + 1e-4 * rng.normal(size=master.shape))).astype(np.float32)
      assert link.sync(on_mesh(master)).version == step
      assert_trees_bitwise_equal(receiver.params, plan.cast(on_mesh(master)))
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
  assert sender.last_stats.changed > 0 and sender.last_stats.overflowed_segments == 0


@pytest.mark.parametrize("qtype", ["float8_e4m3fn", "int8"])
def test_a_rollout_serving_qwix_ptq_weights_holds_their_exact_codes_after_every_sync(qtype):
  """A Tunix rollout whose MLP weights are qwix PTQ-quantized (``qwix.quantize_model``): each
  ``RLCluster.sync_weights`` leaves the rollout's codes and scales equal to qwix's quantizer (under
  jit, with the rollout's own ``how``) on the trainer's masters, its other weights bf16-exact,
  and the rollout still generates."""
  import jax.numpy as jnp
  from qwix._src.core import qarray
  from qwix._src.providers.ptq import WithAux
  from tunix.rl.rollout import base_rollout

  cluster = tunix_grpo.build_cluster(init_std=0.02)
  tunix_grpo.quantize_rollout(cluster, qtype)
  sync = jtunix.use_sparse_sync(cluster)
  actor, rollout = cluster.actor_trainer.model, cluster.rollout.model()
  quantized = {path + (name,): value.how for path, module in nnx.iter_modules(rollout)
               for name, value in vars(module).items() if isinstance(value, WithAux)}
  assert len(quantized) == 6  # gate, up and down projections of both layers
  trainer_modules = dict(nnx.iter_modules(actor))
  for step in range(2):
    _, params, _ = nnx.split(actor, nnx.Param, ...)
    nnx.update(actor, jax.tree.map(  # an RL-sized update of every matrix
        lambda x: x * (1 + 1e-4 * jax.random.normal(jax.random.key(step), x.shape, x.dtype))
        if x.ndim >= 2 else x, params))
    cluster.sync_weights()
    rollout_modules = dict(nnx.iter_modules(cluster.rollout.model()))
    for path_name, how in quantized.items():
      master = getattr(trainer_modules[path_name[:-1]], path_name[-1])[...]
      want = jax.jit(lambda x, how=how: qarray.quantize(x, how))(master)
      got = getattr(rollout_modules[path_name[:-1]], path_name[-1]).array
      for a, b in ((got.qvalue[...], want.qvalue), (got.scale[...], want.scale)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                      err_msg=str(path_name))
    trainer_bits = _cast_bits({k: v for k, v in tunix_grpo._host_state(actor).items()})
    held = tunix_grpo._host_state(cluster.rollout.model())
    plain = [k for k in trainer_bits if k in held]
    assert len(plain) == len(held) - 2 * len(quantized)
    for k in plain:
      np.testing.assert_array_equal(_bits(held[k]), trainer_bits[k], err_msg=k)
  records = sync.records
  assert [r.version for r in records] == [1, 2] and records[-1].payload_bytes < records[-1].dense_bytes
  config = base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=8,
                                      kv_cache_size=64, data_type=jnp.bfloat16, eos_tokens=[2])
  assert cluster.rollout.generate(["w3 w4"], config).text


class _LinearRollout:
  """Stands for a Tunix rollout in a job of its own (a model and ``update_params``)."""

  def __init__(self):
    self.net = nnx.Linear(16, 16, rngs=nnx.Rngs(0))

  def model(self):
    return self.net

  def update_params(self, params, filter_types):
    nnx.update(self.net, params)


def test_a_keyed_rollout_job_applies_only_the_trainers_signed_versions(tmp_path):
  trainer_key = engine.Ed25519Key.generate()
  trainer = nnx.state(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), nnx.Param)
  plan = jtunix.tunix_plan(trainer, trainer)
  feed = engine.DirectoryFeed(tmp_path / "feed")
  publisher = engine.Publisher(jsparse.Sender(plan, trainer), feed, key=trainer_key)
  follower = jtunix.RolloutSubscriber(
      _LinearRollout(), plan, feed, key=engine.Ed25519Key(public_key=trainer_key.public_bytes()))
  forger = engine.Publisher(jsparse.Sender(plan, trainer), engine.DirectoryFeed(tmp_path / "x"))
  (forged,) = forger.publish(jax.tree.map(lambda x: x + 5, trainer), anchor=True)
  publisher.publish(jax.tree.map(lambda x: x + 1, trainer))
  mine = engine.Entry(forged.version + 1, "anchor", 0, forged.parts, publisher.generation,
                      publisher.run)
  parts = [bytes(p) for p in engine.DirectoryFeed(tmp_path / "x").parts(forged)]
  for k, part in enumerate(parts):
    feed.put(mine, k, part)
  feed.commit(mine, records.commit_record(mine, [records.part_meta(p) for p in parts], None))
  assert follower.poll() == [1] and follower.version == 1  # the unsigned anchor 2 is ignored
  assert_trees_bitwise_equal(nnx.state(follower.rollout.net, nnx.Param),
                             plan.cast(jax.tree.map(lambda x: x + 1, trainer)))
