"""Command line: `hypic-jax convert SRC DST [--dtype bfloat16]` (Hugging Face folder -> orbax checkpoint),
`hypic-jax diag MODEL --segments ... [--mode transition_rope_recompute]` (per-layer deviation of a PIC mode) and
`hypic-jax serve [MODEL]` (an OpenAI-compatible server, `hypic_jax.serve`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from converters import convert_folder
from hypic_jax.checkpoint import save_checkpoint
from hypic_jax.engine import Engine
from hypic_jax.parallel import POLICIES

# the share of an accelerator's memory the server lets JAX take (JAX's own default is 0.75: on a 141 GB H200 that
# leaves 35 GB unused, and the 35B-A3B shape with a 24 GB cache does not fit in the rest; vLLM's default is 0.9)
DEFAULT_GPU_MEMORY_FRACTION = 0.9


def _convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    model_type, config, params = convert_folder(args.src, args.dtype)
    save_checkpoint(args.dst, model_type=model_type, config=config, params=params, dtype=args.dtype)
    print(f"converted {args.src} ({model_type}) -> {args.dst} in {time.perf_counter() - start:.1f} s")
    return 0


def _diag(args: argparse.Namespace) -> int:
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, separator=args.separator)
    segments = args.segments if len(args.segments) > 1 else args.segments[0]  # one string: split on the separator
    if args.token_ids:
        segments = [[int(t) for t in s.replace(",", " ").split()] for s in args.segments]
    rows = engine.diagnose(segments, mode=args.mode, seam=args.seam)
    print(f"{'layer':>6} {'kind':<7} {'relative deviation vs full recompute':>38}")
    for row in rows:
        print(f"{row['layer']!s:>6} {row['kind']:<7} {row['deviation']:>38.3e}")
    print(json.dumps(dict(mode=args.mode or engine.mode, seam=args.seam, rows=rows)))
    return 0


def _positive(what: str):
    """An argparse type for a whole number >= 1 of `what`. --devices N above the devices this process sees is
    refused by `serve.build` (counting them starts JAX's backend, which parsing need not)."""

    def parse(text: str) -> int:
        try:
            count = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}") from None
        if count < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {count}")
        return count

    return parse


_device_count, _byte_count = _positive("device count"), _positive("number of bytes")


def _memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def default_compile_cache() -> str:
    """The server's compile cache when none is named: $HYPIC_JAX_CACHE, else $XDG_CACHE_HOME/hypic-jax, else
    ~/.cache/hypic-jax (the convention of per-user caches)."""
    if os.environ.get("HYPIC_JAX_CACHE"):
        return os.environ["HYPIC_JAX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hypic-jax")


