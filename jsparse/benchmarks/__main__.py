"""``python -m jsparse.benchmarks``: jsparse against the alternatives, side by side in one run.

On a realistic update (a ~21M-parameter TinyLM pretrained for 300 AdamW steps, then RL-like
AdamW steps at lr 1e-6 on fp32 masters, bf16 rollout; the method table is for the step whose
density is closest to 1%) it prints: payload bytes, encode and apply times and
compiled memory of the sync, and the bytes per change of every coding at every step
(``--only sync``); bytes per change at learning rates 1e-6, 1e-5 and 3e-5 and after a jolt,
at the default settings against ``capacity=1.0``, static slots and dense (``--only density``);
XLA's cost model of one sync per coding, bytes accessed by the device
programs of each side against the same for a compare-and-count and a dense copy, on that step
and on a 250M-parameter tree (``--only costs``); the disk bytes and save times of full Orbax
checkpoints against a delta chain (``--only storage``), and the end-to-end sync time per step
over a simulated 1 and 10 Gbit/s link, sparse against dense (``--only link``); set-up time
against the number of leaves, time per parameter and peak memory from 25M to 1B parameters, and
an estimate for 7B and 70B models from this run's rates (``--only scale``; the estimate needs
the sync part's rates, so ``--only scale`` runs that too); the peak host memory of a sync
against its payload (``--only memory``); bytes and seconds per sync in Tunix's
GRPO loop, jsparse against Tunix's dense sync (``--only tunix``, needs ``jsparse[tunix]``); per
quantized-rollout preset (FP8, MX, INT8, INT4), the codes and scales a step changes, payload bytes
against dense quantized weights and bf16 sparse, and sync times (``--only quantized``, needs
``jsparse[quantized]``).

``--quick`` is a reduced run (a small TinyLM, fewer steps and repeats, a small leaf count and
one scaling point, two quantized presets, no Tunix part) that finishes in about two minutes on a
2-core CPU.
``--json FILE`` writes every table's data and a ``machine`` record; ``--plots DIR`` draws the
figures (needs matplotlib). Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

# The full run's settings, and the reduced ones of --quick (for the options left at default).
FULL = dict(dim=512, depth=6, vocab=8192, steps=8, pretrain_steps=300, repeats=5,
            leaf_counts=[100, 1000, 10000], threads=[1, 2],
            scale_params=[25_000_000, 100_000_000, 250_000_000, 1_000_000_000], scale_width=1024,
            scale_stages=True, device_params=1_000_000_000, host_rate_params=250_000_000,
            cost_params=250_000_000)
QUICK = dict(dim=128, depth=1, vocab=1024, steps=4, pretrain_steps=30, repeats=2,
             leaf_counts=[8], threads=[1, 2], scale_params=[3_000_000],
             scale_width=512, scale_stages=False, device_params=3_000_000,
             host_rate_params=0, cost_params=0)
PARTS = ("sync", "density", "costs", "storage", "link", "scale", "memory", "quantized", "tunix",
         "device")
SCHEMA = 1  # the JSON file's layout version


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows the defaults, except where there is none (None, False)."""

  def _get_help_string(self, action: argparse.Action) -> str | None:
    if action.default is None or action.default is False:
      return action.help
    return super()._get_help_string(action)


