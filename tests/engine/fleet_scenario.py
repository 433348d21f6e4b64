"""A trainer (this process) and two rollout processes (``fleet_rollout.py``) on one feed: the lag
bound held, retention following the slowest live rollout while it is paused, a killed rollout
reported gone and released, forged statuses ignored, a restarted rollout recognised by its id,
and every version applied exactly. Run on every feed kind (directory, S3, Ray)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsparse
from jsparse._src.engine.records import Status, status_record
from jsparse.engine import Publisher
from tests.engine.fleet_states import PLAN, STATES

TIMEOUT = 120


class _Rollouts:
  """The rollout processes of a scenario, always killed at the end."""

  def __init__(self, spec: str, work: Path):
    self.spec, self.work, self.procs = spec, work, {}
    self.stop = work / "STOP"

  def start(self, rollout_id: str, period: float, run: int = 0) -> None:
    out = self.work / f"{rollout_id}-{run}.jsonl"
    self.procs[(rollout_id, run)] = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.fleet_rollout", self.spec, rollout_id, str(out),
         str(self.stop), str(period)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=Path(__file__).parents[2])

  def signal(self, rollout_id: str, run: int, sig: int) -> None:
    os.kill(self.procs[(rollout_id, run)].pid, sig)

  def lines(self, rollout_id: str, run: int = 0) -> list[dict]:
    """The lines a rollout has written whole (the last may still be in its write)."""
    path = self.work / f"{rollout_id}-{run}.jsonl"
    return [json.loads(x) for x in path.read_text().split("\n")[:-1]] if path.exists() else []

  def logged(self, rollout_id: str, version: int, run: int = 0) -> bool:
    """Whether the rollout has logged ``version`` (it reports a version before it logs it)."""
    lines = self.lines(rollout_id, run)
    return bool(lines) and lines[-1]["version"] == version

  def finish(self) -> None:
    self.stop.touch()
    for proc in self.procs.values():
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        proc.kill()

  def kill_all(self) -> None:
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def _until(what: str, condition, timeout: float = TIMEOUT):
  deadline = time.monotonic() + timeout
  while True:
    value = condition()
    if value:
      return value
    if time.monotonic() > deadline:
      raise TimeoutError(f"waited {timeout} s for {what}")
    time.sleep(0.05)


def _rows(publisher: Publisher) -> dict:
  return {r.rollout: r for r in publisher.fleet()}


def feed_spec(feed, work: Path) -> str:
  """The argument a rollout process opens ``feed`` from (a pickle of it)."""
  path = work / "feed.pickle"
  path.write_bytes(pickle.dumps(feed))
  return str(path)


def run_scenario(feed, spec: str, work: Path, caplog) -> dict:
  """Runs the scenario (see the module docstring); returns what it saw, for the asserts."""
  seen: dict = {}
  publisher = Publisher(jsparse.Sender(PLAN, STATES[0]), feed, anchor_every=3, keep=1,
                        max_lag=1, lag_timeout=TIMEOUT, gone_seconds=TIMEOUT)
  rollouts = _Rollouts(spec, work)
  try:
    rollouts.start("fast", 0.02)
    rollouts.start("slow", 0.25)
    _until("both rollouts to report", lambda: len(_rows(publisher)) == 2)
    lags = []
    for version in range(1, 7):  # the lag bound: max_lag 1
      publisher.publish(STATES[version])
      lags.append(version - min(r.version for r in publisher.fleet() if r.live))
    seen["lags"] = lags

    _until("the slow rollout at 6", lambda: _rows(publisher)["slow"].version == 6
           and rollouts.logged("slow", 6))
    anchors_before = rollouts.lines("slow")[-1]["anchors"]
    rollouts.signal("slow", 0, signal.SIGSTOP)  # paused, not gone: retention waits for it
    publisher.max_lag = None
    for version in range(7, 13):
      publisher.publish(STATES[version])
    seen["deltas_while_paused"] = sorted(e.version for e in feed.entries()
                                         if e.kind == "delta" and e.run == publisher.run)
    rollouts.signal("slow", 0, signal.SIGCONT)
    _until("the slow rollout at 12", lambda: _rows(publisher)["slow"].version == 12
           and rollouts.logged("slow", 12))
    seen["slow_anchors_catching_up"] = rollouts.lines("slow")[-1]["anchors"] - anchors_before

    rollouts.signal("slow", 0, signal.SIGKILL)  # gone: it holds nothing back
    rollouts.procs[("slow", 0)].wait(timeout=30)
    publisher.gone_seconds = 1.0
    _until("the killed rollout gone", lambda: _rows(publisher)["slow"].gone)
    for version in range(13, 16):
      publisher.publish(STATES[version])
    seen["deltas_after_gone"] = sorted(e.version for e in feed.entries()
                                       if e.kind == "delta" and e.run == publisher.run)

    forged = Status("forged", 15, publisher.generation, "00" * 8, time.time(), None, None, 9)
    feed.put_status("forged", status_record("cd" * 16, forged, None))  # another run's
    feed.put_status("garbled", b"\xff" * 100)
    with caplog.at_level(logging.WARNING, "jsparse"):
      seen["rows_with_forged"] = sorted(_rows(publisher))
    seen["warned_statuses"] = sum("ignoring a status" in r.message for r in caplog.records)

    publisher.gone_seconds = TIMEOUT
    rollouts.start("slow", 0.05, run=1)  # restarted under its id, with empty state
    _until("the restarted rollout at 15", lambda: _rows(publisher)["slow"].version == 15)
    publisher.max_lag = 0
    publisher.publish(STATES[16])  # a synchronous step: both hold 15
    _until("both at 16", lambda: all(r.version == 16 for r in publisher.fleet()
                                     if r.rollout in ("fast", "slow")))
    rows = _rows(publisher)
    seen["final"] = {k: (rows[k].version, rows[k].digest_ok, rows[k].live)
                     for k in ("fast", "slow")}
    rollouts.finish()
    seen["exact"] = all(line["exact"] for key in rollouts.procs
                        for line in rollouts.lines(*key))
    seen["last"] = {f"{k}-{run}": rollouts.lines(k, run)[-1]["version"]
                    for k, run in rollouts.procs}
    seen["restarted_anchors"] = rollouts.lines("slow", 1)[-1]["anchors"]
    seen["stderr"] = {f"{k}-{run}": p.stderr.read().decode()[-2000:]
                      for (k, run), p in rollouts.procs.items() if p.returncode not in (0, -9)}
  finally:
    rollouts.kill_all()
  return seen


def check(seen: dict) -> None:
  """The scenario's outcome, as every feed kind must show it."""
  assert not seen["stderr"], seen["stderr"]
  assert max(seen["lags"]) <= 2, seen["lags"]  # max_lag 1: at most 1 behind the one before
  assert set(range(7, 13)) <= set(seen["deltas_while_paused"]), seen  # kept for the paused
  assert seen["slow_anchors_catching_up"] == 0  # it caught up by deltas
  assert all(v > 12 for v in seen["deltas_after_gone"]), seen  # released once it was gone
  assert seen["rows_with_forged"] == ["fast", "slow"] and seen["warned_statuses"] == 2
  assert seen["final"] == {"fast": (16, True, True), "slow": (16, True, True)}
  assert seen["exact"], seen
  assert seen["last"] == {"fast-0": 16, "slow-0": 12, "slow-1": 16}, seen["last"]
  assert seen["restarted_anchors"] == 1, seen["restarted_anchors"]
