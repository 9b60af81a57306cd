"""Where a traced request spent its GPU time: kernel durations summed by name from a Perfetto trace.

    python bench/trace_summary.py TRACE_DIR [--top 30]

TRACE_DIR is what `jax.profiler.trace(..., create_perfetto_trace=True)` wrote (bench/pic_ttft.py --profile-dir);
every `perfetto_trace.json.gz` under it is read. Events on device threads (GPU streams) are grouped by kernel
name; host threads are summarised separately, so a request that is launch- or dispatch-bound shows it.

    python bench/trace_summary.py TRACE_DIR --periods piece_fold positioned_attention

cuts the GPU timeline after each kernel so named (one per layer) and counts the kernels between them; TRACE_DIR
may also be one trace file.

    python bench/trace_summary.py TRACE_DIR --hlo HLO_DIR

also groups GPU time by the named scopes of the model code (gdn_core, span_prefix, attn_core, ffn, ...): HLO_DIR
holds the optimized HLO text XLA dumped for the traced programs (XLA_FLAGS="--xla_dump_to=HLO_DIR
--xla_dump_hlo_as_text"); each kernel's HLO instruction (its `hlo_op` argument in the trace, else its name) is looked
up there for the op_name metadata that carries the scopes (kernel names are matched with '.' and '-' read as '_';
this grouping has not been checked against a GPU trace).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path


def load_events(path: Path) -> tuple[list[dict], dict[tuple[int, int], str]]:
    with gzip.open(path, "rt") as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names: dict[tuple[int, int], str] = {}
    processes: dict[int, str] = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[(event["pid"], event["tid"])] = event["args"]["name"]
    labelled = {key: f"{processes.get(key[0], key[0])} / {name}" for key, name in names.items()}
    return [e for e in events if e.get("ph") == "X"], labelled


def load_scopes(hlo_dir: Path | None) -> list[dict[str, str]]:
    """Per optimized HLO module: instruction name -> op_name metadata."""
    if hlo_dir is None:
        return []
    modules = []
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]*)\"")
    for path in sorted(hlo_dir.rglob("*after_optimizations.txt")):
        table = {}
        with open(path) as handle:
            for line in handle:
                match = pattern.match(line)
                if match:
                    # kernels are named after their HLO instruction with '.' and '-' turned into '_'
                    table[match.group(1)] = table[re.sub(r"[.\-]", "_", match.group(1))] = match.group(2)
        modules.append(table)
    return modules


SCOPES = ("gdn_in", "gdn_core", "gdn_out", "span_prefix", "span_keys", "span_flash", "attn_proj", "attn_core", "ffn")


def scope_of(op_name: str) -> str:
    """The innermost known named scope in an op_name path (or its first two plain components)."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    known = [p for p in parts if p in SCOPES]
    if known:
        return "/".join(known)
    return "/".join(parts[:2]) or "(no metadata)"


def summarise(trace_dir: Path, top: int, modules: list[dict[str, str]] | None = None,
              markers: list[str] | None = None, detail: int = 1) -> None:
    files = [trace_dir] if trace_dir.is_file() else sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}")
    for path in files:
        events, threads = load_events(path)
        device = collections.Counter()
        device_count = collections.Counter()
        host = collections.Counter()
        device_events = []
        for event in events:
            where = threads.get((event["pid"], event["tid"]), "")
            if "/device:" in where.lower() or "stream" in where.lower() or "gpu" in where.lower():
                device[event["name"]] += event.get("dur", 0)
                device_count[event["name"]] += 1
                device_events.append(event)
            else:
                host[event["name"]] += event.get("dur", 0)
        total = sum(device.values())
        print(f"{path.name if path == trace_dir else path.relative_to(trace_dir)}: {sum(device_count.values())} device events, {total / 1e3:.2f} ms "
              f"of GPU time (summed over streams)")
        for name, dur in device.most_common(top):
            print(f"  {dur / 1e3:9.3f} ms  {100 * dur / max(total, 1):5.1f}%  x{device_count[name]:<5d} {name[:110]}")
        # (by thread, not by name: the host's launch events can carry a kernel's name too, and counted them twice)
        if device_events:
            print(f"  arguments of a device event: {sorted((device_events[0].get('args') or {}).keys())}")
        if modules:
            keys = [(e.get("args") or {}).get("hlo_op") or e["name"] for e in device_events]
            best = max(modules, key=lambda table: sum(k in table for k in set(keys)))  # the traced program
            by_scope = collections.Counter()
            for event, key in zip(device_events, keys):
                by_scope[scope_of(best[key]) if key in best else "(not in the HLO dump)"] += event.get("dur", 0)
            print("  GPU time by named scope (innermost known scope; HLO op_name metadata):")
            for name, dur in by_scope.most_common(top):
                print(f"  {dur / 1e3:9.3f} ms  {100 * dur / max(total, 1):5.1f}%  {name[:110]}")
        per_thread = collections.Counter()
        for event in events:
            per_thread[threads.get((event["pid"], event["tid"]), f"pid {event['pid']} tid {event['tid']}")] += (
                event.get("dur", 0))
        print("  threads, by summed event duration (nested events count twice):")
        for name, dur in per_thread.most_common(8):
            print(f"  {dur / 1e3:9.3f} ms  {name[:110]}")
        print("  host, top by summed duration:")
        for name, dur in host.most_common(min(top, 10)):
            print(f"  {dur / 1e3:9.3f} ms  {name[:110]}")
        timeline(events, threads, device_events)
        if markers:
            periods(device_events, markers, detail)


