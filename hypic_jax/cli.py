"""Command line: `hypic-jax convert SRC DST [--dtype bfloat16]` (Hugging Face folder -> orbax checkpoint)."""

from __future__ import annotations

import argparse
import sys
import time


def _convert(args: argparse.Namespace) -> int:
    from converters.base import convert_folder, save_checkpoint

    start = time.perf_counter()
    model_type, config, params = convert_folder(args.src, args.dtype)
    save_checkpoint(args.dst, model_type=model_type, config=config, params=params, dtype=args.dtype)
    print(f"converted {args.src} ({model_type}) -> {args.dst} in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypic-jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="convert a Hugging Face checkpoint folder to an orbax checkpoint")
    convert.add_argument("src", help="folder with config.json and *.safetensors")
    convert.add_argument("dst", help="output folder (loadable with hypic_jax.load)")
    convert.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    convert.set_defaults(run=_convert)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"hypic-jax {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
