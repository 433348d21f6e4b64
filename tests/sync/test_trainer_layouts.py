"""A jitted train step lays its outputs out as XLA chooses: leaves the plan holds whole may come
back split (a bias, a norm scale), and the sender takes them as they are, with no warning and
no reshard of its own; a leaf laid out otherwise than the plan's blocks is resharded, with one
warning per leaf that says what to do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from jsparse._src.wire.parts import read_index


def _params(mesh, rng) -> dict:
  """A matrix split FSDP-style, a bias and a norm scale replicated (as planned)."""
  split, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
  return {"w": jax.device_put(rng.standard_normal((64, 48), np.float32), split),
          "v": jax.device_put(rng.standard_normal((32, 16), np.float32), split),
          "bias": jax.device_put(rng.standard_normal(48, np.float32), whole),
          "scale": jax.device_put(1 + rng.standard_normal(16, np.float32), whole)}


def _step(mesh, relaid: dict):
  """A jitted optimizer-like step whose outputs are laid out as ``relaid`` says (leaf ->
  spec), the others as they came."""
  def step(params, k):
    out = {name: x - 1e-3 * jnp.sign(jnp.sin(x * 1e3 + k)) for name, x in params.items()}
    for name, spec in relaid.items():
      target = NamedSharding(mesh, spec)
      out[name] = (jax.sharding.reshard if mesh.axis_types[0] == AxisType.Explicit
                   else jax.lax.with_sharding_constraint)(out[name], target)
    return out
  return jax.jit(step)


def _laid_out_otherwise(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if "laid out" in r.getMessage()
          or "resharded" in r.getMessage()]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_leaves_the_plan_holds_whole_come_as_the_step_lays_them_out(axis_type, caplog,
                                                                     monkeypatch):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
  rollout_mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(axis_type,) * 2)
  params = _params(mesh, np.random.default_rng(0))
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  step = _step(mesh, {"bias": P("fsdp"), "scale": P("fsdp")})  # XLA split them
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, jax.device_put(
      plan.cast(params), NamedSharding(rollout_mesh, P())))
  puts = []
  device_put = jax.device_put
  for k in range(4):
    params = step(params, k)
    assert params["bias"].sharding.spec == P("fsdp")  # not what the plan recorded
    monkeypatch.setattr(jax, "device_put", lambda *a, **kw: (puts.append(a), device_put(
        *a, **kw))[1])
    with caplog.at_level("WARNING", logger="jsparse"):
      data = sender.send(params)
    monkeypatch.setattr(jax, "device_put", device_put)
    assert_trees_bitwise_equal(receiver.receive(data), plan.cast(params))
    assert sender.last_stats.changed > 0 and not sender.last_stats.anchor
  assert not _laid_out_otherwise(caplog)
  assert not puts  # nothing resharded outside the diff program
  for name in ("bias", "scale"):  # the snapshot stays as planned: parts and streams hold
    assert sender.snapshot[name].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)
  parts = list(sender.send_stream(step(params, 9), chunk_bytes=2048))
  assert_trees_bitwise_equal(receiver.receive(parts), sender.snapshot)


def test_the_payload_does_not_depend_on_how_the_trainer_lays_out_whole_leaves():
  mesh = jax.make_mesh((8,), ("fsdp",))
  params = _params(mesh, np.random.default_rng(1))
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  new = _step(mesh, {})(params, 0)
  relaid = _step(mesh, {"bias": P("fsdp"), "scale": P("fsdp")})(params, 0)
  assert relaid["bias"].sharding.spec == P("fsdp")
  a = jsparse.Sender(plan, params).send(new)
  b = jsparse.Sender(plan, params).send(relaid)
  assert a == b and read_index(plan, a).header.version == 1


def test_a_leaf_laid_out_otherwise_than_the_plans_blocks_warns_once_per_leaf(caplog):
  mesh = jax.make_mesh((8,), ("fsdp",))
  params = _params(mesh, np.random.default_rng(2))
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  steady = _step(mesh, {"bias": P("fsdp")})
  changed = _step(mesh, {"w": P(), "v": P(None, "fsdp")})  # gathered; split by columns
  with caplog.at_level("WARNING", logger="jsparse"):
    for k, step in enumerate([steady, steady, changed, changed, steady, changed]):
      params = step(params, k)
      assert_trees_bitwise_equal(receiver.receive(sender.send(params)), plan.cast(params))
  warnings = _laid_out_otherwise(caplog)
  assert len(warnings) == 2, warnings  # once for each of the two leaves, at the third step
  assert {w.split()[3] for w in warnings} == {"['w']", "['v']"}
  assert all("make the plan from the params as the train step returns them" in w
             for w in warnings)


def test_the_warning_is_once_per_leaf_whatever_the_number_of_senders(caplog):
  """A checkpoint chain makes a sender at each base, next to the trainer's own: a leaf laid out
  otherwise is said once in the process, not once per sender."""
  mesh = jax.make_mesh((8,), ("fsdp",))
  params = {"u": jax.device_put(np.zeros((40, 24), np.float32), NamedSharding(mesh, P("fsdp")))}
  plan = jsparse.make_plan(params)
  gathered = {"u": jax.device_put(np.ones((40, 24), np.float32), NamedSharding(mesh, P()))}
  with caplog.at_level("WARNING", logger="jsparse"):
    for _ in range(3):
      jsparse.Sender(plan, params).send(gathered)
  warnings = _laid_out_otherwise(caplog)
  assert len(warnings) == 1 and "['u']" in warnings[0], warnings
