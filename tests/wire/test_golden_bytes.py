"""The payload bytes of a fixed update, pinned: a refactor of the code must not change the wire.

Ranked, positioned and lists codings of a delta, an overflowing delta and an anchor over a tree
with several dtypes, pooled leaves and special values, and a leaf the trainer splits (a delta
and an overflow of its blocks). The bodies are those of the last commit before the redesign (686fd14, zstandard 0.25.0); the
headers changed twice since, deliberately: the plan fingerprint no longer covers a rollout
layout (the plan knows none), and the digests are bound to the versions (a forged version fails
the end-to-end check). A deliberate change of the format updates these hashes and says
why in its commit. The packed coding's bytes come from device programs: they are the same on
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
    "ranked/delta": ("6ebe52b343d7efaebd35d1d295e3807932090605e06eebb165905f7ae1b3184f", 2661),
    "ranked/overflow": ("6db42ebf91c3c0deed4df4f74aedf7e9d9179d97b47aec7236973c661e1436d8", 120118),
    "ranked/anchor": ("2d335b56bbe38a8717506879560a195165954b2364abc6cf181b1988a802c336", 133476),
    "positioned/delta": ("b03dcd9e8224bf4debca673cca02d5f2d8e9d55b621914679e9024d6e895bde8", 2644),
    "positioned/overflow": ("6db42ebf91c3c0deed4df4f74aedf7e9d9179d97b47aec7236973c661e1436d8",
                             120118),
    "positioned/anchor": ("2d335b56bbe38a8717506879560a195165954b2364abc6cf181b1988a802c336",
                           133476),
    "lists/delta": ("a55592f6aab1a8cd942890cbfd8f02f26ae44034250bc01c551d6519adb3db38", 7151),
    "lists/overflow": ("15c2dd3777d59abe29dad2b6c1887cdab86726c168d6f9510a459867a509484f", 120094),
    "lists/anchor": ("bfbf0e067ffec2db8ce0576272118c99b286e23e31cd7bedc87f1f3357ac2127", 133452),
    "sharded/overflow": ("f656315c836193d165d967dadd5e3fe4ab2b810bc4172758b272208ac0f7f4d9",
                         16477),
    "sharded/delta": ("35b558e62b264864c234658ee35dffd3da44794c0656081fcbf59b327cc4355f", 831),
    "packed-positioned/delta": ("6c16f77f9e70b26ce84a27e28c836a3639d01915396575300a1c6cc54a01c982",
                                2950),
    "packed/overflow": ("9d6abba2e3b5c9a088fd7d21089396a102f3cd153e10355adaa8eaecddddb990", 120094),
    "packed/anchor": ("2f77ffd9f5c84d13540b2c552d52681eb4bc630549f7f153b4ccba01120501d9", 133452),
    "packed/delta": ("99b7d7992b14f7ff7e1a80e69120fdd48692a41828a8f5474dae713cad439fd1",
                            2950),
    "packed-positioned/overflow": ("9d6abba2e3b5c9a088fd7d21089396a102f3cd153e10355adaa8eaecddddb990",
                               120094),
    "packed-positioned/anchor": ("2f77ffd9f5c84d13540b2c552d52681eb4bc630549f7f153b4ccba01120501d9",
                             133452),
    "sharded/packed-overflow": ("6da856e71ae986954256d9304a100eb806016d1364246d940e1c7b78bbab35fe",
                                16453),
    "sharded/packed": ("aaa503b0c15e15f2a9869d9eada76a7b7380c42048d4754486231ecd21373799", 1059),
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
  for coding in ("ranked", "positioned", "lists", "packed", "packed-positioned"):
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
