"""Trainer and rollouts as separate jobs: a :class:`Publisher` puts every version's parts into a
feed (a shared directory, :class:`DirectoryFeed`, or Ray's object store, :class:`RayFeed`),
and each rollout's :class:`Subscriber` applies them in order, catching up by deltas or anchors.

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

from jsparse._src.engine.feed import DirectoryFeed, Entry, Feed, PartsLostError
from jsparse._src.engine.publisher import Publisher
from jsparse._src.engine.subscriber import Subscriber, SubscriberStats

_LAZY = {"RayFeed"}  # Ray is imported on first use only


def __getattr__(name: str) -> Any:
  if name in _LAZY:
    from jsparse._src.engine import ray_feed
    return getattr(ray_feed, name)
  raise AttributeError(f"module 'jsparse.engine' has no attribute {name!r}")


__all__ = ["DirectoryFeed", "Entry", "Feed", "PartsLostError", "Publisher", "RayFeed",  # noqa: F822
           "Subscriber", "SubscriberStats"]
