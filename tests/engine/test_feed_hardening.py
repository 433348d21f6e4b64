"""DirectoryFeed against a hostile or broken directory: nothing it finds can hang, crash or turn
it against its host (FIFOs, directories, links, truncation), publishes are durable, and what a
failed publish leaves can be found and removed."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import jsparse

from jsparse._src.engine import feed as feed_lib
from jsparse.engine import DirectoryFeed, Entry, PartsLostError

ENTRY = Entry(1, "delta", 0, 2)


@pytest.fixture
def feed(tmp_path):
  return DirectoryFeed(tmp_path / "feed")


@pytest.fixture
def outside(tmp_path):
  """A file outside the feed, that nothing the feed does may change."""
  path = tmp_path / "precious.txt"
  path.write_bytes(b"precious")
  return path


def _committed(feed, entry=ENTRY):
  for part in range(entry.parts):
    feed.put(entry, part, f"part {part} of {entry.version}".encode())
  feed.commit(entry, b"a commit record")
  return entry


def _part_path(feed, entry=ENTRY, part=0):
  return feed._dir(entry) / f"part-{part:05d}.bin"


def test_parts_read_only_the_bytes_asked_for_like_bytes(feed):
  entry = Entry(3, "anchor", 2, 1)
  feed.put(entry, 0, b"0123456789")
  (part,) = feed.parts(entry)
  data = b"0123456789"
  for index in (slice(2, 5), slice(-3, None), slice(8, 20), slice(20, 30), slice(5, 2),
                slice(None)):
    assert part[index] == data[index], index
  assert (len(part), part[3], part[-1], bytes(part)) == (10, data[3], data[-1], data)
  with pytest.raises(IndexError):
    part[10]
  part.close()
  with pytest.raises(ValueError, match="closed"):
    part[0:1]


def test_a_fifo_in_a_parts_place_is_lost_not_a_hang(feed):
  _committed(feed)
  fifo = _part_path(feed)
  fifo.unlink()
  os.mkfifo(fifo)
  outcome = []

  def read():
    try:
      feed.parts(ENTRY)
      outcome.append(None)
    except Exception as e:  # noqa: BLE001 (checked below)
      outcome.append(e)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  reader.join(10)
  if reader.is_alive():  # the old feed blocks in open(): let it go, then fail
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    reader.join(10)
    pytest.fail("parts() blocked on a FIFO")
  (error,) = outcome
  assert isinstance(error, PartsLostError) and "FIFO" in str(error) and str(fifo) in str(error)


@pytest.mark.parametrize("found, planted", [
    ("a directory", lambda path, outside: path.mkdir()),
    ("a symbolic link", lambda path, outside: path.symlink_to(outside)),
    ("a symbolic link", lambda path, outside: path.symlink_to(path.parent / "part-00001.bin")),
])
def test_anything_but_a_regular_file_in_a_parts_place_is_lost(feed, outside, found, planted):
  _committed(feed)
  path = _part_path(feed)
  path.unlink()
  planted(path, outside)
  with pytest.raises(PartsLostError, match=found) as caught:
    feed.parts(ENTRY)
  assert str(path) in str(caught.value)


def test_a_missing_part_or_entry_is_lost(feed):
  _committed(feed)
  _part_path(feed, part=1).unlink()
  with pytest.raises(PartsLostError, match="part 1 is gone"):
    feed.parts(ENTRY)
  feed.remove(ENTRY)
  with pytest.raises(PartsLostError, match="no longer in the feed"):
    feed.parts(ENTRY)


_TRUNCATE = textwrap.dedent("""
    import os, sys
    from jsparse.engine import DirectoryFeed, Entry, PartsLostError
    feed = DirectoryFeed(sys.argv[1])
    entry = Entry(1, "anchor", 0, 1)
    feed.put(entry, 0, bytes(1 << 20))
    (part,) = feed.parts(entry)
    n = len(part)
    os.truncate(feed._dir(entry) / "part-00000.bin", 0)  # a writer truncates it in place
    try:
      for start in range(0, n, 4096):
        bytes(part[start:start + 4096])
    except PartsLostError as e:
      print("lost:", e)