def _parser(defaults: dict = FULL) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m jsparse.benchmarks",
      description="jsparse against the alternatives, side by side in one run: tables on stdout, "
                  "progress on stderr.",
      formatter_class=_Formatter,
      epilog="--quick changes the defaults to: "
             + ", ".join(_flag(k, v) for k, v in QUICK.items())
             + " (options given keep their values).")
  add = parser.add_argument
  add("--quick", action="store_true",
      help="a reduced run: small model, few steps and repeats, a small leaf count, one scaling "
           "point, two quantized presets, no Tunix part")
  add("--only", choices=PARTS,
      help="run one part only (default: all of them but device, the prepared accelerator "
           "check: see jsparse.benchmarks.device)")
  add("--device-dir", metavar="DIR", type=Path, default=Path("jsparse-device-benchmark"),
      help="where --only device writes results.json and its profiler trace")
  add("--device-params", type=int, default=defaults["device_params"],
      help="parameters of --only device's large layered tree")
  add("--json", metavar="FILE", type=Path,
      help="write every table's data and a 'machine' record to FILE")
  add("--plots", metavar="DIR", type=Path, help="write the figures as PNG files into DIR")
  add("--dim", type=int, default=defaults["dim"], help="model width")
  add("--depth", type=int, default=defaults["depth"], help="residual blocks")
  add("--vocab", type=int, default=defaults["vocab"], help="vocabulary size")
  add("--steps", type=int, default=defaults["steps"], help="RL-like steps to run")
  add("--pretrain-steps", type=int, default=defaults["pretrain_steps"],
      help="AdamW steps at lr 3e-3 before the RL-like ones")
  add("--lr", type=float, default=1e-6, help="the RL-like AdamW learning rate")
  add("--repeats", type=int, default=defaults["repeats"], help="timing repeats (best is kept)")
  add("--leaf-counts", type=int, nargs="+", default=defaults["leaf_counts"],
      help="leaf counts of the set-up time table")
  add("--threads", type=int, nargs="+", default=defaults["threads"],
      help="host threads of the coding-rate table")
  add("--scale-params", type=int, nargs="+", default=defaults["scale_params"],
      help="model sizes of the scaling table")
  add("--scale-width", type=int, default=defaults["scale_width"],
      help="layer width of the scaling table's trees")
  add("--host-rate-params", type=int, default=defaults["host_rate_params"],
      help="parameters of the tree whose payload times the packed coding's host stages per "
           "byte for the estimate (0: the workload's own step)")
  add("--cost-params", type=int, default=defaults["cost_params"],
      help="parameters of the layered tree whose sync the cost-model table also counts (0: the "
           "workload's step only)")
  add("--scale-stages", action=argparse.BooleanOptionalAction, default=defaults["scale_stages"],
      help="time the four stages of a sync and their floors at every size of the scaling table")
  return parser


def _flag(name: str, value: Any) -> str:
  flag = "--" + name.replace("_", "-")
  if isinstance(value, bool):
    return flag if value else "--no-" + flag[2:]
  return f"{flag} {_show(value)}"


