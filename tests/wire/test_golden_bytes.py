"""The bytes a sender sends for a fixed update, pinned: a refactor of the code must not change
the wire.

Every coding's delta, overflowing delta and anchor over a tree with several dtypes, pooled
leaves and special values, and a leaf the trainer splits (a delta and an overflow of its
blocks), each a version of one part (``wire/parts.py``; zstandard 0.25.0). A deliberate change
of the format updates these hashes and says why in its commit (the CHANGELOG names the wire
changes). The packed coding's bytes come from device programs: they are the same on
every backend (integer arithmetic only), so these pins hold on GPUs and TPUs too.
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
    "ranked/delta": ("c0a3450bd95b63a514933dbdb4f8586e897983e0134a969b2ed4c5585b5a777d", 3000),
    "ranked/overflow": ("8b4cbddaed79b45c8f660e47f4305117bcb627b07b75c4cb68b20c94bb86b45d", 120267),
    "ranked/anchor": ("0753541dab8dc55f23cf64109361812d922e41dc91146ce8126ecd2dd0839375", 133770),
    "positioned/delta": ("def24bdf1c9f573e21d941b1ba1612facfdab3cfb556b2db8133185ad1443123", 3005),
    "positioned/overflow": ("6f83ac04d7458acce16634a1bcdb5bdc8cb715070a4ca99edd8ac59c472df7c6",
                            120267),
    "positioned/anchor": ("0753541dab8dc55f23cf64109361812d922e41dc91146ce8126ecd2dd0839375",
                          133770),
    "sharded/overflow": ("5dcf1c8b304d6f032ad5ae414a7693c6a914b49e5b67af1ba7fc32db3dbc67f3", 16516),
    "sharded/delta": ("69aa2dc70ca9458df47b39bdb49929c6e53721d3a7a441881a5979523735d27b", 870),
    "packed/overflow": ("0f04dcd199323e12ec785c9df7f7bb231a7da1002f279bc85b2ec283c73d9544", 120238),
    "packed/anchor": ("e174299e63349f0de0b662fe000e01d98101f49ab7a10eff2fa9e0d98e542ac4", 133596),
    "packed/delta": ("7f989bae3d8a06696d6d4cad23b098d3b3407d9463d495f5568a672bbca74969", 3122),
    "sharded/packed-overflow": ("fbdfc61c19998c916ea1f9d846fec573e52f1afcc8d98fb1d436e1c860bd3b4a",
                                16487),
    "sharded/packed": ("aef36997d11dfcc86199fde01e55d893bc5fc5f35d5fd034b41c501c54836374", 889),
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
  for coding in ("ranked", "positioned", "packed"):
    sender = jsparse.Sender(plan, tree, coding=coding)
    new = _update(np.random.default_rng(1), tree, 0.03)
    out[f"{coding}/delta"] = sender.send(new)
    out[f"{coding}/overflow"] = sender.send(dict(new, w=new["w"] + 1.0))
    out[f"{coding}/anchor"] = sender.send(new, anchor=True)
  mesh = jax.make_mesh((8,), ("fsdp",))
  w = np.random.default_rng(2).normal(size=(64, 128)).astype(np.float32)
  trainer = NamedSharding(mesh, P("fsdp", None))
  moved = w * (1 + (np.abs(w) < 0.1) * 0.01)  # 8% of the elements
  # A small split leaf takes pooled_capacity per block (1.0: a delta); at 0.05 with static slots
  # (max_capacity=0: no widening) the same update overflows its blocks.
  for names, options, widen in ((("delta", "packed"), {}, {}),
                                (("overflow", "packed-overflow"), {"pooled_capacity": 0.05},
                                 {"max_capacity": 0})):
    plan = jsparse.make_plan({"w": jax.device_put(w, trainer)}, rollout_dtype=jnp.bfloat16,
                             **options)
    for name, coding in zip(names, ("ranked", "packed")):
      sender = jsparse.Sender(plan, {"w": jax.device_put(w, trainer)}, coding=coding, **widen)
      out[f"sharded/{name}"] = sender.send({"w": jax.device_put(moved, trainer)})
  return out


def test_payload_bytes_are_unchanged():
  got = {k: (hashlib.sha256(v).hexdigest(), len(v)) for k, v in _payloads().items()}
  changed = {k: (got[k], GOLDEN[k]) for k in GOLDEN if got[k] != GOLDEN[k]}
  assert not changed, f"payload bytes changed (sha256, length now vs pinned): {changed}"
