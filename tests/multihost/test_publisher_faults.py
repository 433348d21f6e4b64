"""A 2-process trainer (``jax.distributed``, gloo on 127.0.0.1) whose feed fails on one
process: every process leaves the failed publish alike (none waits in a collective the other
skipped), the next publish is an anchor, and a 2-process rollout following the feed ends
bit-exact."""

import json
import subprocess
import sys

from jsparse.examples.multihost import _free_port
from tests.multihost.publisher_faults import VERSIONS

TIMEOUT = 180


def test_a_feed_failing_on_one_trainer_process_never_hangs_the_job(tmp_path):
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "tests.multihost.publisher_faults", str(p),
                             str(port), str(tmp_path / "feed")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
           for p in (0, 1)]
  try:
    outputs = [proc.communicate(timeout=TIMEOUT)[0] for proc in procs]
  finally:
    for proc in procs:
      proc.kill()
  assert [proc.returncode for proc in procs] == [0, 0]
  lines = [[json.loads(line) for line in out.splitlines() if line.startswith("{")]
           for out in outputs]
  assert [len(x) for x in lines] == [VERSIONS + 2, VERSIONS + 2]
  # The trainer's fleet view, read on process 0, is the same on both: the 2-process rollout
  # (one id, process 0's) at the last version, its digest the trainer's.
  fleets = [process_lines.pop() for process_lines in lines]
  rollout_id = fleets[0]["rollout_id"]
  assert fleets[0] == fleets[1] == {"fleet": [[rollout_id, VERSIONS, True, 0]],
                                    "rollout_id": rollout_id}
  for process_lines in lines:  # both processes alike: version 2 raised, version 3 resyncs
    by_version = {x["version"]: x for x in process_lines[:-1]}
    assert by_version[2]["raised"] in ("OSError", "PartsLostError")
    assert by_version[3]["written"] == [[3, "anchor"]]
    assert all(by_version[v]["written"] == [[v, "delta"]] for v in (1, 4, 5))
    assert process_lines[-1] == {"rollout_version": VERSIONS, "exact": True, "pending": 0}
