"""One process of a 2-process trainer publishing into a DirectoryFeed while its feed fails:
process 1's put of version 2's delta fails (a full disk on that host), and process 0's taking
of an anchor request at version 3 fails. Each process catches what ``publish`` raises and goes
on; it prints one JSON line per publish, then follows the feed as a rollout of the same two
processes and prints whether it ended at the last version, bit-exact.

Usage: python -m tests.multihost.publisher_faults PROCESS PORT FEED_DIR
"""

import errno
import json
import os
import sys

from jsparse.testing import host_device_flags

if __name__ == "__main__":  # a job's process (importing this module changes nothing)
  os.environ["XLA_FLAGS"] = host_device_flags(2)
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jsparse  # noqa: E402
from jsparse.engine import DirectoryFeed, Publisher, Subscriber  # noqa: E402

SIZE, VERSIONS = 4096, 5


def params(version: int, sharding) -> dict:
  """Version ``version``'s params: every element ``version / 8`` (exact in bfloat16)."""
  full = np.full(SIZE, version / 8, np.float32)
  return {"w": jax.make_array_from_callback((SIZE,), sharding, lambda index: full[index])}


class _FaultyFeed:
  def __init__(self, feed, process):
    self.feed, self.process, self.version = feed, process, 0

  def __getattr__(self, name):
    return getattr(self.feed, name)

  def put(self, entry, part, data):
    if self.process == 1 and (entry.version, entry.kind) == (2, "delta"):
      raise OSError(errno.ENOSPC, "No space left on device (injected)")
    self.feed.put(entry, part, data)

  def take_anchor_request(self):
    if self.process == 0 and self.version == 3:
      raise OSError(errno.EIO, "Input/output error (injected)")
    return self.feed.take_anchor_request()


def main(process: int, port: str, root: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process)
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
  plan = jsparse.make_plan(params(0, sharding), rollout_dtype=jnp.bfloat16)
  feed = _FaultyFeed(DirectoryFeed(root), process)
  publisher = Publisher(jsparse.Sender(plan, params(0, sharding)), feed, anchor_every=None)
  rollout = Subscriber(jsparse.Receiver(plan, plan.cast(params(0, sharding))),
                       DirectoryFeed(root))
  for version in range(1, VERSIONS + 1):
    feed.version = version
    try:
      written = [[e.version, e.kind] for e in publisher.publish(params(version, sharding))]
      print(json.dumps({"version": version, "written": written}), flush=True)
    except Exception as e:  # noqa: BLE001 - what a trainer loop would log and go past
      print(json.dumps({"version": version, "raised": type(e).__name__}), flush=True)
  rollout.poll()  # the same 2 processes as a rollout job: it follows the feed to the end
  exact = all((np.asarray(shard.data) == np.float32(VERSIONS / 8)).all()
              for shard in rollout.params["w"].addressable_shards)
  print(json.dumps({"rollout_version": rollout.version, "exact": bool(exact),
                    "pending": len(feed.pending())}), flush=True)
  fleet = [[r.rollout, r.version, r.digest_ok, r.lag_versions] for r in publisher.fleet()]
  print(json.dumps({"fleet": fleet, "rollout_id": rollout.rollout_id}), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
