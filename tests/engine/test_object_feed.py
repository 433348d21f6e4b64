"""Publisher -> ObjectStoreFeed -> Subscribers against a real S3 server (moto's server mode on
127.0.0.1, started once for the module, reached through obstore's S3 client): versions exact
over several publishes, a lagging rollout, the commit protocol (last writer commits, a second
publisher refused, never a mixed version), graceful retention, and faults: the server restarted
mid-publish, a part object deleted, an object's bytes replaced, a forged commit object, a
throttled endpoint and one that never answers (a small reverse proxy in front of the server).
The trainer keeps publishing through every fault and every rollout ends bit-exact. Also the
basic case on ``memory://`` and ``file://``, and two engine fuzz cases on the S3 feed."""

import http.client
import logging
import socket
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax.numpy as jnp
import numpy as np
import obstore
import pytest
from moto.server import ThreadedMotoServer

import jsparse
from jsparse._src.engine.ledger import Ledger
from jsparse._src.engine.records import commit_record, part_meta, read_commit
from jsparse.engine import Entry, ObjectStoreFeed, PartsLostError, Publisher, Subscriber
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.engine.test_fencing import KEY_PAIRS, check_signed_versions, check_twin_publishers

_BUCKET = "jsparse-feeds"
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _S3:
  """A moto S3 server on 127.0.0.1 that can be stopped and started again on its port (its
  objects live in this process, so they survive a restart, as a real store's do)."""

  def __init__(self):
    self.port, self.server = _free_port(), None
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.start()
    request = urllib.request.Request(f"{self.endpoint}/{_BUCKET}", method="PUT")
    urllib.request.urlopen(request, timeout=10).close()

  def start(self) -> None:
    self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
    self.server.start()

  def stop(self) -> None:
    self.server.stop()

  def options(self, endpoint: str | None = None) -> dict:
    """Client options for this server: fake credentials, plain HTTP, tight bounds."""
    return dict(endpoint=endpoint or self.endpoint, access_key_id="testing",
                secret_access_key="testing", region="us-east-1",
                client_options={"allow_http": True})

  def feed(self, prefix: str, endpoint: str | None = None, **options) -> ObjectStoreFeed:
    bounds = {"timeout": 5.0, "retries": 2, "retry_seconds": 5.0, **options}
    return ObjectStoreFeed(f"s3://{_BUCKET}/{prefix}", **self.options(endpoint), **bounds)

  def store(self, prefix: str):
    """A raw client on the feed's prefix: what an operator (or an attacker) would use."""
    options = self.options()
    return obstore.store.from_url(f"s3://{_BUCKET}/{prefix}",
                                  client_options=options.pop("client_options"), **options)


@pytest.fixture(scope="module")
def s3():
  logging.getLogger("werkzeug").setLevel(logging.ERROR)
  server = _S3()
  try:
    yield server
  finally:
    server.stop()


@pytest.fixture
def prefix():
  return f"run-{uuid.uuid4().hex[:12]}"


