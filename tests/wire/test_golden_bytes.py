"""The payload bytes of a fixed update, pinned: a refactor of the code must not change the wire.

The hashes were recorded on the last commit before the redesign (686fd14, zstandard 0.25.0):
ranked, positioned and lists codings of a delta, an overflowing delta and an anchor over a tree
with several dtypes, pooled leaves and special values, and a sharded leaf the rollout splits.
A deliberate change of the format updates them (and says why in its commit).
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse
from jsparse.testing import special_values
from tests import strategies

GOLDEN = {
    "ranked/delta": ("4f4ef901c83db1c4fce42cf43c84cd120ebac68ae267b573f74e08c5d8aacff2", 2661),
    "ranked/overflow": ("36d7cca04601e2503f235d1c797d215153af30c2d005fb7c9c5ef9317b22c087",
                        120118),
    "ranked/anchor": ("97f9394cfa9d6dccb715d81b868b7dd1581b1513297515a4e7bc1366184bf77b", 133476),
    "positioned/delta": ("33f59a3d56a2695d6d49606e2603b6a717582e1a108cf33aa657d616b95874ad",
                         2644),
    "positioned/overflow": ("36d7cca04601e2503f235d1c797d215153af30c2d005fb7c9c5ef9317b22c087",
                            120118),
    "positioned/anchor": ("97f9394cfa9d6dccb715d81b868b7dd1581b1513297515a4e7bc1366184bf77b",
                          133476),
    "lists/delta": ("76115e80890a979d1c9826a140e7fdbbf0a7125b5e52ba8f4b961c0da2904010", 7151),
    "lists/overflow": ("d9aed6b0a6e2268591fffe22bcafdc74b29fbb7c847f9a47087069f7e83ccada",
                       120094),
    "lists/anchor": ("fb1588c30be37b58438fa87d78386ac3fcdf720aa129dda729d9a26fc213a6e9", 133452),
    "sharded/delta": ("7c6cde03aead1e4ef53d0bb9f3683733f69371adddd353e7190953fd0b718389", 16477),
}


def _tree(seed):
  rng = np.random.default_rng(seed)
  tree = dict(strategies.mixed_tree(rng), h=rng.normal(size=(40,)).astype(np.float16))
  tree["h"][:len(special_values(np.float16))] = special_values(np.float16)
  return tree


def _update(rng, tree, density):
  """fp32 leaves nudged, ints incremented at random, every third float16 flipped in its low bit."""
  out = {}
  for k, v in tree.items():
    v = strategies.nudge_leaf(rng, v, density)
    if v.dtype == np.int32:
      v = v + (rng.random(v.shape) < 0.3)
    elif v.dtype == np.float16:
      v.view(np.uint16)[::3] ^= 1
    out[k] = v
  return out


def _payloads():
  tree = _tree(0)
  plan = jsparse.make_plan(tree, capacity=0.1, **strategies.mixed_plan_options())
  out = {}
  for coding in ("ranked", "positioned", "lists"):
    sender = jsparse.Sender(plan, tree, coding=coding)
    new = _update(np.random.default_rng(1), tree, 0.03)
    out[f"{coding}/delta"] = sender.send(new)
    out[f"{coding}/overflow"] = sender.send(dict(new, w=new["w"] + 1.0))
    out[f"{coding}/anchor"] = sender.send(new, full=True)
  mesh = jax.make_mesh((8,), ("fsdp",))
  w = np.random.default_rng(2).normal(size=(64, 128)).astype(np.float32)
  trainer = NamedSharding(mesh, P("fsdp", None))
  plan = jsparse.make_plan({"w": jax.device_put(w, trainer)}, rollout_dtype=jnp.bfloat16,
                           rollout_shardings={"w": NamedSharding(mesh, P(None, "fsdp"))})
  sender = jsparse.Sender(plan, {"w": jax.device_put(w, trainer)})
  moved = w * (1 + (np.abs(w) < 0.1) * 0.01)
  out["sharded/delta"] = sender.send({"w": jax.device_put(moved, trainer)})
  return out


def test_payload_bytes_are_unchanged():
  got = {k: (hashlib.sha256(v).hexdigest(), len(v)) for k, v in _payloads().items()}
  changed = {k: (got[k], GOLDEN[k]) for k in GOLDEN if got[k] != GOLDEN[k]}
  assert not changed, f"payload bytes changed (sha256, length now vs pinned): {changed}"
