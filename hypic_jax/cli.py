"""Command line: `hypic-jax convert SRC DST` (Hugging Face folder -> orbax checkpoint, or with `--quantize fp8` ->
a Hugging Face folder in the block-wise FP8 format), `hypic-jax diag MODEL
--segments ...` (per-layer deviation of a PIC mode from full recompute) and `hypic-jax serve [MODEL]` (an
OpenAI-compatible server, `hypic_jax.serve`).

The verbs that build an engine take every `EngineOptions` field as a flag (`hypic_jax.engine.options`: one flag per
field, with the field's default, help text and check), `serve` also `ServerOptions`'s."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hypic_jax.engine.options import GROUPS, EngineOptions
from hypic_jax.options import add_arguments, from_args

# the share of an accelerator's memory the server lets JAX take (JAX's own default is 0.75: on a 141 GB H200 that
# leaves 35 GB unused, and the 35B-A3B shape with a 24 GB cache does not fit in the rest; vLLM's default is 0.9)
DEFAULT_GPU_MEMORY_FRACTION = 0.9

_GROUP_TITLES = dict(limits="limits and compiled capacities", pools="entry pools", tiers="cache tiers",
                     parallel="parallelism", kernels="kernels", requests="request defaults",
                     scheduler="scheduler", compile="compile cache")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per `EngineOptions` field, grouped as the options are."""
    for name, group in GROUPS.items():
        add_arguments(parser, group, title=f"engine: {_GROUP_TITLES[name]}")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The `EngineOptions` of the flags given (the others at their defaults)."""
    return EngineOptions(**{name: from_args(group, args) for name, group in GROUPS.items()})


QUANTIZE_HELP = ("fp8: the projections and experts as block-wise FP8 weights (float8_e4m3fn, a float32 scale per 128 "
                 "x 128 block), quantized as they load; a folder already in FP8 loads as FP8 without it")


def _convert(args: argparse.Namespace) -> int:
    from hypic_jax.checkpoint.hf import convert_folder, quantize_folder
    from hypic_jax.checkpoint import max_context, save_checkpoint

    start = time.perf_counter()
    if args.quantize == "fp8":
        model_type = quantize_folder(args.src, args.dst)
        print(f"quantized {args.src} ({model_type}) -> {args.dst} (block-wise FP8) in "
              f"{time.perf_counter() - start:.1f} s")
        return 0
    model_type, config, params = convert_folder(args.src, args.dtype)
    save_checkpoint(args.dst, model_type=model_type, config=config, params=params, dtype=args.dtype,
                    max_context=max_context(args.src))
    print(f"converted {args.src} ({model_type}) -> {args.dst} in {time.perf_counter() - start:.1f} s")
    return 0


def _diag(args: argparse.Namespace) -> int:
    from hypic_jax.engine import Engine

    with Engine.from_pretrained(args.model, dtype=args.dtype, options=args.engine_options,
                                quantize=args.quantize) as engine:
        segments = args.segments if len(args.segments) > 1 else args.segments[0]  # one string: split on separator
        if args.token_ids:
            segments = [[int(t) for t in s.replace(",", " ").split()] for s in args.segments]
        rows = engine.diagnose(segments)
        print(f"{'layer':>6} {'kind':<7} {'relative deviation vs full recompute':>38}")
        for row in rows:
            print(f"{row['layer']!s:>6} {row['kind']:<7} {row['deviation']:>38.3e}")
        print(json.dumps(dict(mode=engine.mode, seam=engine.seam, rows=rows)))
    return 0


def _memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def _serve(args: argparse.Namespace) -> int:
    # before JAX's backend starts (it reads the variable once): an explicit flag wins, else the environment's
    # value, else DEFAULT_GPU_MEMORY_FRACTION
    if args.gpu_memory_fraction is not None or "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        fraction = args.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:g}"
    from hypic_jax.serve.app import main as serve_main

    return serve_main(args)


def parser() -> argparse.ArgumentParser:
    from hypic_jax.serve.app import ServerOptions

    top = argparse.ArgumentParser(prog="hypic-jax", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="convert a Hugging Face checkpoint folder to an orbax checkpoint, "
                                  "or quantize it to a block-wise FP8 Hugging Face folder")
    convert.add_argument("src", help="folder with config.json and *.safetensors")
    convert.add_argument("dst", help="output folder (loadable with hypic_jax.load)")
    convert.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    convert.add_argument("--quantize", choices=["fp8"], default=None,
                         help="fp8: write DST as a Hugging Face folder with the projection and expert weights in "
                              "block-wise FP8 (128 x 128 blocks, the format of the '-FP8' releases; the other "
                              "tensors as they are; --dtype does not apply)")
    convert.set_defaults(run=_convert)

    diag = commands.add_parser("diag", help="per-layer hidden-state deviation of a PIC mode vs full recompute")
    diag.add_argument("model", help="model folder (orbax checkpoint or Hugging Face folder)")
    diag.add_argument("--segments", nargs="+", required=True,
                      help="segments, the last one the query (one string is split on --separator)")
    diag.add_argument("--token-ids", action="store_true", help="segments are whitespace/comma separated token ids")
    diag.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    diag.add_argument("--quantize", default=None, choices=["fp8"], help=QUANTIZE_HELP)
    add_engine_arguments(diag)
    diag.set_defaults(run=_diag)

    serve = commands.add_parser("serve", help="an OpenAI-compatible server with continuous batching")
    serve.add_argument("model", nargs="?", default=None,
                       help="model folder (orbax checkpoint or Hugging Face folder); default: the model embedded in "
                       "the package, else a tiny random-weight model")
    serve.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    serve.add_argument("--quantize", default=None, choices=["fp8"], help=QUANTIZE_HELP)
    serve.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights of MODEL's architecture and config (for measuring shapes whose "
                            "weights are not at hand; the output is noise)")
    serve.add_argument("--gpu-memory-fraction", type=_memory_fraction, default=None, metavar="F",
                       help=f"the share of the accelerator's memory JAX may take (XLA_PYTHON_CLIENT_MEM_FRACTION; "
                            f"default: the variable's value if set, else {DEFAULT_GPU_MEMORY_FRACTION})")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_arguments(serve, ServerOptions, title="server")
    add_engine_arguments(serve)
    serve.set_defaults(run=_serve)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command != "convert":
            args.engine_options = engine_options(args)
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"hypic-jax {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