def _show(value: Any) -> str:
  return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The options; with ``--quick``, those not given take :data:`QUICK`'s values.

  >>> args = parse_args(["--quick", "--steps", "3"])
  >>> args.steps, args.dim, args.scale_stages, parse_args([]).dim
  (3, 128, False, 512)
  """
  args = _parser().parse_args(argv)
  return _parser(QUICK).parse_args(argv) if args.quick else args


class _Progress:
  """One step per table, on stderr: a tqdm bar if tqdm is installed, else a line per table."""

  def __init__(self, total: int, enabled: bool = True):
    self.bar, self.enabled, self.done, self.total = None, enabled, 0, total
    self.start = time.perf_counter()
    if enabled:
      try:
        from tqdm.auto import tqdm
        self.bar = tqdm(total=total, unit="table", file=sys.stderr, dynamic_ncols=True)
      except ImportError:
        pass

  @contextlib.contextmanager
  def table(self, name: str) -> Iterator[None]:
    if self.bar is not None:
      self.bar.set_description(name)
    elif self.enabled:
      print(f"[{self.done + 1}/{self.total}] {name} ...", file=sys.stderr, flush=True)
    yield
    self.done += 1
    sys.stdout.flush()
    if self.bar is not None:
      self.bar.update(1)
    elif self.enabled:
      print(f"[{self.done}/{self.total}] {name} done at "
            f"{time.perf_counter() - self.start:.0f} s", file=sys.stderr, flush=True)

  def tables_above(self) -> contextlib.AbstractContextManager:
    """Where stdout and the bar share a terminal, the tables print above the bar."""
    if self.bar is None or not (sys.stdout.isatty() and sys.stderr.isatty()):
      return contextlib.nullcontext()
    from tqdm.contrib import DummyTqdmFile
    return contextlib.redirect_stdout(DummyTqdmFile(sys.stdout))

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def _tables(args: argparse.Namespace) -> list[str]:
  """The tables this run makes, in order (the progress bar's steps)."""
  only, names = args.only, []
  if only in ("tunix", "device"):
    return [only]
  names.append("workload")
  if only in (None, "sync", "scale"):
    names += ["sync", "codings"]
  if only in (None, "density"):
    names.append("density")
  if only in (None, "costs"):
    names.append("costs")
    if args.cost_params:
      names.append("costs large")
  if only in (None, "link"):
    names += ["link", "stream", "lagging"]
  if only in (None, "storage"):
    names.append("storage")
  if only in (None, "scale"):
    names += ["host_rate", "estimate", "coding"]
    names += [f"scaling {p / 1e6:g}M" for p in args.scale_params]
    names += [f"compile {n} leaves" for n in args.leaf_counts]
    names.append("first sync")
  if only in (None, "scale", "memory"):
    names.append("host_memory")
  if only in (None, "quantized"):
    names.append("quantized")
  if only is None and not args.quick:
    names.append("tunix")
  return names


def bytes_by_coding(plan, states: Sequence) -> dict:
  """Per fixed coding of :class:`jsparse.Coding` (``"auto"`` picks one of them per send), every
  step of the run synced step by step: its density, changes and payload bytes."""
  import jsparse
  rows = {}
  for coding in (c for c in jsparse.Coding if c.value != "auto"):
    sender = jsparse.Sender(plan, states[0], coding=coding)
    rows[coding.value] = []
    for params in states[1:]:
      size = len(sender.send(params))
      changed = sender.last_stats.changed
      rows[coding.value].append({"density": changed / plan.num_elements, "changed": changed,
                                 "bytes": size})
  return rows


def print_bytes_by_coding(rows: dict) -> None:
  print("\nbytes per change, per coding and step (density):")
  first = next(iter(rows.values()))
  print(f"{'coding':>12} " + " ".join(f"{r['density']:>8.2%}" for r in first))
  for coding, steps in rows.items():
    print(f"{coding:>12} " + " ".join(f"{r['bytes'] / max(1, r['changed']):>8.2f}"
                                       for r in steps))


def run(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  # On a GPU, JAX takes 75% of its memory at start: the scaling and set-up rows run in child
  # processes of this one, which then would not fit. (Read when the backend starts.)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.plots is not None:
    import matplotlib  # fail now, not after the run
    del matplotlib
  started = time.perf_counter()
  progress = _Progress(len(_tables(args)))
  try:
    with progress.tables_above():
      results = _run(args, progress.table)
  finally:
    progress.close()
  seconds = time.perf_counter() - started
  print(f"\n{', '.join(results)}: {seconds:.0f} s", file=sys.stderr)
  if args.json is not None:
    write_json(args.json, results, args, seconds)
    print(f"wrote {args.json}", file=sys.stderr)
  if args.plots is not None:
    for path in plot(results, args.plots):
      print(f"wrote {path}", file=sys.stderr)
  return results


def _run(args: argparse.Namespace, table: Callable) -> dict:
  import jax
  import jax.numpy as jnp

  import jsparse
  from jsparse.benchmarks import costs, link, scale, storage, sync, tunix_loop
  from jsparse.examples import workload

  results: dict = {}
  if args.only == "device":  # its own workload, sized for an accelerator
    from jsparse.benchmarks import device
    with table("device"):
      results["device"] = device.run(str(args.device_dir), dim=args.dim, depth=args.depth,
                                     vocab=args.vocab, pretrain_steps=args.pretrain_steps,
                                     large_params=args.device_params, repeats=args.repeats)
    return results
  if args.only == "tunix":  # its own run: no TinyLM workload needed
    with table("tunix"):
      results["tunix"] = tunix_loop.tunix_syncs()
      tunix_loop.print_tunix_syncs(results["tunix"])
    return results
  with table("workload"):
    cfg = workload.benchmark_config(args.dim, args.depth, args.vocab, args.pretrain_steps,
                                    args.lr)
    states = workload.realistic_run(cfg, args.steps)
    plan = jsparse.make_plan(states[0], rollout_dtype=jnp.bfloat16, capacity=0.05)
    results["workload"] = {"dim": args.dim, "depth": args.depth, "vocab": args.vocab,
                           "pretrain_steps": args.pretrain_steps, "steps": args.steps,
                           "lr": args.lr, "params": plan.num_elements,
                           "leaves": len(plan.leaves), "rollout_bytes": plan.rollout_bytes}
  if args.only in (None, "sync", "scale"):
    with table("sync"):
      results["sync"] = sync.run(plan, states, repeats=args.repeats,
                                 methods=sync.QUICK_METHODS if args.quick else sync.METHODS)
    with table("codings"):
      results["codings"] = bytes_by_coding(plan, states)
      print_bytes_by_coding(results["codings"])
  if args.only in (None, "density"):
    from jsparse.benchmarks import density
    with table("density"):
      runs = density.lr_runs(cfg, steps=min(args.steps, 4))
      runs["jolt"] = density.jolted(runs[f"lr {density.LEARNING_RATES[0]:g}"])
      results["density"] = density.density_sweep(plan, runs)
      density.print_density_sweep(results["density"])
  if args.only in (None, "costs"):
    step = (results["sync"]["step"] if "sync" in results
            else sync.one_percent_step(sync.per_step_sizes(plan, states)))
    with table("costs"):
      results["costs"] = {"step": costs.cost_table(plan, states[step - 1], states[step])}
      costs.print_cost_table(f"the TinyLM step {step}", results["costs"]["step"])
    if args.cost_params:
      with table("costs large"):
        results["costs"]["large"] = costs.cost_table(
            *scale.large_step(args.cost_params), codings=costs.LARGE_STEP_CODINGS)
        costs.print_cost_table("a layered tree after one RL-like step",
                               results["costs"]["large"])
  if args.only in (None, "link"):
    with table("link"):
      results["link"] = link.link_times(plan, states)
      link.print_link_times(results["link"])
    with table("stream"):
      results["stream"] = link.stream_times(plan, states)
      link.print_stream_times(results["stream"])
    with table("lagging"):
      results["lagging"] = link.lagging_rollout(plan, states)
      link.print_lagging_rollout(results["lagging"])
  if args.only in (None, "storage"):
    with table("storage"):
      results["storage"] = storage.compare_storage(plan, states)
      storage.print_storage(plan, results["storage"])
  if args.only in (None, "scale"):
    with table("host_rate"):
      step = results["sync"]["step"]
      results["packed_host_rate"] = (  # 0: on the workload's step (its programs are compiled)
          scale.packed_host_rate(args.host_rate_params, args.repeats) if args.host_rate_params
          else scale.packed_host_rate_of(plan, states[step - 1], states[step], args.repeats))
      scale.print_packed_host_rate(results["packed_host_rate"])
    with table("estimate"):
      compact, core = results["sync"]["methods"][sync.RANKED], results["sync"]["core"]
      changed = results["sync"]["steps"][results["sync"]["step"] - 1]["changed"]
      ratio = compact["diff"] / core["compare-and-count (floor)"][0]
      measured = None
      if jax.default_backend() != "cpu":  # the device passes as timed on this accelerator
        measured = ((compact["diff"] + compact["device_apply"]) / plan.num_elements,
                    core["dense bf16 copy"][0] / plan.num_elements)
      results["estimate"] = scale.estimate(compact, changed, ratio, measured_per_param=measured)
      scale.print_estimate(results["estimate"])
      packed = results["sync"]["methods"][sync.PACKED]
      floors = {"compare-and-count": core["compare-and-count (floor)"][0],
                "dense copy": core["dense bf16 copy"][0]}
      results["packed_estimate"] = scale.packed_estimate(
          packed, changed, floors, host_per_byte=results["packed_host_rate"]["per_byte"])
      scale.print_packed_estimate(results["packed_estimate"])
    with table("coding"):
      step = results["sync"]["step"]
      results["coding"] = scale.coding_rates(plan, states[step - 1], states[step],
                                             threads=args.threads)
      scale.print_coding_rates(results["coding"])
    results["scaling"] = []
    for params in args.scale_params:  # one point at a time: a progress step each
      with table(f"scaling {params / 1e6:g}M"):
        results["scaling"] += scale.scaling([params], width=args.scale_width,
                                            stages=args.scale_stages)
    scale.print_scaling(results["scaling"])
    results["compile"] = {}
    for n in args.leaf_counts:
      with table(f"compile {n} leaves"):
        results["compile"].update(scale.compile_times([n]))
    scale.print_compile_times(results["compile"])
    from jsparse.benchmarks import first_sync
    with table("first sync"):
      results["first_sync"] = first_sync.first_syncs()
    first_sync.print_first_syncs(results["first_sync"])
  if args.only in (None, "scale", "memory"):
    with table("host_memory"):
      step = (results["sync"]["step"] if "sync" in results
              else sync.one_percent_step(sync.per_step_sizes(plan, states)))
      results["host_memory"] = scale.host_memory(plan, states[step - 1], states[step])
      scale.print_host_memory(results["host_memory"])
  if args.only in (None, "quantized"):
    from jsparse.benchmarks import quantized
    with table("quantized"):
      step = (results["sync"]["step"] if "sync" in results
              else sync.one_percent_step(sync.per_step_sizes(plan, states)))
      results["quantized"] = quantized.preset_rows(
          states, step, repeats=args.repeats,
          presets=quantized.QUICK_PRESETS if args.quick else None)
      quantized.print_presets(results["quantized"])
  if args.only is None and not args.quick:
    with table("tunix"):
      results["tunix"] = tunix_loop.tunix_syncs()
      tunix_loop.print_tunix_syncs(results["tunix"])
  return results


def machine() -> dict:
  """Where this run ran: platform, CPU model, cores, memory, the JAX version, backend and
  device kind, the date (UTC)."""
  import jax

  import jsparse
  cpu = platform.processor() or platform.machine()
  memory = None
  with contextlib.suppress(OSError, ValueError, IndexError):
    with open("/proc/cpuinfo") as info:
      cpu = next((line.split(":", 1)[1].strip() for line in info
                  if line.startswith("model name")), cpu)
    with open("/proc/meminfo") as info:
      memory = next(int(line.split()[1]) * 1024 for line in info
                    if line.startswith("MemTotal:"))
  if memory is None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
      memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  devices = jax.devices()
  return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu,
          "cores": os.cpu_count(), "memory_bytes": memory,
          "python": platform.python_version(), "jax": jax.__version__,
          "jsparse": jsparse.__version__, "backend": jax.default_backend(),
          "device_kind": devices[0].device_kind, "devices": len(devices),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def plain(value: Any) -> Any:
  """``value`` as JSON holds it: dict keys as strings, tuples as lists, NumPy scalars and arrays
  as Python numbers and lists, infinities and NaN as None.

  >>> import numpy as np
  >>> plain({1.0: (np.float32(0.5), float("inf")), 2: np.arange(2)})
  {'1.0': [0.5, None], '2': [0, 1]}
  """
  if isinstance(value, dict):
    return {str(k): plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(v) for v in value]
  if hasattr(value, "tolist"):  # NumPy and JAX scalars and arrays
    return plain(value.tolist())
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if hasattr(value, "value"):  # an enum
    return plain(value.value)
  return str(value)


def write_json(path: Path, results: dict, args: argparse.Namespace, seconds: float) -> None:
  settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("json", "plots")}
  data = {"schema": SCHEMA, "machine": machine(), "settings": settings,
          "seconds": round(seconds, 1), "results": plain(results)}
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


def _e2e(row: dict, gbit: float) -> float:
  return row["encode"] + row["bytes"] * 8 / (gbit * 1e9) + row["apply"]


def plot(results: dict, directory: Path) -> list[Path]:
  """The figures of a run's results (as :func:`run` returns them, or as read back from its JSON
  file's ``results``), as PNG files in ``directory``: bytes per change against density per
  coding, sync time against bandwidth per method, time per parameter against model size."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  results = plain(results)
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  written = []

  def save(fig, name: str) -> None:
    fig.tight_layout()
    path = directory / name
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    written.append(path)

  if "codings" in results:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for coding, steps in results["codings"].items():
      ax.plot([100 * r["density"] for r in steps],
              [r["bytes"] / max(1, r["changed"]) for r in steps], "o-", label=coding)
    ax.set_xlabel("elements changed (%)")
    ax.set_ylabel("payload bytes per change")
    ax.set_ylim(bottom=0)
    ax.set_title("Bytes per change against density, per coding")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "bytes_per_change.png")
  if "sync" in results:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    rates = [10 ** (k / 8) for k in range(-16, 17)]  # 0.01 to 100 Gbit/s
    for name, row in results["sync"]["methods"].items():
      ax.plot(rates, [1e3 * _e2e(row, g) for g in rates], label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Gbit/s)")
    ax.set_ylabel("sync time per step (ms)")
    ax.set_title("End-to-end sync time against bandwidth")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save(fig, "sync_time_vs_bandwidth.png")
  if results.get("scaling") or results.get("compile"):
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, rows in (("few large leaves (scaling)", results.get("scaling") or []),
                        ("many small leaves (set-up)", list((results.get("compile")
                                                             or {}).values()))):
      rows = sorted(rows, key=lambda r: r["params"])
      if rows:
        ax.plot([r["params"] for r in rows],
                [(r["send"] + r["receive"]) / r["params"] * 1e9 for r in rows], "o-",
                label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda x, _: f"{x / 1e9:g}B" if x >= 1e9 else f"{x / 1e6:g}M"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylim(bottom=0)
    ax.set_xlabel("parameters")
    ax.set_ylabel("send + receive, ns per parameter")
    ax.set_title("Steady sync time per parameter against model size")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    save(fig, "time_per_parameter.png")
  return written


if __name__ == "__main__":
  run()
