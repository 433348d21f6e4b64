"""Trainer and rollouts as separate jobs: a :class:`Publisher` puts every version's parts into a
feed (a shared directory, :class:`DirectoryFeed`; Ray's object store, :class:`RayFeed`; an
object store such as S3 or GCS, :class:`ObjectStoreFeed`), and each rollout's
:class:`Subscriber` applies them in order, catching up by deltas or anchors.

>>> import tempfile, jax.numpy as jnp, jsparse
>>> from jsparse import engine
>>> plan = jsparse.make_plan({'w': jnp.zeros(8)}, rollout_dtype=jnp.bfloat16)
>>> feed = engine.DirectoryFeed(tempfile.mkdtemp())
>>> publisher = engine.Publisher(jsparse.Sender(plan, {'w': jnp.zeros(8)}), feed)
>>> rollout = engine.Subscriber(jsparse.Receiver(plan, {'w': jnp.zeros(8, jnp.bfloat16)}), feed)
>>> _ = publisher.publish({'w': jnp.ones(8)})
>>> rollout.poll(), float(rollout.params['w'][0])
([1], 1.0)
"""

from typing import Any

from jsparse._src.engine.feed import DirectoryFeed, Entry, Feed
from jsparse._src.engine.publisher import Publisher
from jsparse._src.engine.signing import Ed25519Key, HmacKey
from jsparse._src.engine.fleet import RolloutInfo
from jsparse._src.engine.subscriber import Subscriber, SubscriberStats, Weights
from jsparse._src.errors import FencedError, PartsLostError, StalenessError

_LAZY = {"RayFeed": "ray_feed",  # Ray and obstore are imported on first use only
         "ObjectStoreFeed": "object_feed"}


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(f"jsparse._src.engine.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'jsparse.engine' has no attribute {name!r}")


__all__ = ["DirectoryFeed", "Ed25519Key", "Entry", "FencedError", "Feed",  # noqa: F822
           "HmacKey", "ObjectStoreFeed", "PartsLostError", "Publisher", "RayFeed", "RolloutInfo",
           "StalenessError", "Subscriber", "SubscriberStats", "Weights"]
