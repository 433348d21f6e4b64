"""A real Flax NNX model, optax AdamW at lr 1e-6 on fp32 masters, synced to a bf16 rollout copy."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jsparse
from jsparse.examples import demo, rl_model
from jsparse.testing import assert_trees_bitwise_equal

CFG = rl_model.Config(vocab=512, dim=128, depth=2, batch=16, seq=32, pretrain_steps=20)


def test_rl_finetuning_syncs_exactly_and_sparsely(record_property):
  model, optimizer, batches = rl_model.rl_finetuning(CFG)
  params = nnx.state(model, nnx.Param)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.05)
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  densities, ratios = [], []
  for _ in range(4):
    rl_model.train_step(model, optimizer, next(batches))
    params = nnx.state(model, nnx.Param)
    assert params["embed"]["embedding"].dtype == jnp.float32  # fp32 masters
    rollout = receiver.receive(sender.send(params))
    assert_trees_bitwise_equal(rollout, plan.cast(params))
    stats = sender.last_stats
    densities.append(stats.density)
    ratios.append(stats.dense_bytes / stats.payload_bytes)
  print(f"\n{plan.num_elements} params; density per step {np.round(densities, 5).tolist()}; "
        f"payload vs dense bf16 {np.round(ratios, 1).tolist()}x")
  record_property("densities", densities)
  # lr 1e-6 moves well under 10% of bf16 elements per step, and never none of them.
  assert all(0.0 < d < 0.1 for d in densities)
  assert all(r > 5 for r in ratios)


def test_several_optimizer_steps_between_syncs_lose_nothing():
  model, optimizer, batches = rl_model.rl_finetuning(CFG)
  params = nnx.state(model, nnx.Param)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender, receiver = jsparse.Sender(plan, params), jsparse.Receiver(plan, plan.cast(params))
  for _ in range(3):
    rl_model.train_step(model, optimizer, next(batches))
  params = nnx.state(model, nnx.Param)
  assert_trees_bitwise_equal(receiver.receive(sender.send(params)), plan.cast(params))


def test_demo_main_job_runs(tmp_path, capsys):
  summary = demo.main(["--steps", "3", "--dim", "64", "--depth", "1", "--vocab", "256",
                       "--rebase-every", "1", "--out", str(tmp_path)])
  assert summary["all_exact"] and summary["checkpoint_chain_exact"] and len(summary["steps"]) == 3
  assert summary["trainer_mesh"] == {"fsdp": 8} and summary["rollout_mesh"] == {"data": 2,
                                                                               "tensor": 4}
  assert [s["checkpoint_kind"] for s in summary["steps"]] == ["delta", "base", "delta"]
  assert (tmp_path / "demo_summary.json").exists()
  assert (tmp_path / "demo_sync.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0", "1", "2", "3"]
  out = capsys.readouterr().out
  assert "every step bit-exact: True" in out and "demo_sync.png" in out
  again = demo.main(["--steps", "1", "--dim", "64", "--depth", "1", "--vocab", "256",
                     "--out", str(tmp_path), "--no-progress"])  # a second run, same folder
  assert again["all_exact"]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0", "1"]


def test_demo_help():
  with pytest.raises(SystemExit) as exit_info:
    demo.parse_args(["--help"])
  assert exit_info.value.code == 0
