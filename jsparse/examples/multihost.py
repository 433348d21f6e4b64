"""Multi-controller sync: a trainer job and rollout jobs of several processes each, on one machine.

Every process of a ``jax.distributed`` job runs the same program on its own devices. The trainer
job trains a Flax TinyLM (fp32 masters sharded FSDP over all its devices, AdamW at an RL learning
rate); after each step every trainer process publishes *its own part* of the update, computed
from the shards it holds, into an ``engine.DirectoryFeed`` in ``<dir>/feed``. A rollout job (any
number of processes, its own mesh) reads the parts through ``mmap``, so each rollout process
reads only the bytes of the units that overlap its own blocks, and applies them bit-exactly.
Version 1 also comes as a dense anchor, so rollouts can start from nothing.

  python -m jsparse.examples.multihost --dir /tmp/jsparse_multihost   # everything, locally

This launches a trainer of 2 processes x 4 CPU devices, then a rollout of 1 process (a 2x4
mesh) and one of 2 processes (tensor 4 x data 2), and prints what each process sent and read.
``launch`` below is what the tests use; ``trainer`` and ``rollout`` are the per-process programs
(run them under your cluster's launcher with the coordinator's address instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Sequence

STEP_DIR = "v{version}"  # the test fixtures of each version (the trainer's bits)
FEED = "feed"  # the parts, in an engine.DirectoryFeed


def _init(args: argparse.Namespace) -> None:
  """Joins the job: gloo collectives on CPU, the coordinator on 127.0.0.1."""
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id,
                             initialization_timeout=120)


def config(vocab: int = 512, dim: int = 128):
  """The model and schedule of the examples' jobs (small: they run in the tests)."""
  from jsparse.examples import rl_model
  return rl_model.Config(vocab=vocab, dim=dim, depth=2, batch=8, seq=32, pretrain_steps=5)


def trainer_specs(params):
  """FSDP: every matrix split by rows over the ``fsdp`` axis; vectors replicated."""
  import jax
  from jax.sharding import PartitionSpec as P
  return jax.tree.map(lambda x: P("fsdp", None) if x.ndim == 2 else P(), params)


def rollout_specs(params):
  """Megatron-style tensor parallelism: embedding rows and the MLP's down projection split by
  rows, its up projection and the head by columns, over ``tensor``; vectors replicated."""
  import jax
  from jax.sharding import PartitionSpec as P

  def spec(path, x):
    name = jax.tree_util.keystr(path)
    if x.ndim != 2 or name.endswith((".scale", ".zero_point")):  # vectors, quantization data
      return P()
    return P(None, "tensor") if ("up" in name or "head" in name) else P("tensor", None)
  return jax.tree.map_with_path(spec, params)


def sharded_train_step(graphdef, tx, shardings):
  """A jitted AdamW step of the TinyLM on params split as ``shardings``; the new params keep
  that layout (the plan's), so the sender reshards nothing before each diff."""
  import jax
  import optax
  from flax import nnx
  from jsparse.examples import rl_model

  @jax.jit
  def train_step(params, opt_state, tokens):
    grads = jax.grad(lambda p: rl_model.loss(nnx.merge(graphdef, p), tokens))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    new = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), shardings)
    return new, opt_state
  return train_step