""")


def test_a_part_truncated_while_read_is_lost_not_a_crash(tmp_path):
  done = subprocess.run([sys.executable, "-c", _TRUNCATE, str(tmp_path / "feed")],
                        capture_output=True, text=True, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # SIGBUS: -7
  assert done.stdout.startswith("lost:") and "truncated" in done.stdout, done.stdout


def test_a_part_truncated_after_it_was_opened_is_lost(feed):
  _committed(feed)
  parts = feed.parts(ENTRY)
  os.truncate(_part_path(feed), 3)
  with pytest.raises(PartsLostError, match="truncated"):
    parts[0][0:len(parts[0])]
  assert parts[1][:] == b"part 1 of 1"


def test_a_planted_temporary_part_link_does_not_write_outside(feed, outside):
  where = feed._dir(ENTRY)
  where.mkdir(parents=True)
  (where / f".part-00000.bin.{os.getpid()}.tmp").symlink_to(outside)
  _committed(feed)
  assert outside.read_bytes() == b"precious"
  assert [bytes(p) for p in feed.parts(ENTRY)] == [b"part 0 of 1", b"part 1 of 1"]
  assert sorted(p.name for p in where.iterdir()) == ["COMMITTED", "part-00000.bin",
                                                     "part-00001.bin"]


def test_a_planted_anchor_request_link_does_not_truncate_outside(feed, outside):
  (feed.root / f".ANCHOR_REQUESTED.{os.getpid()}.tmp").symlink_to(outside)
  feed.request_anchor()
  feed.request_anchor()  # already requested
  assert outside.read_bytes() == b"precious"
  assert feed.take_anchor_request() and not feed.take_anchor_request()


def test_an_anchor_request_link_is_taken_without_touching_its_target(feed, outside):
  (feed.root / "ANCHOR_REQUESTED").symlink_to(outside)
  feed.request_anchor()
  assert feed.take_anchor_request() and outside.read_bytes() == b"precious"


def test_a_directory_as_anchor_request_is_named(feed):
  (feed.root / "ANCHOR_REQUESTED").mkdir()
  with pytest.raises(PartsLostError, match="a directory"):
    feed.take_anchor_request()
  with pytest.raises(PartsLostError, match="a directory"):
    feed.request_anchor()


def test_an_entry_linked_outside_is_not_written_listed_or_deleted(feed, tmp_path):
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "COMMITTED").write_bytes(b"not the feed's")
  (elsewhere / "part-00000.bin").write_bytes(b"not the feed's")
  feed._dir(ENTRY).symlink_to(elsewhere, target_is_directory=True)
  with pytest.raises(PartsLostError, match="symbolic link"):
    feed.put(ENTRY, 1, b"data")
  assert sorted(p.name for p in elsewhere.iterdir()) == ["COMMITTED", "part-00000.bin"]
  assert feed.entries() == [] and feed.pending() == []
  with pytest.raises(PartsLostError, match="symbolic link"):
    feed.parts(ENTRY)
  feed.remove(ENTRY)  # the link itself goes
  assert not os.path.lexists(feed._dir(ENTRY))
  assert (elsewhere / "COMMITTED").read_bytes() == b"not the feed's"
  assert (elsewhere / "part-00000.bin").read_bytes() == b"not the feed's"


def test_removing_an_entry_does_not_follow_links_inside_it(feed, tmp_path):
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "COMMITTED").write_bytes(b"keep")
  _committed(feed)
  (feed._dir(ENTRY) / "inner").symlink_to(elsewhere, target_is_directory=True)
  feed.remove(ENTRY)
  assert not os.path.lexists(feed._dir(ENTRY))
  assert (elsewhere / "COMMITTED").read_bytes() == b"keep"


@pytest.mark.parametrize("planted", [
    lambda path, outside: path.mkdir(),
    lambda path, outside: path.symlink_to(outside),
])
def test_a_marker_that_is_not_a_regular_file_does_not_commit(feed, outside, planted):
  feed.put(ENTRY, 0, b"part 0")
  planted(feed._dir(ENTRY) / "COMMITTED", outside)
  assert feed.entries() == [] and feed.pending() == [ENTRY]
  feed.put(ENTRY, 1, b"part 1")
  assert feed.commit(ENTRY, b"a commit record") == b""  # not a commit in its place
  with pytest.raises(PartsLostError, match="expected a regular file"):
    feed.read_commit(ENTRY)
  assert feed.entries() == [] and outside.read_bytes() == b"precious"
  feed.remove_commit(ENTRY)  # the link or directory itself, never what it points to
  assert feed.commit(ENTRY, b"a commit record") == b"a commit record"
  assert feed.entries() == [ENTRY] and outside.read_bytes() == b"precious"


def test_a_directory_in_a_parts_place_stops_its_put(feed):
  _part_path(feed).parent.mkdir(parents=True)
  _part_path(feed).mkdir()
  with pytest.raises(PartsLostError, match="a directory"):
    feed.put(ENTRY, 0, b"data")
  assert [p.name for p in feed._dir(ENTRY).iterdir()] == ["part-00000.bin"]  # no temp left


def test_a_stale_temporary_part_is_replaced(feed):
  where = feed._dir(ENTRY)
  where.mkdir(parents=True)
  (where / f".part-00000.bin.{os.getpid()}.tmp").write_bytes(b"a dead writer's")
  _committed(feed)
  assert bytes(feed.parts(ENTRY)[0]) == b"part 0 of 1"
  assert not list(where.glob(".*"))


def test_a_failed_write_leaves_no_temporary_file(feed, monkeypatch):
  def failing_write(fd, data):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(feed_lib.os, "write", failing_write)
  with pytest.raises(OSError, match="No space"):
    feed.put(ENTRY, 0, b"data")
  monkeypatch.undo()
  assert list(feed._dir(ENTRY).iterdir()) == []
  assert feed.pending() == [ENTRY]


def test_a_commit_is_synced_parts_then_directory_then_marker(feed, monkeypatch):
  synced = []
  real_fsync = os.fsync

  def fsync(fd):
    path = os.readlink(f"/proc/self/fd/{fd}")
    synced.append((os.path.basename(path), os.path.exists(os.path.join(path, "COMMITTED"))))
    real_fsync(fd)

  monkeypatch.setattr(feed_lib.os, "fsync", fsync)
  _committed(feed)
  name = feed._dir(ENTRY).name
  pid = os.getpid()
  marker_tmp = synced[3][0]
  assert marker_tmp.startswith(".COMMITTED.") and marker_tmp.endswith(".tmp")
  assert synced == [(f".part-00000.bin.{pid}.tmp", False), (f".part-00001.bin.{pid}.tmp", False),
                    (name, False), (marker_tmp, False), (name, True)]


def test_pending_entries_are_listed_and_removed_with_their_temporary_files(feed):
  done, failed = Entry(2, "delta", 1, 1), Entry(3, "delta", 2, 2)
  feed.put(done, 0, b"whole")
  feed.commit(done, b"a commit record")
  feed.put(failed, 0, b"half")
  (feed._dir(failed) / ".part-00001.bin.12345.tmp").write_bytes(b"a dead writer's")
  begun = Entry(4, "delta", 3, 1)
  (feed.root / begun.name).mkdir()
  assert feed.entries() == [done] and feed.pending() == [failed, begun]
  for entry in feed.pending():
    feed.remove(entry)
  assert feed.entries() == [done] and feed.pending() == []
  assert sorted(p.name for p in feed.root.iterdir()) == [feed._dir(done).name]
  feed.remove(failed)  # already gone: nothing to do


def test_many_polls_leak_no_file_descriptors(feed):
  _committed(feed)

  def poll():
    for entry in feed.entries():
      for part in feed.parts(entry):
        assert part[0:4] == b"part"
    with pytest.raises(PartsLostError):
      feed.parts(Entry(9, "delta", 8, 1))

  poll()
  before = len(os.listdir("/proc/self/fd"))
  for _ in range(300):
    poll()
  assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_statuses_follow_no_link_and_skip_what_is_not_a_status(feed, outside):
  feed.put_status("r1", b"first")
  status = feed.root / "status"
  (status / "r2").symlink_to(outside)  # planted: never read, and replaced, not written through
  (status / "big").write_bytes(b"x" * 5000)
  (status / "-bad-name").write_bytes(b"x")
  assert feed.statuses() == {"r1": b"first"}
  feed.put_status("r2", b"second")
  assert outside.read_bytes() == b"precious" and not (status / "r2").is_symlink()
  assert feed.statuses() == {"r1": b"first", "r2": b"second"}
  with pytest.raises(jsparse.ConfigError, match="bad id"):
    feed.put_status("../escape", b"x")
  feed.remove_status("r1")
  assert feed.statuses() == {"r2": b"second"}


def test_a_linked_status_directory_is_not_followed(tmp_path, outside):
  feed = DirectoryFeed(tmp_path / "feed")
  (feed.root / "status").symlink_to(outside.parent)
  with pytest.raises(PartsLostError, match="expected the status directory"):
    feed.put_status("r1", b"x")
  assert sorted(p.name for p in outside.parent.iterdir()) == ["feed", "precious.txt"]
