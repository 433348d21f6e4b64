"""A differential fuzz of the whole stack: random trees, dtypes, shardings, codings, densities,
whole payloads or parts, and mutations. Invariant: a receive is exact or raises a jsparse error; a refused
payload changes nothing (non-donating receiver); the next good payload is accepted.

The suite runs 8 cases (each compiles its own programs: ~15 s on 2 CPU cores);
``pytest tests/sync/test_fuzz.py --fuzz-examples 500`` runs long.
"""

import os
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse
from jsparse.testing import trees_bitwise_equal
from tests import strategies
from tests.helpers import release_compiled_programs_if_many

_MESHES = [None, ((8,), ("x",)), ((2, 4), ("a", "b")), ((1, 8), ("a", "b"))]


def _placement(rng, tree, mesh_key):
  """A function placing trees like ``tree`` on one random mesh, each 2-D leaf with a random
  (evenly dividing) spec, the same at every call."""
  if mesh_key is None:
    return lambda t: {k: jnp.asarray(v) for k, v in t.items()}
  mesh = jax.make_mesh(*mesh_key, devices=jax.devices()[:8])
  names = list(mesh.axis_names) + [None]
  specs = {k: P(*[names[i] for i in rng.choice(len(names), 2, replace=False)])
           if np.ndim(v) == 2 else P() for k, v in tree.items()}
  return lambda t: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in t.items()}


def _mutate(rng, data: bytes) -> bytes:
  body = bytearray(data[:-4])
  kind = rng.integers(0, 4)
  at = int(rng.integers(0, len(body)))
  if kind == 0:
    body[at] ^= int(rng.integers(1, 256))
  elif kind == 1:
    del body[at:]
  elif kind == 2:
    body[at:at] = bytes(rng.integers(0, 256, int(rng.integers(1, 8)), dtype=np.uint8))
  else:
    body[at] = int(rng.integers(0, 256))
  reseal = rng.random() < 0.7  # mostly behind a valid checksum, to reach the deeper checks
  return bytes(body) + (struct.pack("<I", zlib.crc32(bytes(body))) if reseal else data[-4:])


def _host(tree):
  return jax.tree.map(np.asarray, tree)


@settings(max_examples=int(os.environ.get("JSPARSE_FUZZ_EXAMPLES", "6")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1), st.sampled_from(_MESHES), st.sampled_from(_MESHES),
       st.sampled_from(list(jsparse.Coding)), st.sampled_from([0.01, 0.2, 1.0]),
       st.sampled_from([64, 4096]))
def test_the_whole_stack_is_exact_or_refuses_cleanly(seed, trainer_mesh, rollout_mesh, coding,
                                                      capacity, bucket_size):
  release_compiled_programs_if_many()  # each case compiles its own programs
  rng = np.random.default_rng(seed)
  dtypes = [strategies.ALL_DTYPES[i] for i in rng.integers(0, len(strategies.ALL_DTYPES), 3)]
  shapes = [(8 * int(rng.choice([2, 4])), 16), (int(rng.choice([0, 7, 33])),), ()]
  tree = {f"leaf{i}": strategies.with_specials(rng, strategies.random_bits(rng, s, d))
          for i, (s, d) in enumerate(zip(shapes, dtypes))}
  on_trainer, on_rollout = _placement(rng, tree, trainer_mesh), _placement(rng, tree, rollout_mesh)
  plan = jsparse.make_plan(on_trainer(tree), capacity=capacity, bucket_size=bucket_size)
  sender = jsparse.Sender(plan, on_trainer(tree), coding=coding)
  careful = jsparse.Receiver(plan, on_rollout(tree), donate=False)
  fast = jsparse.Receiver(plan, on_rollout(tree))
  for _ in range(3):
    density = float(rng.choice([0.0, 0.01, 0.1, 0.7]))
    tree = {k: strategies.with_specials(rng, strategies.perturb(rng, v, density))
            for k, v in tree.items()}
    as_part = rng.random() < 0.4  # a whole payload, or the one part of a one-process job
    if as_part:
      data = sender.send(on_trainer(tree))
      receive = lambda receiver, d: receiver.receive([d])
    else:
      data = sender.send(on_trainer(tree))
      receive = lambda receiver, d: receiver.receive(d)
    before, version = _host(careful.params), careful.version
    try:
      receive(careful, _mutate(rng, data))  # accepted only if the mutation changed nothing
      event("mutated payload accepted, exact")
    except jsparse.JsparseError as e:
      event(f"mutated {'part' if as_part else 'payload'} refused: {type(e).__name__}")
      assert careful.version == version and trees_bitwise_equal(careful.params, before)
      receive(careful, data)  # the good one is accepted
    receive(fast, data)  # the donating receiver gets the good payloads only
    for receiver in (careful, fast):
      assert receiver.version == sender.version
      assert trees_bitwise_equal(receiver.params, sender.snapshot)
