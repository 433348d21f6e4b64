"""A rollout process following a feed (for the fleet tests): applies every version, checks each
against the trainer's states bit for bit, and writes a JSON line per poll that applied, until a
stop file appears.

  python -m tests.engine.fleet_rollout FEED_PICKLE ROLLOUT_ID OUT STOP PERIOD

``FEED_PICKLE``: a file holding the pickled feed (a DirectoryFeed or an ObjectStoreFeed), or
``ray:<gcs address>:<namespace>:<feed name>`` for a RayFeed.
"""

import json
import os
import pickle
import sys
import time


def open_feed(spec: str):
  if spec.startswith("ray:"):
    import ray
    from jsparse.engine import RayFeed
    _, host, port, namespace, name = spec.split(":")
    ray.init(address=f"{host}:{port}", namespace=namespace, log_to_driver=False)
    return RayFeed.connect(name, timeout=120)  # a bound on a hung call, on a loaded machine
  with open(spec, "rb") as f:
    return pickle.load(f)


def follow(feed, rollout_id: str, out: str, stop: str, period: float) -> None:
  import jsparse
  from jsparse.engine import Subscriber
  from jsparse.testing import bitwise_mismatches
  from tests.engine.fleet_states import PLAN, STATES
  subscriber = Subscriber(jsparse.Receiver(PLAN, PLAN.cast(STATES[0])), feed,
                          rollout_id=rollout_id, heartbeat_seconds=0.2, stall_seconds=1.0)
  with open(out, "a") as log:
    while not os.path.exists(stop):
      applied = subscriber.poll()
      if applied:
        version = subscriber.version
        exact = not bitwise_mismatches(subscriber.params, PLAN.cast(STATES[version]))
        log.write(json.dumps({"applied": applied, "version": version, "exact": exact,
                              "anchors": subscriber.stats.anchors,
                              "deltas": subscriber.stats.deltas, "pid": os.getpid()}) + "\n")
        log.flush()
      time.sleep(period)


if __name__ == "__main__":
  spec, rollout_id, out, stop, period = sys.argv[1:6]
  follow(open_feed(spec), rollout_id, out, stop, float(period))