def _serve(args: argparse.Namespace) -> int:
    if args.compile_cache is None:  # the default folder; one that cannot be made is skipped with a warning
        folder = default_compile_cache()
        try:
            os.makedirs(folder, exist_ok=True)
            args.compile_cache = folder
        except OSError as error:
            print(f"hypic-jax serve: warning: no compile cache ({folder}: {error.strerror}); every start compiles",
                  file=sys.stderr)
    elif args.compile_cache.lower() == "none":
        args.compile_cache = None
    # before JAX's backend starts (it reads the variable once): an explicit flag wins, else the environment's
    # value, else DEFAULT_GPU_MEMORY_FRACTION
    if args.gpu_memory_fraction is not None or "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        fraction = args.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"
    from hypic_jax.serve.app import main as serve_main

    return serve_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypic-jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="convert a Hugging Face checkpoint folder to an orbax checkpoint")
    convert.add_argument("src", help="folder with config.json and *.safetensors")
    convert.add_argument("dst", help="output folder (loadable with hypic_jax.load)")
    convert.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    convert.set_defaults(run=_convert)
    diag = commands.add_parser("diag", help="per-layer hidden-state deviation of a PIC mode vs full recompute")
    diag.add_argument("model", help="model folder (orbax checkpoint or Hugging Face folder)")
    diag.add_argument("--segments", nargs="+", required=True,
                      help="segments, the last one the query (one string is split on --separator)")
    diag.add_argument("--token-ids", action="store_true", help="segments are whitespace/comma separated token ids")
    diag.add_argument("--mode", default=None, help="mode to compare (default transition_rope_recompute)")
    diag.add_argument("--seam", type=float, default=None, help="seam knob (default 8 tokens)")
    diag.add_argument("--separator", default="<<PIC_SEP>>")
    diag.add_argument("--dtype", default="bfloat16")
    diag.set_defaults(run=_diag)
    serve = commands.add_parser("serve", help="an OpenAI-compatible server with continuous batching")
    serve.add_argument("model", nargs="?", default=None,
                       help="model folder (orbax checkpoint or Hugging Face folder); default: the model embedded in "
                       "the package, else a tiny random-weight model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--mode", default="transition_rope_recompute", help="default PIC mode (per request: pic_mode)")
    serve.add_argument("--seam", type=float, default=8, help="default seam (per request: seam)")
    serve.add_argument("--cache-gb", type=float, default=1.0, help="segment cache budget, GiB (allocated up front)")
    serve.add_argument("--host-cache-gb", type=float, default=0.0,
                       help="host-memory tier below the device cache, GiB (0: off); evicted entries are demoted "
                            "there and promoted back on a hit")
    serve.add_argument("--disk-cache-dir", default=None,
                       help="disk tier folder (one checksummed file per entry): entries evicted below the host "
                            "tier, and every entry on a graceful shutdown, so a restarted server serves them")
    serve.add_argument("--disk-cache-gb", type=float, default=None, help="disk tier budget, GiB (default: unbounded)")
    serve.add_argument("--peer-cache-gb", type=float, default=0.0,
                       help="with --devices N >= 2: a tier of this many GiB on each other device, between the first "
                            "device's cache and the host tier (0: off)")
    serve.add_argument("--eviction", default="cost", choices=["cost", "lru"],
                       help="tier eviction: cost (recompute time saved per byte; entries cheaper to recompute than "
                            "to load are not kept in a tier) or lru")
    serve.add_argument("--tier-dtype", default=None, choices=["bfloat16"],
                       help="store float32 pieces of entries below the device (T, S) in this dtype (default: as held)")
    serve.add_argument("--max-queue", type=int, default=256, help="requests waiting before 429")
    serve.add_argument("--max-batch", type=int, default=None,
                       help="requests decoding at once (rows of the preallocated decode cache; a step's cost grows "
                            "little with rows: bench/RESULTS.md, decode_step.py); default 64 on an accelerator, 8 "
                            "on the CPU")
    serve.add_argument("--max-prompt-tokens", type=int, default=4096)
    serve.add_argument("--max-new-tokens", type=int, default=256)
    serve.add_argument("--max-segments", type=int, default=64)
    serve.add_argument("--max-request-bytes", type=_byte_count, default=None, metavar="BYTES",
                       help="largest request body; a larger one is refused with 413 before it is read whole. "
                            "Default: 256 bytes per --max-prompt-tokens token plus 1 MiB (2 MiB at 4096)")
    serve.add_argument("--token-rungs", default=None, help="comma-separated token capacities (default: a ladder)")
    serve.add_argument("--separator", default="<<PIC_SEP>>", help="segment separator in prompt text")
    serve.add_argument("--request-timeout", type=float, default=600.0, help="per-request deadline, seconds")
    serve.add_argument("--compile-cache", default=None, metavar="DIR|none",
                       help="folder for compiled programs (stored whole, and JAX's persistent compilation cache): "
                            "a restarted server loads them instead of compiling. Default: $HYPIC_JAX_CACHE, else "
                            "$XDG_CACHE_HOME/hypic-jax, else ~/.cache/hypic-jax; 'none': compile every start. "
                            "Whoever can write the folder can make the server run code: keep it private")
    serve.add_argument("--devices", type=_device_count, default=None, metavar="N",
                       help="prefill a request's cold (missing) segments in parallel over the first N devices, one "
                            "bin of segments per device (hypic_jax.segment_mesh); the entry pools, the stitched "
                            "prefill and decoding stay on the first device. Default: one device")
    serve.add_argument("--tensor-parallel-size", "--tp", type=_device_count, default=None, metavar="M",
                       help="split the model, the entry pools and every program over the first M devices (tensor "
                            "parallelism: StableEngine(tensor_parallel=M)); not with the host, disk or peer tiers. "
                            "Default: one device")
    serve.add_argument("--policy", default="lpt", choices=POLICIES,
                       help="how --devices splits the cold segments: lpt (costliest first onto the least-loaded "
                            "device, on a cost model calibrated at warmup) or rr (round-robin); default lpt")
    serve.add_argument("--slot-layouts", default="auto", choices=["default", "auto"],
                       help="memory layouts of the batched decode cache: auto (the compiler picks them for the "
                            "decode step; the default) or default (row-major); StableEngine(slot_layouts=...)")
    serve.add_argument("--overlap", action="store_true",
                       help="dispatch each decode step before reading the previous one's ids back "
                            "(hypic_jax.serve.scheduler; off by default until measured on a GPU)")
    serve.add_argument("--gpu-memory-fraction", type=_memory_fraction, default=None, metavar="F",
                       help=f"the share of the accelerator's memory JAX may take (XLA_PYTHON_CLIENT_MEM_FRACTION; "
                            f"default: the variable's value if set, else {DEFAULT_GPU_MEMORY_FRACTION})")
    serve.add_argument("--dtype", default="bfloat16")
    serve.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights of MODEL's architecture and config (for measuring shapes whose "
                            "weights are not at hand; the output is noise)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(run=_serve)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"hypic-jax {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