def abstract_trainer_params(cfg, trainer_devices: int):
  """The trainer's params as shapes on an abstract copy of its mesh: what a rollout builds the
  plan from (no arrays, no trainer devices)."""
  import jax
  from flax import nnx
  from jax.sharding import AbstractMesh, AxisType, NamedSharding
  from jsparse.examples import rl_model
  shapes = nnx.state(nnx.eval_shape(lambda: rl_model.TinyLM(cfg.vocab, cfg.dim, cfg.depth,
                                                            rngs=nnx.Rngs(0))), nnx.Param)
  mesh = AbstractMesh((trainer_devices,), ("fsdp",), axis_types=(AxisType.Auto,))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=NamedSharding(mesh, s)),
                      shapes, trainer_specs(shapes))


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def _host_peak():
  """The peak of Python and numpy host allocations inside the block (tracemalloc)."""
  tracemalloc.start()
  out = {}
  try:
    yield out
  finally:
    out["peak"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()


def _held_bytes(tree) -> int:
  """Bytes of the distinct shards this process holds (replicas on several of its devices
  counted once)."""
  import jax
  total = 0
  for x in jax.tree.leaves(tree):
    seen = set()
    for shard in x.addressable_shards:
      key = tuple((s.start, s.stop) for s in shard.index)
      if key not in seen:
        seen.add(key)
        total += shard.data.nbytes
    del seen
  return total


def trainer(args: argparse.Namespace) -> dict:
  """One trainer process: trains, and writes its part of every version."""
  _init(args)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  import jsparse
  from jsparse import engine
  from jsparse.examples import rl_model

  cfg = config(args.vocab, args.dim)
  mesh = jax.make_mesh((jax.device_count(),), ("fsdp",),
                       axis_types=(jax.sharding.AxisType.Auto,))  # XLA places the train step
  model = rl_model.pretrained_model(cfg)  # the same in every process (seeded, deterministic)
  graphdef, local_params = nnx.split(model, nnx.Param)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), trainer_specs(local_params))
  params = jax.tree.map(  # each process places only the blocks its devices hold
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: np.asarray(x[i])),
      local_params, shardings)
  tx = optax.adamw(cfg.rl_lr)
  opt_state = jax.jit(tx.init)(params)

  train_step = sharded_train_step(graphdef, tx, shardings)

  # --- jsparse: the same calls in every trainer process ---
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, quantize=_quantize(args))
  sender = jsparse.Sender(plan, params, coding=args.coding)
  out = Path(args.dir)
  publisher = engine.Publisher(sender, engine.DirectoryFeed(out / FEED), anchor_every=None,
                               keep=1000,  # keep every version: the tests replay them
                               chunk_bytes=args.chunk_bytes)  # streamed in parts of this size
  batches = rl_model.markov_batches(cfg, seed=1)  # the same batches in every process
  chain = jsparse.DeltaCheckpointManager(out / "chain", plan) if args.chain else None
  report = {"process": jax.process_index(), "versions": [], "coding": sender.coding.value}
  for version in range(1, args.steps + 2):
    if version > 1:
      params, opt_state = train_step(params, opt_state, np.asarray(next(batches)))
    with _host_peak() as host:  # this process's part; version 1 also as an anchor
      bytes_before = publisher.bytes_put
      publisher.publish(params, with_anchor=version == 1)  # sender.send_stream(params) inside
    # --- end of the jsparse calls; the rest is reporting and test fixtures ---
    stats = sender.last_stats
    if chain is not None:  # every process saves its part of each step
      report.setdefault("chain", []).append(chain.save(version, params)._asdict())
    report["versions"].append({"version": version, "part_bytes": stats.payload_bytes,
                               "anchor_bytes": publisher.bytes_put - bytes_before
                               - stats.payload_bytes,
                               "host_peak_bytes": host["peak"],
                               "changed": stats.changed, "elements": stats.elements,
                               "dense_bytes": stats.dense_bytes, "anchor": stats.anchor,
                               "coding": stats.coding, "coding_rates": stats.coding_rates})
    expected = multihost_utils.process_allgather(plan.cast(params), tiled=True)  # test only
    if args.quantize:  # test only: the codes and scales are qwix's on the whole masters
      report.setdefault("qwix_equal", []).append(_equals_qwix(
          plan, multihost_utils.process_allgather(params, tiled=True), expected))
    if jax.process_index() == 0:
      (out / STEP_DIR.format(version=version)).mkdir(parents=True, exist_ok=True)
      np.savez(out / STEP_DIR.format(version=version) / "expected.npz",
               **_bits_by_path(expected))
  if args.save_state:
    _save_state(out / "sender_state", sender.state())
  if args.restore_sender:
    restored = _restore_sender(plan, out / args.restore_sender, shardings)
    report["restored_sender"] = {"version": restored.version,
                                 "digest": restored.digest.hex()}
  report.update(peak_rss_mb=_peak_rss_mb(), held_bytes=_held_bytes(sender.snapshot),
                digest=sender.digest.hex(), fingerprint=plan.fingerprint.hex())
  return report