def timeline(events: list[dict], threads: dict, device_events: list[dict], anchor: str = "prefill") -> None:
    """When things happened, relative to the start of the traced request (the first host event named like
    `anchor`): the host events of at least 1 ms in start order, the device's first and last kernel, its busy time
    and the largest idle gaps between kernels (a launch- or host-bound request shows as gaps)."""
    on_device = {id(e) for e in device_events}  # identity, not `in` on a list of dicts (quadratic)
    host = [e for e in events if id(e) not in on_device and e.get("dur", 0) >= 1000]
    roots = [e for e in host if anchor in e["name"]]
    if not roots or not device_events:
        return
    t0 = min(e["ts"] for e in roots)
    end = max(e["ts"] + e["dur"] for e in roots)
    print(f"  timeline (ms from the request's start; request {1e-3 * (end - t0):.1f} ms on the host):")
    for e in sorted(host, key=lambda e: e["ts"]):
        if t0 <= e["ts"] <= end:
            where = threads.get((e["pid"], e["tid"]), "")[-24:]
            print(f"    host {1e-3 * (e['ts'] - t0):8.2f} +{1e-3 * e['dur']:8.2f}  {e['name'][:70]}  [{where}]")
    kernels = sorted(device_events, key=lambda e: e["ts"])
    first, last = kernels[0]["ts"], max(e["ts"] + e.get("dur", 0) for e in kernels)
    busy = sum(e.get("dur", 0) for e in kernels)
    print(f"    device: first kernel at {1e-3 * (first - t0):.2f}, last ends at {1e-3 * (last - t0):.2f} "
          f"(span {1e-3 * (last - first):.2f} ms, busy {1e-3 * busy:.2f} ms)")
    gaps, reach = [], first
    for prev, nxt in zip(kernels, kernels[1:]):
        reach = max(reach, prev["ts"] + prev.get("dur", 0))
        if nxt["ts"] > reach:
            gaps.append((nxt["ts"] - reach, reach, prev["name"], nxt["name"]))
    gaps.sort(reverse=True)
    print(f"    idle gaps: {len(gaps)}, {1e-3 * sum(g[0] for g in gaps):.2f} ms in all; largest:")
    for gap, at, before, after in gaps[:12]:
        print(f"      {1e-3 * gap:8.2f} ms at {1e-3 * (at - t0):8.2f}  after {before[:40]}  before {after[:40]}")


def periods(device_events: list[dict], markers: list[str], detail: int = 1) -> None:
    """The GPU timeline cut after every kernel whose name starts with one of `markers` (one per layer, e.g. the
    span fold of each linear layer and the attention kernel of each full-attention layer): per kind of period
    (which marker opens and which closes it) the number of periods, kernels and GPU time in each, and the
    kernels of `detail` periods of each kind in launch order. This is where per-layer launch counts come from."""
    kernels = sorted(device_events, key=lambda e: e["ts"])
    marked = [i for i, e in enumerate(kernels) if any(e["name"].startswith(m) for m in markers)]
    if len(marked) < 2:
        print(f"  periods: fewer than two kernels named {markers}")
        return
    kinds: dict[tuple[str, str], list[list[dict]]] = collections.defaultdict(list)
    for a, b in zip(marked, marked[1:]):
        opened = next(m for m in markers if kernels[a]["name"].startswith(m))
        closed = next(m for m in markers if kernels[b]["name"].startswith(m))
        kinds[(opened, closed)].append(kernels[a + 1:b + 1])
    print(f"  periods between {markers} kernels ({len(marked)} markers; before the first: {marked[0]} kernels, "
          f"after the last: {len(kernels) - marked[-1] - 1}):")
    for (opened, closed), runs in kinds.items():
        counts = [len(r) for r in runs]
        times = [sum(e.get("dur", 0) for e in r) / 1e3 for r in runs]
        print(f"    {opened} -> {closed}: {len(runs)} periods, {min(counts)}-{max(counts)} kernels, "
              f"{min(times):.3f}-{max(times):.3f} ms of kernel time each")
        for run in runs[:detail]:
            for e in run:
                print(f"      {e.get('dur', 0):8.1f} us  {e['name'][:100]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--hlo", type=Path, default=None, help="folder of XLA's optimized HLO text dumps")
    parser.add_argument("--periods", nargs="+", default=None, metavar="KERNEL",
                        help="cut the GPU timeline after each kernel named so (per-layer launch counts)")
    parser.add_argument("--detail", type=int, default=1, help="periods of each kind listed kernel by kernel")
    args = parser.parse_args(argv)
    summarise(args.trace_dir, args.top, load_scopes(args.hlo), args.periods, args.detail)


if __name__ == "__main__":
    main()
