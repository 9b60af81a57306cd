"""python -m hypic_jax.train {train,evaluate,export} ...: train a run folder in resumable steps, score it, export it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from hypic_jax.train import corpus, export, trainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hypic_jax.train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (or resume) a run for at most --minutes, then checkpoint")
    t.add_argument("--run", required=True, help="run folder (settings.json, tokenizer.json, checkpoints/)")
    t.add_argument("--size", choices=tuple(trainer.SIZES), default="h200")
    t.add_argument("--smoke", action="store_const", const="smoke", dest="size", help="the CPU size (--size smoke)")
    t.add_argument("--minutes", type=float, default=10.0, help="wall-time limit of this call")
    t.add_argument("--max-steps", type=int, default=None, help="at most this many steps in this call")
    defaults = trainer.Settings()
    for field in dataclasses.fields(trainer.Settings):
        if field.name != "size":
            t.add_argument("--" + field.name.replace("_", "-"), type=type(getattr(defaults, field.name)),
                           default=getattr(defaults, field.name), help="(read from settings.json on resume)")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep the compiled steps in DIR (JAX's persistent compilation cache): a later call on the "
                   "same machine loads them instead of compiling again")
    e = sub.add_parser("export", help="export a run's latest checkpoint as a Hugging Face folder")
    e.add_argument("--run", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--max-position-embeddings", type=int, default=32768)
    e.add_argument("--max-mib", type=float, default=export.MAX_BYTES / 2**20,
                   help="refuse weights over this many MiB (the embedded model's budget; 0: no limit)")
    v = sub.add_parser("evaluate", help="greedy exact match per task family on held-out prompts (teacher forced)")
    v.add_argument("--run", required=True)
    v.add_argument("--docs", type=int, nargs="+", default=[16])
    v.add_argument("--prompts", type=int, default=8)
    v.add_argument("--questions", type=int, default=8)
    v.add_argument("--filler", type=int, default=2, help="filler sentences per document")
    v.add_argument("--families", nargs="+", default=list(corpus.FAMILIES), choices=corpus.ALL_FAMILIES)
    args = parser.parse_args(argv)
    if args.command == "train":
        if args.compile_cache:
            from hypic_jax.engine import use_compile_cache

            use_compile_cache(args.compile_cache)
        settings = trainer.Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(trainer.Settings)})
        state = trainer.train(args.run, settings, minutes=args.minutes, max_steps=args.max_steps,
                              progress=not args.no_progress)
        saved, _ = trainer.prepare_run(args.run, settings)  # a resumed run keeps the settings it started with
        print(f"step {int(state['step'])} of {saved.steps}; {trainer.parameter_count(state['params']):,} parameters")
        log = Path(args.run) / "log.jsonl"
        if log.exists() and log.stat().st_size:
            print("last log line:", log.read_text().splitlines()[-1])
    elif args.command == "evaluate":
        config, params, tokenizer, _ = trainer.load_run(args.run)
        for docs in args.docs:
            scores = trainer.answer_accuracy(params, config, tokenizer, docs, args.prompts, args.questions,
                                             args.filler, families=tuple(args.families))
            print(json.dumps(dict(docs=docs, **scores)))
    else:
        config, params, tokenizer, _ = trainer.load_run(args.run)
        out = export.export_folder(params, config, tokenizer, args.out, args.dtype,
                                   max_bytes=int(args.max_mib * 2**20) if args.max_mib else None,
                                   max_position_embeddings=args.max_position_embeddings)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