def _quantize(args: argparse.Namespace):
  """The ``quantize=`` rule of ``--quantize`` (a preset of jsparse.quantized), or None."""
  if not args.quantize:
    return None
  from jsparse import quantized
  return getattr(quantized, args.quantize)()


def _equals_qwix(plan, masters, synced) -> bool:
  """Whether ``synced`` (the tree the trainer syncs, gathered whole) holds qwix's codes, scales
  and zero points of ``masters`` (whole), quantized under jit with each leaf's spec (test
  fixture)."""
  import jax
  import numpy as np
  from qwix._src.core import qarray
  from jsparse import quantized
  from jsparse._src.core.bits import np_to_bits
  flat_masters = plan.view.treedef.flatten_up_to(masters)
  flat_synced = plan.view.treedef.flatten_up_to(quantized.unpack(synced))
  for spec, master, node in zip(plan.view.specs, flat_masters, flat_synced):
    if spec is None:
      continue
    want = jax.jit(lambda x, spec=spec: qarray.quantize(x, spec.how()))(np.asarray(master))
    pairs = [(node.qvalue, want.qvalue), (node.scale, want.scale.astype(spec.scale_dtype))]
    if want.zero_point is not None:
      pairs.append((node.zero_point, want.zero_point))
    for a, b in pairs:
      a, b = np.asarray(a), np.asarray(b)  # 4-bit codes: one a byte on the host
      if a.dtype != b.dtype or not np.array_equal(np_to_bits(a), np_to_bits(b)):
        return False
  return True


def _bits_by_path(tree) -> dict:
  import jax
  import numpy as np
  from jsparse._src.core.bits import np_to_bits
  return {jax.tree_util.keystr(p): np_to_bits(np.asarray(x))
          for p, x in jax.tree.flatten_with_path(tree)[0]}


def _save_state(path: Path, state) -> None:
  import orbax.checkpoint as ocp
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path.absolute(), state)
  checkpointer.wait_until_finished()


def _restore_state(plan, path: Path, shardings):
  import orbax.checkpoint as ocp
  import jsparse
  return ocp.StandardCheckpointer().restore(path.absolute(),
                                            jsparse.abstract_sync_state(plan, shardings))


def _restore_sender(plan, path: Path, shardings):
  import jsparse
  return jsparse.Sender.restore(plan, _restore_state(plan, path, shardings))


def rollout_mesh(tensor: int):
  """A (tensor, data) mesh over every device of the job."""
  import jax
  return jax.make_mesh((tensor, jax.device_count() // tensor), ("tensor", "data"))


def _parts(feed, version: int) -> list:
  """Every part of ``version`` (its anchor for version 1, else its delta), memory-mapped: only
  the bytes that are sliced get read."""
  (entry,) = [e for e in feed.entries() if e.version == version
              and e.kind == ("anchor" if version == 1 else "delta")]
  return list(feed.parts(entry))


def rollout(args: argparse.Namespace) -> dict:
  """One rollout process: applies every version's parts to its shards, and checks them."""
  _init(args)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  import jsparse
  from jsparse import engine

  out = Path(args.dir)
  plan = jsparse.make_plan(abstract_trainer_params(config(args.vocab, args.dim),
                                                   args.trainer_devices),
                           rollout_dtype=jnp.bfloat16, quantize=_quantize(args))
  mesh = rollout_mesh(args.tensor)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                           rollout_specs(plan.rollout_shapes()))
  if args.restore_from:
    receiver = jsparse.Receiver.restore(plan, _restore_state(plan, out / args.restore_from,
                                                             shardings))
  else:
    zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                         plan.rollout_shapes()), out_shardings=shardings)()
    receiver = jsparse.Receiver(plan, zeros)
  report = {"process": jax.process_index(), "versions": [], "refused": []}
  feed = engine.DirectoryFeed(out / FEED)
  if args.follow:  # a subscriber catches up from nothing: the anchor, then every delta
    subscriber = engine.Subscriber(receiver, feed, start_with_anchor=True)
    report["followed"] = subscriber.poll()
    report["stats"] = vars(subscriber.stats)
    _check_bits(subscriber.params, out / STEP_DIR.format(version=subscriber.version)
                / "expected.npz")
  for version in range(receiver.version + 1, args.steps + 2):
    parts = _parts(feed, version)
    if args.faults and version == 3:
      report["refused"] = _refusals(plan, receiver, parts, out)
    with _host_peak() as host:
      params = receiver.receive(parts)  # --- jsparse: one call per version ---
    _check_bits(params, out / STEP_DIR.format(version=version) / "expected.npz")
    report["versions"].append({"version": version, "host_peak_bytes": host["peak"],
                               **vars(receiver.last_read)})
    if version == args.save_at:
      _save_state(out / f"rollout_state_{args.name}", receiver.state())
  if args.chain:  # the trainer's delta checkpoint chain, restored onto this job's mesh
    with jsparse.DeltaCheckpointManager(out / "chain", plan) as chain:
      step = chain.latest_step()
      _check_bits(chain.restore(step, shardings=shardings),
                  out / STEP_DIR.format(version=step) / "expected.npz")
      report["chain_restored"] = {"step": step, "kinds": [chain.meta(s)["kind"]
                                                          for s in chain.chain(step)]}
  report.update(peak_rss_mb=_peak_rss_mb(), held_bytes=_held_bytes(receiver.params),
                digest=receiver.digest.hex(), version=receiver.version)
  return report


