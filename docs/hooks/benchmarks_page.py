"""Fills in docs/benchmarks.md from a benchmark run's JSON file (an mkdocs hook; ``mkdocs.yml``
lists it under ``hooks:``).

The page is a template: every ``{{ name }}`` in it is replaced by the table or the value
``name`` of :func:`values`, computed from ``docs/data/benchmarks.json`` as written by
``python -m jsparse.benchmarks --json`` (the figures beside it come from the same run's
``--plots``). A name the run has no data for fails the build, as does a missing file.

Regenerate the data and figures (then build the docs):

    python -m jsparse.benchmarks --quick --json docs/data/benchmarks.json --plots docs/figures

Render the page alone: ``python docs/hooks/benchmarks_page.py`` prints it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

DOCS = Path(__file__).resolve().parents[1]
DATA = DOCS / "data" / "benchmarks.json"
PAGE = "benchmarks.md"
PLACEHOLDER = re.compile(r"\{\{\s*([a-z0-9_]+)\s*\}\}")
LINKS_GBIT = ("0.1", "1", "10", "100")  # the methods table's end-to-end columns


def on_page_markdown(markdown: str, page, config, files) -> str:
  if page.file.src_uri != PAGE:
    return markdown
  return render(markdown, json.loads(DATA.read_text()))


def render(template: str, data: dict) -> str:
  """``template`` with every ``{{ name }}`` replaced by ``values(data)[name]``."""
  table = values(data)

  def fill(match: re.Match) -> str:
    name = match.group(1)
    if name not in table:
      raise KeyError(f"{PAGE}: {{{{ {name} }}}} has no value in {DATA.name} "
                     f"(known: {', '.join(sorted(table))})")
    return table[name]()

  return PLACEHOLDER.sub(fill, template)


# Formatting.

def _n(x: float) -> str:
  return f"{x:,.0f}"


def _ms(seconds: float) -> str:
  return f"{1e3 * seconds:,.1f}"


def _mb(n: float) -> str:
  return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} KB"


def _pct(x: float, digits: int = 2) -> str:
  return f"{100 * x:.{digits}f}%"


def _params(n: float) -> str:
  return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _rows(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _setup(row: dict) -> float:
  return row["sender"] + row["first send"] + row["receiver"] + row["first receive"]


def _gbit(key: str) -> str:
  return f"{float(key):g}"


def machine_text(m: dict) -> str:
  """The machine a run came from, in words."""
  memory = f", {m['memory_bytes'] / 2**30:.0f} GiB of memory" if m.get("memory_bytes") else ""
  device = (f"JAX's CPU backend" if m["backend"] == "cpu"
            else f"{m['devices']} x {m['device_kind']} ({m['backend']})")
  return (f"**{m['cores']}-core {m['machine']} machine ({m['cpu']}){memory}**, {device}; "
          f"{m['platform'].split('-with-')[0]}, Python {m['python']}, JAX {m['jax']}, "
          f"jsparse {m['jsparse']}, on {m['date'][:10]}")


def values(data: dict) -> dict[str, Callable[[], str]]:
  """Every name the page may use, each a function making its text (only the ones used run)."""
  r, m, s = data["results"], data["machine"], data["settings"]
  v: dict[str, Callable[[], str]] = {}
  v["machine"] = lambda: machine_text(m)
  v["command"] = lambda: ("python -m jsparse.benchmarks" + (" --quick" if s.get("quick") else "")
                          + " --json docs/data/benchmarks.json --plots docs/figures")
  v["run_kind"] = lambda: ("a reduced run (`--quick`): a small model and few repeats, so "
                           "fixed costs weigh more than in the full run"
                           if s.get("quick") else "the full run")
  v["run_seconds"] = lambda: f"{data['seconds']:.0f} s"

  if "workload" in r:
    w = r["workload"]
    v["workload"] = lambda: (
        f"A {_params(w['params'])}-parameter TinyLM (Flax NNX; width {w['dim']}, "
        f"{w['depth']} residual block{'s' if w['depth'] != 1 else ''}, vocabulary "
        f"{w['vocab']:,}; {w['leaves']} leaves) pretrained for {w['pretrain_steps']} AdamW "
        f"steps (a pretrained-like weight distribution), then {w['steps']} AdamW steps at lr "
        f"{w['lr']:g} on fp32 masters with a bf16 rollout copy ({_mb(w['rollout_bytes'])})")
    v["workload_short"] = lambda: f"{_params(w['params'])}-parameter"

  if "codings" in r:
    codings = r["codings"]
    first = next(iter(codings.values()))
    v["bytes_per_change_table"] = lambda: _rows(
        ["step"] + [str(i + 1) for i in range(len(first))],
        [["elements changed"] + [_pct(x["density"]) for x in first]]
        + [[f"`{name}`, bytes/change"] + [f"{x['bytes'] / max(1, x['changed']):.2f}"
                                          for x in steps] for name, steps in codings.items()])

  if "density" in r:
    def density_table() -> str:
      from jsparse.benchmarks import density
      rows = []
      for (name, coding), row in density.summary(r["density"]).items():
        d = r["density"][name]["density"]
        rows.append([name, f"{_pct(min(d))}–{_pct(max(d))}", f"`{coding}`",
                     f"{row['bytes_per_change']:.3f}", f"{row['vs_capacity_1']:.3f}x",
                     f"{row['vs_static']:.3f}x", f"{row['max_vs_dense']:.3f}x"])
      return _rows(["run", "elements changed", "coding", "bytes/change",
                    "over `capacity=1.0`", "over `max_capacity=0`", "largest step over dense"],
                   rows)
    v["density_table"] = density_table

  if "costs" in r:
    def cost_rows(table: dict) -> list[list]:
      return [[f"`{name}`", f"{c['send_bytes'] / 1e6:,.1f}", f"{c['send_x_floor']:.2f}x",
               f"{c.get('first_delta_bytes', 0.0) / 1e6:,.1f}",
               f"{c['receive_bytes'] / 1e6:,.1f}", f"{c['receive_x_floor']:.2f}x"]
              for name, c in table["codings"].items()]

    def cost_table() -> str:
      header = ["coding", "send MB", "over compare-and-count", "first delta's count MB",
                "receive MB", "over dense copy"]
      out = []
      for key, label in (("step", f"the {r['workload']['params'] / 1e6:.1f}M-parameter step"),
                         ("large", "a layered tree after one RL-like step")):
        if key in r["costs"]:
          t = r["costs"][key]
          out.append(f"On {label} ({t['params']:,} parameters; floors: compare-and-count "
                     f"{t['floors']['compare-and-count'] / 1e6:,.1f} MB, dense cast and copy "
                     f"{t['floors']['dense copy'] / 1e6:,.1f} MB):\n\n"
                     + _rows(header, cost_rows(t)))
      return "\n\n".join(out)
    v["cost_table"] = cost_table

  if "sync" in r:
    sync = r["sync"]
    step, methods, core = sync["step"], sync["methods"], sync["core"]
    changed = sync["steps"][step - 1]["changed"]
    params = r["workload"]["params"]
    dense = methods["dense bf16"]
    ranked = next(row for name, row in methods.items() if "ranked" in name)
    positioned = next((row for name, row in methods.items() if "positioned" in name), None)
    v["sync_step"] = lambda: (f"Step {step} ({changed:,} of {params:,} elements changed, "
                              f"{_pct(changed / params)})")

    def e2e(row: dict, gbit: str) -> float:
      return row["encode"] + row["bytes"] * 8 / (float(gbit) * 1e9) + row["apply"]

    v["methods_table"] = lambda: _rows(
        ["method", "bytes", "B/change", "vs dense", "encode ms", "apply ms", "temp MB"],
        [[name, _n(x["bytes"]), f"{x['bytes'] / changed:.2f}",
          f"{dense['bytes'] / x['bytes']:.1f}x", _ms(x["encode"]), _ms(x["apply"]),
          f"{x['temp'] / 2**20:.1f}"] for name, x in methods.items()])
    v["speedup_table"] = lambda: _rows(
        ["method"] + [f"{_gbit(g)} Gbit/s" for g in LINKS_GBIT],
        [[name] + [f"{e2e(dense, g) / e2e(x, g):.1f}x" for g in LINKS_GBIT]
         for name, x in methods.items() if x is not dense])
    v["parts_table"] = lambda: _rows(
        ["method", "diff (device)", "host encode", "host decode", "apply (device)"],
        [[name] + [_ms(x[k]) for k in ("diff", "host_encode", "host_decode", "device_apply")]
         for name, x in methods.items() if "diff" in x])
    param_bytes = 4 * params
    floor, copy = core["compare-and-count (floor)"][0], core["dense bf16 copy"][0]
    ratio = {"jsparse.diff": floor, "jsparse.apply (donated)": copy}
    labels = {"compare-and-count (floor)": "compare-and-count (the streaming floor)",
              "jsparse.diff": "`jsparse.diff`", "dense bf16 copy": "dense bf16 copy",
              "jsparse.apply (donated)": "`jsparse.apply` (donated)"}
    v["core_table"] = lambda: _rows(
        ["jitted step", "ms", "temp / fp32 param bytes"],
        [[labels.get(name, name),
          _ms(sec) + (f" ({sec / ratio[name]:.2f}x the "
                      f"{'floor' if 'diff' in name else 'dense copy'})" if name in ratio else ""),
          f"{temp / param_bytes:.3f}"] for name, (sec, temp) in core.items()])
    if positioned is not None:
      v["positioned_extra_bytes"] = lambda: _pct(positioned["bytes"] / ranked["bytes"] - 1, 0)
      v["ranked_vs_positioned_apply"] = lambda: (f"{_ms(ranked['device_apply'])} ms against "
                                                 f"{_ms(positioned['device_apply'])} ms")
    if "auto" in sync:
      v["auto_table"] = lambda: _rows(
          ["link", "`auto` chose", "`auto` end to end", "fastest fixed coding", "its end to end",
           "auto / fastest"],
          [[f"{_gbit(g)} Gbit/s", f"`{x['chosen']}`", f"{_ms(x['e2e'])} ms", x["best_fixed"],
            f"{_ms(x['best_fixed_e2e'])} ms", f"{x['e2e'] / x['best_fixed_e2e']:.2f}x"]
           for g, x in sync["auto"].items()])
    v["device_coded_table"] = lambda: _rows(
        ["coding", "send device passes", "receive device passes", "host stages"],
        [[name, f"{_ms(x['diff'] + x['device_pack'])} ms "
                f"({(x['diff'] + x['device_pack']) / floor:.2f}x compare-and-count)",
          f"{_ms(x['device_unpack'] + x['device_apply'])} ms "
          f"({(x['device_unpack'] + x['device_apply']) / copy:.2f}x a dense cast and copy)",
          f"{_ms(x['host_encode'] + x['host_decode'])} ms "
          f"({(x['host_encode'] + x['host_decode']) / x['bytes_floor']:.1f}x moving and "
          f"checksumming its bytes, {_ms(x['bytes_floor'])} ms)"]
         for name, x in methods.items() if "device_pack" in x])
    fewest = min(methods, key=lambda n: methods[n]["bytes"])
    v["fewest_bytes"] = lambda: fewest
    v["best_per_link"] = lambda: "; ".join(
        f"{_gbit(g)} Gbit/s: {min(methods, key=lambda n: e2e(methods[n], g))}"
        for g in LINKS_GBIT)

  if "quantized" in r:
    q = r["quantized"]
    step, bf16 = q["step"], q["rows"]["bf16"]
    at = lambda row: row["steps"][step - 1]  # noqa: E731
    v["quantized_step"] = lambda: (
        f"step {step}: {_pct(at(bf16)['changed'] / bf16['elements'])} of the bf16 elements "
        f"change, {_n(at(bf16)['bytes'])} B sparse, synced in {_ms(bf16['sync_seconds'])} ms")
    v["quantized_table"] = lambda: _rows(
        ["preset", "codes changed", "scales changed", "scale B", "payload B", "B/change",
         "dense quantized B", "x dense quantized", "x bf16 sparse", "sync ms"],
        [[name, _pct(at(x)["codes_changed"] / max(1, x["codes"])),
          _pct(at(x)["scales_changed"] / max(1, x["scales"]), 1), _n(x["scale_bytes"]),
          _n(at(x)["bytes"]), f"{at(x)['bytes'] / max(1, at(x)['changed']):.2f}",
          _n(x["dense_bytes"]), f"{x['dense_bytes'] / at(x)['bytes']:.0f}x",
          f"{at(bf16)['bytes'] / at(x)['bytes']:.1f}x", _ms(x["sync_seconds"])]
         for name, x in q["rows"].items() if name != "bf16"])

  if "storage" in r:
    full, chain = r["storage"]["full"], r["storage"]["delta chain"]
    v["storage_table"] = lambda: _rows(
        ["step", "full checkpoint B", "full ms", "chain", "chain B", "chain ms", "changed"],
        [[f["step"], _n(f["bytes"]), f"{1e3 * f['seconds']:.0f}", c["kind"], _n(c["bytes"]),
          f"{1e3 * c['seconds']:.0f}", _n(c["changed"])] for f, c in zip(full, chain)])
    deltas = chain[1:]
    total_full, total_chain = (sum(x["bytes"] for x in rows) for rows in (full, chain))
    mean_delta = sum(x["bytes"] for x in deltas) / max(1, len(deltas))
    v["storage_summary"] = lambda: (
        f"In all, {len(full)} full checkpoints take {_mb(total_full)} and the base plus "
        f"{len(deltas)} deltas {_mb(total_chain)} ({total_full / total_chain:.1f}x less); a "
        f"delta step averages {full[-1]['bytes'] / mean_delta:.0f}x smaller than a full one. "
        f"Restoring the last step (base + {len(deltas)} deltas, every digest checked) takes "
        f"{1e3 * chain[-1]['restore_seconds']:.0f} ms")

  if "link" in r:
    link = r["link"]
    v["link_table"] = lambda: _rows(
        ["link", "sparse bytes/step", "sparse ms", "dense bf16 bytes/step", "dense ms",
         "dense / sparse time"],
        [[f"{_gbit(g)} Gbit/s", _n(x["sparse"]["bytes"]), _ms(x["sparse"]["seconds"]),
          _n(x["dense"]["bytes"]), _ms(x["dense"]["seconds"]),
          f"{x['dense']['seconds'] / x['sparse']['seconds']:.1f}x"] for g, x in link.items()])
  if "stream" in r:
    stream = r["stream"]
    kinds = list(next(iter(stream.values())))
    v["stream_table"] = lambda: _rows(
        ["link"] + [f"{k} ms" for k in kinds],
        [[f"{_gbit(g)} Gbit/s"] + [_ms(x[k]) for k in kinds] for g, x in stream.items()])

  if "lagging" in r:
    lagging = r["lagging"]
    v["lagging_table"] = lambda: _rows(
        ["retention", "versions behind", "bytes it reads", "anchors", "deltas",
         "bytes the feed holds"],
        [[name, str(x["lag"]), _n(x["bytes_read"]), str(x["anchors"]), str(x["deltas"]),
          _n(x["feed_bytes"])] for name, x in lagging.items()])

  if "tunix" in r:
    t = r["tunix"]
    records = t["records"]
    v["tunix"] = lambda: (
        f"A {_params(records[0]['elements'])}-parameter Qwen3, same losses and rewards in "
        f"both runs: {t['same_run']}.\n\n" + _rows(
            ["sync", "density", "jsparse B", "B/change", "Tunix dense (fp32) B", "x vs fp32",
             "jsparse ms", "dense ms"],
            [[x["version"], _pct(x["changed"] / x["elements"]), _n(x["payload_bytes"]),
              f"{x['payload_bytes'] / max(1, x['changed']):.2f}", _n(x["dense_bytes"]),
              f"{x['dense_bytes'] / x['payload_bytes']:.0f}", _ms(x["seconds"]), _ms(d)]
             for x, d in zip(records, t["dense_seconds"])]))
  else:
    v["tunix"] = lambda: ("Not part of this run (`--quick` leaves it out): run "
                          "`python -m jsparse.benchmarks --only tunix` (needs "
                          "`jsparse[tunix]`).")

  if r.get("compile"):
    compile_rows = r["compile"]
    v["compile_table"] = lambda: _rows(
        ["leaves", "params", "plain jit", "`Sender()`", "first send", "`Receiver()`",
         "first receive", "set-up / plain jit", "send ns/param", "receive ns/param"],
        [[f"{int(n):,}", _params(x["params"]), f"{x['plain jit']:.2f}", f"{x['sender']:.2f}",
          f"{x['first send']:.2f}", f"{x['receiver']:.2f}", f"{x['first receive']:.2f}",
          f"{_setup(x) / x['plain jit']:.0f}x",
          f"{x['send'] / x['params'] * 1e9:.1f}", f"{x['receive'] / x['params'] * 1e9:.1f}"]
         for n, x in compile_rows.items()])
  if r.get("first_sync"):
    mlp, demo = r["first_sync"]["mlp"], r["first_sync"]["demo"]
    v["first_sync_table"] = lambda: _rows(
        ["model", "params", "`make_plan`", "`Sender()`", "`Receiver()`", "first sync",
         "next sync"],
        [["Flax MLP, FSDP", _params(mlp["params"]), f"{mlp['plan']:.2f}", f"{mlp['sender']:.2f}",
          f"{mlp['receiver']:.2f}", f"{mlp['first send'] + mlp['first receive']:.2f}",
          f"{mlp['send'] + mlp['receive']:.3f}"],
         ["the demo's TinyLM", _params(demo["params"]), "", "", "",
          f"{demo['first sync']:.2f}", f"{demo['sync']:.3f}"]])
  if r.get("scaling"):
    scaling = r["scaling"]
    per = [(x["send"] + x["receive"]) / x["params"] * 1e9 for x in scaling]
    v["scaling_width"] = lambda: str(s.get("scale_width"))
    v["scaling_table"] = lambda: _rows(
        ["params", "leaves", "changed", "payload", "send ms", "receive ms", "ns / param",
         "peak RSS / bytes held"],
        [[_params(x["params"]), x["leaves"], _pct(x["density"], 1), _mb(x["bytes"]),
          _ms(x["send"]), _ms(x["receive"]), f"{p:.2f}", f"{x['peak_rss'] / x['held']:.2f}"]
         for x, p in zip(scaling, per)])
    v["scaling_range"] = lambda: (f"{min(per):.1f} to {max(per):.1f} ns per parameter from "
                                  f"{_params(scaling[0]['params'])} to "
                                  f"{_params(scaling[-1]['params'])} parameters")
    staged = [x for x in scaling if "stages" in x]
    if staged:
      v["stages"] = lambda: (
          "Per stage (ns per parameter), and the device stages against their floors timed at "
          "the same size (a jitted compare-and-count; a jitted dense cast and copy):\n\n" + _rows(
              ["params", "send device", "host encode", "host decode", "receive device",
               "send / floor", "receive / floor"],
              [[_params(x["params"])] + [f"{x['stages'][k] / x['params'] * 1e9:.3f}" for k in
                                         ("diff", "host_encode", "host_decode", "device_apply")]
               + [f"{x['stages']['diff'] / x['floors']['compare-and-count']:.2f}x",
                  f"{x['stages']['device_apply'] / x['floors']['dense copy']:.2f}x"]
               for x in staged]))
    else:
      v["stages"] = lambda: ("(The per-stage times of each size are left out of this run: "
                             "`--scale-stages` adds them.)")
  if r.get("host_memory"):
    memory = r["host_memory"]
    v["host_memory_table"] = lambda: _rows(
        ["coding", "payload", "send", "receive"]
        + [f"streamed, {k.split()[1]} MiB parts" for k in next(iter(memory.values()))
           if k.startswith("stream")],
        [[coding, _mb(x["payload"])] + [f"{_mb(x[k])} ({x[k] / x['payload']:.1f}x)"
                                         for k in x if k not in ("payload", "changed")]
         for coding, x in memory.items()])
  if r.get("coding"):
    rates = r["coding"]
    base = rates[min(rates, key=int)]
    v["coding_rates_table"] = lambda: _rows(
        ["threads", "parts", "changes", "encode", "decode"],
        [[n, x["parts"], _n(x["changed"]),
          f"{x['encode'] / 1e6:.1f} M/s ({x['encode'] / base['encode']:.2f}x)",
          f"{x['decode'] / 1e6:.1f} M/s ({x['decode'] / base['decode']:.2f}x)"]
         for n, x in rates.items()])
  if r.get("packed_estimate"):
    v["packed_estimate_table"] = lambda: _rows(
        ["model", "link", "payload", "device passes", "host", "wire", "sparse", "dense bf16",
         "dense / sparse", "dense / sparse, one host"],
        [[_params(x["params"]), f"{x['link_gbit']:g} Gbit/s", _mb(x["payload_bytes"]),
          f"{x['device']:.3f} s", f"{x['host']:.3f} s", f"{x['wire']:.3f} s",
          f"{x['sparse']:.3f} s", f"{x['dense']:.2f} s", f"{x['dense'] / x['sparse']:.1f}x",
          f"{x['dense'] / x['sparse_one_host']:.1f}x"]
         for x in r["packed_estimate"]])
  if r.get("packed_host_rate"):
    h = r["packed_host_rate"]
    v["packed_host_rate"] = lambda: (
        f"{h['params'] / 1e6:,.0f}M parameters, {_n(h['changed'])} changes, a {_mb(h['bytes'])} "
        f"payload: host encode {1e3 * h['host_encode']:.1f} ms and decode "
        f"{1e3 * h['host_decode']:.1f} ms, {1e9 * h['per_byte']:.2f} ns per payload byte, "
        f"{h['per_byte'] * h['bytes'] / h['bytes_floor']:.2f}x the time to copy its bytes off "
        f"the device, checksum them and copy them back ({1e3 * h['bytes_floor']:.1f} ms)")
  if r.get("estimate"):
    est = r["estimate"]
    v["estimate_basis"] = lambda: (
        "the device passes as timed on this accelerator" if est[0]["measured"]
        else "an assumed 2 TB/s of accelerator memory bandwidth for the device passes (12 bytes "
             "per parameter times this run's measured send-device-stage / compare-and-count "
             "ratio on the sparse side; 6 bytes on the dense side)")
    v["estimate_caveat"] = lambda: (
        " In a reduced run (`--quick`) a sync has few changes, so fixed costs per sync weigh on "
        "the measured rates and make this estimate pessimistic; the full run's rates are the "
        "ones to extrapolate from." if s.get("quick") else "")
    v["estimate_table"] = lambda: _rows(
        ["model", "link", "payload", "sparse, 1 core", "sparse, 8 cores", "dense bf16",
         "dense / sparse (8 cores)"],
        [[_params(x["params"]), f"{x['link_gbit']:g} Gbit/s", _mb(x["payload_bytes"]),
          f"{x['sparse_1']:.2f} s", f"{x['sparse_n']:.2f} s", f"{x['dense']:.2f} s",
          f"{x['dense'] / x['sparse_n']:.1f}x"] for x in est])
  return v


if __name__ == "__main__":
  print(render((DOCS / PAGE).read_text(), json.loads(DATA.read_text())))