class _Proxy:
  """A reverse proxy in front of the S3 server that can answer ``503 SlowDown`` to the next
  ``throttle`` requests, or hold the requests that ``stall`` selects without ever answering
  (until :meth:`close`)."""

  def __init__(self, port: int):
    self.throttle, self.throttled, self.stalled = 0, 0, 0
    self.stall = None
    self.released = threading.Event()
    proxy = self

    class Handler(BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):
        pass

      def _any(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if proxy.stall is not None and proxy.stall(self.command, self.path):
          proxy.stalled += 1
          proxy.released.wait(60)  # accepted, never answered
          self.close_connection = True
          return
        if proxy.throttle > 0:
          proxy.throttle -= 1
          proxy.throttled += 1
          slow = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
          self.send_response(503)
          self.send_header("Content-Type", "application/xml")
          self.send_header("Content-Length", str(len(slow)))
          self.end_headers()
          self.wfile.write(slow)
          return
        upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
          upstream.request(self.command, self.path, body=body, headers={
              k: v for k, v in self.headers.items() if k.lower() not in _HOP})
          response = upstream.getresponse()
          data = response.read()
        finally:
          upstream.close()
        self.send_response(response.status, response.reason)
        for k, v in response.getheaders():
          if k.lower() not in _HOP:
            self.send_header(k, v)
        self.send_header("Content-Length", response.getheader("Content-Length", "0")
                         if self.command == "HEAD" else str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
          self.wfile.write(data)

      do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self) -> None:
    self.released.set()
    self.server.shutdown()
    self.server.server_close()


@pytest.fixture
def proxy(s3):
  front = _Proxy(s3.port)
  try:
    yield front
  finally:
    front.close()


@pytest.fixture(scope="module")
def plan():
  """The engine fuzz's plan (its programs compile once for the module)."""
  from tests.engine.test_engine_fuzz import fuzz_plan
  return fuzz_plan()


@pytest.fixture(scope="module")
def states():
  from tests.engine.test_engine_fuzz import _tree
  rng = np.random.default_rng(3)
  states = [_tree(np.random.default_rng(0))]
  for _ in range(10):
    states.append({k: strategies.nudge_leaf(rng, v, 0.05) for k, v in states[-1].items()})
  return [{k: jnp.asarray(v) for k, v in s.items()} for s in states]


def _rollout(plan, states, feed, **kwargs) -> Subscriber:
  return Subscriber(jsparse.Receiver(plan, plan.cast(states[0])), feed, **kwargs)


def _exact(plan, state, *subscribers) -> None:
  for sub in subscribers:
    assert sub.stats.stalled is None
    assert_trees_bitwise_equal(sub.params, plan.cast(state))


def _keys(store, under: str) -> list[str]:
  return sorted(m["path"] for chunk in obstore.list(store, under) for m in chunk)


def test_rollouts_stay_exact_over_several_versions_on_s3(s3, prefix, plan, states):
  """Each side has its own client (as in two datacenters); versions of several parts."""
  publisher = Publisher(jsparse.Sender(plan, states[0]), s3.feed(prefix), anchor_every=None,
                        chunk_bytes=400)
  one, two = (_rollout(plan, states, s3.feed(prefix)) for _ in range(2))
  for step in range(1, 6):
    (entry,) = publisher.publish(states[step])
    assert entry.parts >= 2
    assert one.poll() == [step] and two.poll() == [step]
    _exact(plan, states[step], one, two)
  assert one.stats.anchors == two.stats.anchors == 0
  store = s3.store(prefix)
  assert len(_keys(store, "commits")) == 5  # one commit object per version, nothing pending
  assert not s3.feed(prefix).pending()


def test_a_lagging_rollout_catches_up_by_an_anchor(s3, prefix, plan, states):
  publisher = Publisher(jsparse.Sender(plan, states[0]), s3.feed(prefix, grace_seconds=0),
                        anchor_every=3, keep=1)
  steady, lagging = (_rollout(plan, states, s3.feed(prefix)) for _ in range(2))
  for step in range(1, 8):
    publisher.publish(states[step])
    steady.poll()
  assert lagging.poll() == [6, 7]  # the deltas it needed are gone: the anchor, then a delta
  assert lagging.stats.anchors == 1 and steady.stats.anchors == 0
  _exact(plan, states[7], steady, lagging)
  kept = {k.split("/")[1] for k in _keys(s3.store(prefix), "parts")}
  assert kept == {e.name for e in s3.feed(prefix).entries()}  # no grace


def test_parts_of_many_writers_are_committed_once_and_never_half_visible(s3, prefix):
  """Four trainer processes (one client each) put their parts concurrently; nothing is visible
  until the commit; two writers committing the same record race harmlessly (one object)."""
  entry = Entry(1, "anchor", 0, 4, generation=1, run="ab" * 16)
  data = [bytes([k]) * (1000 + k) for k in range(4)]
  writers = [s3.feed(prefix) for _ in range(4)]
  writers[0].put(entry, 2, data[2])
  with pytest.raises(PartsLostError, match="part 0 .* is not there"):
    writers[0].commit(entry, b"early")
  threads = [threading.Thread(target=writers[k].put, args=(entry, k, data[k])) for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert writers[1].entries() == [] and writers[1].pending() == [entry]
  record = commit_record(entry, [part_meta(d) for d in data], key=None)
  held = []
  threads = [threading.Thread(target=lambda w: held.append(w.commit(entry, record)), args=(w,))
             for w in writers[:2]]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert held == [record, record]
  reader = s3.feed(prefix)
  assert reader.entries() == [entry] and reader.pending() == []
  assert [bytes(p) for p in reader.parts(entry, read_commit(record, entry, None).parts)] == data
  assert _keys(s3.store(prefix), "commits") == [f"commits/{entry.name}"]


def test_a_second_publisher_is_refused_and_never_mixed_in(s3, prefix, plan, states):
  first = Publisher(jsparse.Sender(plan, states[0]), s3.feed(prefix))
  first.publish(states[1])
  with pytest.raises(jsparse.ConfigError, match="belongs to run"):
    Publisher(jsparse.Sender(plan, states[0]), s3.feed(prefix))

  # Below the publisher: a second commit of one entry with another record is refused.
  raw = s3.feed(f"{prefix}-raw")
  entry = Entry(1, "delta", 0, 1, generation=1, run="ab" * 16)
  raw.put(entry, 0, b"a0")
  Ledger(raw, None).commit(entry, [part_meta(b"a0")])
  raw.put(entry, 0, b"b0")
  with pytest.raises(jsparse.ConfigError, match="committed before with other parts"):
    Ledger(s3.feed(f"{prefix}-raw"), None).commit(entry, [part_meta(b"b0")])


def test_a_removed_version_stays_readable_for_its_grace_period(s3, prefix):
  """Retention deletes the commit at once (no new reader starts) and the parts only after
  ``grace_seconds``: a reader already in the version finishes it."""
  entry = Entry(1, "delta", 0, 2)
  trainer = s3.feed(prefix, grace_seconds=30)
  trainer.put(entry, 0, b"first")
  trainer.put(entry, 1, b"second")
  trainer.commit(entry, b"a commit record")
  metas = [part_meta(b"first"), part_meta(b"second")]
  reader, lock = s3.feed(prefix), threading.Lock()
  read_part, removed = reader._part, []

  def slow_read(*args):  # the version is removed while this reader is in it
    with lock:
      if not removed:
        removed.append(trainer.remove(entry))
    return read_part(*args)

  reader._part = slow_read
  assert [bytes(p) for p in reader.parts(entry, metas)] == [b"first", b"second"]
  assert reader.entries() == [] and reader.pending() == []
  with pytest.raises(PartsLostError, match="no longer in the feed"):
    s3.feed(prefix).read_commit(entry)  # a new reader does not start
  store = s3.store(prefix)
  assert len(_keys(store, "parts")) == 2 and len(_keys(store, "removed")) == 1
  assert trainer.collect() == 0
  assert trainer.collect(now=time.time() + 30) == 1
  assert _keys(store, "parts") == _keys(store, "removed") == []


class _StopsServer:
  """The trainer's feed: stops the S3 server once ``after`` more parts went in."""

  def __init__(self, feed, s3):
    self.feed, self.s3, self.after = feed, s3, None

  def __getattr__(self, name):
    return getattr(self.feed, name)

  def put(self, entry, part, data):
    self.feed.put(entry, part, data)
    if self.after is not None:
      self.after -= 1
      if self.after == 0:
        self.s3.stop()


def test_the_server_restarted_mid_publish(s3, prefix, plan, states):
  """The server goes down between two parts of a version: the publish fails within its bound
  (a poll too), the version is never committed, and once the server is back the next publish
  is an anchor that every rollout takes."""
  trainer = _StopsServer(s3.feed(prefix, retries=2, retry_seconds=2.0, timeout=1.0), s3)
  publisher = Publisher(jsparse.Sender(plan, states[0]), trainer, anchor_every=None,
                        chunk_bytes=400)
  rollouts = [_rollout(plan, states, s3.feed(prefix, retries=1, retry_seconds=1.0,
                                             timeout=1.0)) for _ in range(2)]
  publisher.publish(states[1])
  trainer.after = 1
  start = time.monotonic()
  try:
    with pytest.raises(PartsLostError, match="failed"):
      publisher.publish(states[2])
    failed = time.monotonic() - start
    assert rollouts[0].poll() == []  # a store it cannot reach: no error, no wait, said why
    assert "failed" in rollouts[0].stats.stalled
  finally:
    s3.start()
  assert failed < 8, failed
  assert [e.version for e in s3.feed(prefix).pending()] == [2]
  (entry,) = publisher.publish(states[3])
  assert (entry.kind, entry.version) == ("anchor", 3)
  for r in rollouts:
    r.poll()
  _exact(plan, states[3], *rollouts)
  assert not s3.feed(prefix).pending()  # the failed publish's parts were removed


def _damage_then_recover(s3, prefix, plan, states, damage):
  """Publishes versions 1 and 2, damages version 2 in the bucket (``damage(store, entry)``)
  before the rollout reads it: the rollout skips it and asks for an anchor, the next publish
  carries one, and the rollout ends exact. Returns the rollout."""
  publisher = Publisher(jsparse.Sender(plan, states[0]), s3.feed(prefix), anchor_every=None,
                        chunk_bytes=400)
  rollout = _rollout(plan, states, s3.feed(prefix))
  publisher.publish(states[1])
  assert rollout.poll() == [1]
  (entry,) = publisher.publish(states[2])
  damage(s3.store(prefix), entry)
  assert rollout.poll() == [] and rollout.version == 1
  assert rollout.stats.skipped == 1 and rollout.stats.anchor_requests == 1
  kinds = [e.kind for e in publisher.publish(states[3])]
  assert kinds == ["delta", "anchor"]  # the request was taken
  assert rollout.poll() == [3]
  _exact(plan, states[3], rollout)
  return rollout


def _read(feed, entry):
  """The parts of ``entry``, read as a subscriber does: as its verified commit gives them."""
  return feed.parts(entry, Ledger(feed, None).commit_of(entry).parts)


def _part_key(store, entry, k=0) -> str:
  return _keys(store, f"parts/{entry.name}")[k]


def test_a_deleted_part_object_is_replaced_by_an_anchor(s3, prefix, plan, states):
  def delete(store, entry):
    obstore.delete(store, _part_key(store, entry))
    with pytest.raises(PartsLostError, match="part 0 is gone"):
      _read(s3.feed(prefix), entry)
  _damage_then_recover(s3, prefix, plan, states, delete)


def test_replaced_bytes_are_refused(s3, prefix, plan, states):
  def replace(store, entry):
    key = _part_key(store, entry, 1)
    data = bytearray(bytes(obstore.get(store, key).bytes()))
    data[len(data) // 2] ^= 0x10  # same size, other bytes: only the checksum tells
    obstore.put(store, key, bytes(data))
    with pytest.raises(PartsLostError, match="not those committed"):
      _read(s3.feed(prefix), entry)
  _damage_then_recover(s3, prefix, plan, states, replace)


def test_a_forged_commit_object_is_refused(s3, prefix, plan, states):
  """A commit whose checksum of a part is not the part's: refused at the read, and the engine
  goes on by an anchor."""
  def forge(store, entry):
    key = f"commits/{entry.name}"
    commit = bytes(obstore.get(store, key).bytes())
    real = read_commit(commit, entry, None).parts[0].digest
    obstore.delete(store, key)
    obstore.put(store, key, commit.replace(real.encode(), b"0" * 32))
    with pytest.raises(PartsLostError, match="not those committed"):
      feed = s3.feed(prefix)
      feed.parts(entry, Ledger(feed, None).commit_of(entry).parts)
  _damage_then_recover(s3, prefix, plan, states, forge)


def test_a_commit_that_is_not_one_is_ignored_not_applied(s3, prefix, plan, states):
  publisher = Publisher(jsparse.Sender(plan, states[0]), s3.feed(prefix), anchor_every=None)
  rollout = _rollout(plan, states, s3.feed(prefix))
  (entry,) = publisher.publish(states[1])
  store = s3.store(prefix)
  obstore.delete(store, f"commits/{entry.name}")
  obstore.put(store, f"commits/{entry.name}", b'{"format": "something else"}')
  with pytest.raises(PartsLostError, match="not a commit of this entry"):
    Ledger(s3.feed(prefix), None).commit_of(entry)
  assert rollout.poll() == [] and rollout.version == 0


def test_a_throttled_endpoint_is_retried_with_backoff(s3, proxy, prefix, plan, states):
  """503 SlowDown answers are retried (with backoff) within the bound: nothing fails."""
  publisher = Publisher(jsparse.Sender(plan, states[0]),
                        s3.feed(prefix, endpoint=proxy.endpoint, retries=4), anchor_every=None)
  rollout = _rollout(plan, states, s3.feed(prefix, endpoint=proxy.endpoint, retries=4))
  for step in (1, 2):
    proxy.throttle = 3  # the next three requests, whichever they are
    publisher.publish(states[step])
    proxy.throttle = 3
    assert rollout.poll() == [step]
  assert proxy.throttled == 12
  _exact(plan, states[2], rollout)


def test_an_endpoint_that_never_answers_fails_within_its_bound(s3, proxy, prefix, plan,
                                                               states):
  """Reads of part objects are accepted and never answered: each read fails within its bound
  (timeout, one retry) as PartsLostError, the rollout asks for an anchor, and once the
  endpoint answers again it takes the anchor, exact."""
  publisher = Publisher(jsparse.Sender(plan, states[0]), s3.feed(prefix), anchor_every=None)
  bounded = s3.feed(prefix, endpoint=proxy.endpoint, timeout=0.5, retries=1,
                    retry_seconds=1.0)
  rollout = _rollout(plan, states, bounded)
  (entry,) = publisher.publish(states[1])
  proxy.stall = lambda method, path: method == "GET" and "/parts/" in path
  start = time.monotonic()
  with pytest.raises(PartsLostError, match="failed"):
    _read(bounded, entry)
  alone = time.monotonic() - start
  start = time.monotonic()
  assert rollout.poll() == []
  polled = time.monotonic() - start
  assert alone < 3 and polled < 6, (alone, polled)
  assert rollout.stats.skipped == 1 and rollout.stats.anchor_requests == 1
  proxy.stall = None
  assert [e.kind for e in publisher.publish(states[2])] == ["delta", "anchor"]
  assert rollout.poll() == [2]
  _exact(plan, states[2], rollout)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_rollouts_stay_exact_on_local_stores(scheme, plan, states, tmp_path):
  feed = ObjectStoreFeed("memory://" if scheme == "memory" else f"file://{tmp_path}/feed",
                         grace_seconds=0)
  publisher = Publisher(jsparse.Sender(plan, states[0]), feed, anchor_every=2, keep=0,
                        chunk_bytes=400)
  steady, lagging = _rollout(plan, states, feed), _rollout(plan, states, feed)
  for step in range(1, 6):
    publisher.publish(states[step])
    assert steady.poll() == [step]
  assert lagging.poll() == [4, 5]
  _exact(plan, states[5], steady, lagging)
  assert not feed.pending()


def damage_objects(store):
  """Damages one part object of a committed version in the bucket: deletes it, or
  overwrites it cut short or with a bit flipped (objects cannot be changed in place)."""
  def damage(rng, feed, rollouts, how: str) -> bool:
    committed = {k.rsplit("/", 1)[1] for k in _keys(store, "commits")}
    keys = [k for k in _keys(store, "parts") if k.split("/")[1] in committed]
    if not keys:
      return False
    key = keys[int(rng.integers(len(keys)))]
    if how == "lose_part":
      obstore.delete(store, key)
      return True
    data = bytearray(bytes(obstore.get(store, key).bytes()))
    if how == "truncate":
      del data[int(rng.integers(0, max(1, len(data)))):]
    elif data:
      data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    obstore.put(store, key, bytes(data))
    return True
  return damage


@pytest.mark.parametrize("seed", range(2))
def test_rollouts_over_s3_stay_exact_and_catch_up_once_faults_stop(s3, prefix, plan, seed):
  """The engine fuzz (``test_engine_fuzz.py``) on the S3 feed: failed puts, part objects
  deleted, cut short or flipped in the bucket, lost anchor requests, restarts of either
  side."""
  from tests.engine.test_engine_fuzz import run_case
  outcome = run_case(plan, 700 + seed, s3.feed(prefix, grace_seconds=0),
                     damage_objects(s3.store(prefix)))
  assert outcome["polls"] > 0



@pytest.mark.parametrize("keys", KEY_PAIRS, ids=["hmac", "ed25519"])
def test_signed_versions_on_s3_refuse_forged_and_unsigned_commits(s3, prefix, keys):
  check_signed_versions(lambda: s3.feed(prefix), *keys)


def test_a_trainer_restored_twice_on_s3_fences_its_zombie(s3, prefix):
  check_twin_publishers(lambda: s3.feed(prefix))


def test_a_trainer_and_two_rollout_processes_on_s3(s3, prefix, tmp_path, caplog):
  from tests.engine.fleet_scenario import check, feed_spec, run_scenario
  feed = s3.feed(prefix)
  check(run_scenario(feed, feed_spec(feed, tmp_path), tmp_path, caplog))
