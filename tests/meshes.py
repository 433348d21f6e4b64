"""Shared sharded test data: named mesh layouts, and trees placed on them."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tests import strategies

# name -> (mesh shape, axis names, {leaf: spec})
LAYOUTS = {
    "single": ((1,), ("x",), {}),
    "fsdp2": ((2,), ("fsdp",), {"w": P("fsdp", None), "emb": P(None, "fsdp")}),
    "fsdp4": ((4,), ("fsdp",), {"w": P("fsdp", None), "emb": P("fsdp", None), "b": P("fsdp")}),
    "fsdp8": ((8,), ("fsdp",), {"w": P("fsdp", None), "emb": P("fsdp", None)}),
    "dp2xtp4": ((2, 4), ("data", "tensor"), {"w": P(None, "tensor"), "emb": P("tensor", None)}),
    "fsdp2xtp2": ((2, 2), ("fsdp", "tensor"), {"w": P("fsdp", "tensor"),
                                               "emb": P(("fsdp", "tensor"), None)}),
    "tp4xdp2": ((4, 2), ("tensor", "data"), {"w": P("tensor", "data"), "b": P(("tensor", "data"))}),
}
SHAPES = {"w": (64, 96), "emb": (128, 48), "b": (96,), "scalar": ()}
# (trainer, rollout) layout pairs
PAIRS = [("fsdp8", "dp2xtp4"), ("dp2xtp4", "fsdp8"), ("fsdp2", "fsdp4"), ("fsdp4", "single"),
         ("single", "tp4xdp2"), ("fsdp2xtp2", "tp4xdp2"), ("tp4xdp2", "fsdp2xtp2"),
         ("fsdp8", "fsdp8")]


def place(tree, layout_name):
  """``tree`` (a dict of SHAPES-like arrays) on the mesh and specs of ``layout_name``."""
  mesh_shape, names, specs = LAYOUTS[layout_name]
  n = int(np.prod(mesh_shape))
  mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:n])
  return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in tree.items()}


def trees(seed, density):
  """(base, new) fp32 dicts of SHAPES with special values, new a ``density`` perturbation."""
  rng = np.random.default_rng(seed)
  base = {k: strategies.with_specials(rng, rng.normal(size=s).astype(np.float32))
          for k, s in SHAPES.items()}
  new = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
  return base, new


def assert_layout(tree, shardings):
  for k, v in tree.items():
    assert v.sharding.is_equivalent_to(shardings[k], v.ndim), (k, v.sharding, shardings[k])