def _check_bits(params, expected_file: Path) -> None:
  """Every shard this process holds equals the trainer's bits (test fixture)."""
  import jax
  import numpy as np
  from jsparse._src.core.bits import np_to_bits
  expected = np.load(expected_file)
  for path, x in jax.tree.flatten_with_path(params)[0]:
    want = expected[jax.tree_util.keystr(path)]
    for shard in x.addressable_shards:
      if not np.array_equal(np_to_bits(np.asarray(shard.data)), want[shard.index]):
        raise AssertionError(f"{jax.tree_util.keystr(path)} differs at {shard.index}")


def _refusals(plan, receiver, parts: list, out: Path) -> list:
  """A missing part, and a part with one corrupt unit (one that, in a rollout job of several
  processes, only the last process reads), are refused by every process; nothing changes."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  from jsparse._src.core.units import needs_unit, process_boxes
  from jsparse._src.wire.parts import read_index
  import jsparse

  outcomes = []
  before = receiver.digest
  for name in ("missing", "corrupt"):
    if name == "missing":
      given = parts[:-1]
    else:  # a unit body that only the last process reads, else one it reads
      boxes = process_boxes(jax.tree.leaves(receiver.params))
      candidates = []  # (part, entry, read by the last process only)
      for j, part in enumerate(parts):  # the same collectives and choice in every process
        index = read_index(plan, part)
        needed = np.array([needs_unit(plan, e.unit, boxes) and e.length > 0
                           for e in index.entries] + [False], np.int32)
        per_process = np.asarray(multihost_utils.process_allgather(needed)).reshape(
            jax.process_count(), -1)
        only = per_process[-1] & (per_process[:-1].sum(0) == 0)
        candidates += [(j, index.entries[i], bool(only[i]))
                       for i in np.flatnonzero(per_process[-1])]
      j, entry, only_last = max(candidates, key=lambda c: (c[2], c[0]))
      corrupt = bytearray(parts[j])
      corrupt[entry.start + entry.length // 2] ^= 0x40
      given = parts[:j] + [bytes(corrupt)] + parts[j + 1:]
      name += " (read by the last process only)" if only_last else ""
    try:
      receiver.receive(given)
      outcomes.append({"case": name, "refused": False})
    except jsparse.PayloadError as e:
      outcomes.append({"case": name, "refused": True, "error": str(e)[:160],
                       "unchanged": receiver.digest == before})
  return outcomes


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Job:
  """A local ``jax.distributed`` job started by :func:`start`: :meth:`wait` for its reports."""

  def __init__(self, role: str, procs: list, timeout: float):
    self.role, self._procs = role, procs
    self._deadline = time.monotonic() + timeout

  def wait(self) -> list[dict]:
    """Each process's report, once all have exited; every process is killed if one fails or
    the job runs past its timeout."""
    try:
      for proc, _, _ in self._procs:
        proc.wait(timeout=max(1, self._deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
    finally:
      self.kill()
    failed = [(i, p.returncode) for i, (p, _, _) in enumerate(self._procs) if p.returncode != 0]
    if failed:
      tails = "\n".join(Path(log.name).read_text()[-3000:] for _, _, log in self._procs)
      raise RuntimeError(f"{self.role} job failed (process, exit code) {failed}:\n{tails}")
    return [json.loads(report.read_text()) for _, report, _ in self._procs]

  def kill(self) -> None:
    """Stops every process of the job still running."""
    for proc, _, log in self._procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      log.close()


def start(role: str, processes: int, devices: int, out_dir: str, extra: Sequence[str] = (),
          timeout: float = 300) -> Job:
  """Starts ``role`` as a local ``jax.distributed`` job of ``processes`` processes with
  ``devices`` CPU devices each (killed by :meth:`Job.wait` past ``timeout`` seconds from now);
  jobs on different output folders run side by side."""
  from jsparse.testing import host_device_flags
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS=host_device_flags(devices),
             JAX_PLATFORMS="cpu")
  logs = Path(out_dir) / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  procs = []
  for i in range(processes):
    report = logs / f"{role}-{'-'.join(extra)[:40]}-{i}.json".replace("/", "_")
    cmd = [sys.executable, "-m", "jsparse.examples.multihost", role, "--dir", out_dir,
           "--process-id", str(i), "--num-processes", str(processes),
           "--coordinator", f"127.0.0.1:{port}", "--report", str(report), *extra]
    log = open(logs / f"{report.stem}.log", "w")
    procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), report,
                  log))
  return Job(role, procs, timeout)


def launch(role: str, processes: int, devices: int, out_dir: str, extra: Sequence[str] = (),
           timeout: float = 300) -> list[dict]:
  """Runs ``role`` as a local ``jax.distributed`` job (:func:`start`) and returns each
  process's report."""
  return start(role, processes, devices, out_dir, extra, timeout).wait()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("role", nargs="?", choices=["all", "trainer", "rollout"], default="all")
  parser.add_argument("--dir", default="jsparse_out/multihost")
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--coordinator", default="127.0.0.1:0")
  parser.add_argument("--report", default=None, help="where a process writes its report")
  parser.add_argument("--steps", type=int, default=5, help="training steps (versions 2..)")
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--trainer-devices", type=int, default=8)
  parser.add_argument("--chunk-bytes", type=int, default=128 << 10,
                      help="trainer: rollout bytes per streamed part (several per process)")
  parser.add_argument("--coding", default="positioned", help="trainer: the Sender's coding")
  parser.add_argument("--quantize", default=None,
                      help="a preset of jsparse.quantized (e.g. fp8_per_channel): the rollout "
                           "holds quantized weights")
  parser.add_argument("--tensor", type=int, default=4, help="rollout tensor-parallel size")
  parser.add_argument("--name", default="rollout")
  parser.add_argument("--faults", action="store_true", help="refuse bad parts at version 3")
  parser.add_argument("--follow", action="store_true",
                      help="rollout: catch up with an engine.Subscriber from nothing")
  parser.add_argument("--save-state", action="store_true")
  parser.add_argument("--chain", action="store_true",
                      help="trainer: save a delta checkpoint chain; rollout: restore it")
  parser.add_argument("--save-at", type=int, default=0)
  parser.add_argument("--restore-from", default=None)
  parser.add_argument("--restore-sender", default=None)
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  if args.role == "all":
    trainer_reports = launch("trainer", 2, 4, args.dir, ["--save-state"])
    one = launch("rollout", 1, 8, args.dir, ["--name", "one", "--tensor", "4"])
    two = launch("rollout", 2, 4, args.dir, ["--name", "two", "--tensor", "4"])
    for name, reports in (("trainer", trainer_reports), ("rollout 1x8", one),
                          ("rollout 2x4", two)):
      for r in reports:
        print(name, "process", r["process"], json.dumps(r["versions"][-1]))
    return
  report = trainer(args) if args.role == "trainer" else rollout(args)
  if args.report:
    Path(args.report).write_text(json.dumps(report))


if __name__ == "__main__":
  main()
