"""The adaptive seam (`hypic_jax.engine.adaptive_seam.SeamProbe`) against fixed seams, at equal recomputed tokens.

    python bench/adaptive_seam.py [--model FOLDER] [--docs 16 32] [--prompts 6] [--questions 4] \\
        [--fixed 0 1 2 3 4 6 8 12] [--tols 0.15 0.2 0.25 0.3 0.4] [--generate] [--out report.json]

Held-out prompts of the generated corpus (`bench/quality.py`'s), every question asked alone after its prompt's
documents, `transition_rope_recompute` under each seam policy against `full_recompute`:
- seam tokens: the mean seam per document (what the policy recomputes beyond the query);
- KL: KL(full || policy) of the next-token distribution at the end of the prompt (the first answer token), mean
  and 90th percentile: a continuous measure of how far the policy's prompt state is from full recompute's;
- top-1: how often the policy's likeliest first token is full recompute's;
- with --generate, greedy answers: exact match against the gold answer, and agreement with full recompute's.
The probe context is the first documents of a held-out prompt of another seed (`--probe-seed`): text of the same
kind as the documents, unrelated to every prompt measured. The engine's cache is cleared between policies. With
`--rechunk` each prompt's documents are cut again at random places into as many segments (as fixed-size RAG chunks
are): the tokens, and so full recompute, are unchanged, and segments no longer open alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from quality import heldout_prompts

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "hypic_jax" / "assets" / "hypic-qa"


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of two logit vectors, in nats, in float64."""
    p_log = p_logits - np.logaddexp.reduce(p_logits)
    q_log = q_logits - np.logaddexp.reduce(q_logits)
    return float(np.sum(np.exp(p_log) * (p_log - q_log)))


def run(args) -> dict:
    import jax

    import hypic_jax
    from hypic_jax.engine import Engine, seam_tokens
    from hypic_jax.engine.adaptive_seam import SeamProbe, knob
    from hypic_jax.train import tokenizer as tok

    folder = Path(args.model).resolve()
    model = hypic_jax.load(folder, dtype=args.dtype)
    tokenizer = tok.load_tokenizer(folder)
    eos = tokenizer.token_to_id(tok.EOS)
    engine = Engine(model, tokenizer=tokenizer, max_prompt_tokens=args.max_tokens, max_segments=max(args.docs) + 1,
                    max_new_tokens=args.max_new_tokens, max_batch=1)
    (_, probe_prompt), = heldout_prompts(args.probe_seed, [args.probe_docs], 1, 1, args.filler)
    probe = [t for d in probe_prompt.documents for t in tok.encode(tokenizer, tok.document_text(d))]
    prober = SeamProbe(engine, probe, window=args.window)

    cases = []
    cut = np.random.default_rng(args.seed + 1)
    for n, prompt in heldout_prompts(args.seed, args.docs, args.prompts, args.questions, args.filler):
        docs = [tok.encode(tokenizer, tok.document_text(d)) for d in prompt.documents]
        if args.rechunk:  # the same tokens cut at random places: segments that open mid-sentence
            tokens = [t for d in docs for t in d]
            bounds = [0, *sorted(cut.choice(np.arange(1, len(tokens)), len(docs) - 1, replace=False)), len(tokens)]
            docs = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
        for q in prompt.questions:
            query = tok.encode(tokenizer, tok.question_text(q.text))
            gold = tok.encode(tokenizer, tok.answer_text(q.answer))[:-1]
            if sum(map(len, docs)) + len(query) + len(gold) + 2 <= args.max_tokens:
                cases.append((n, docs, query, gold))

    started = time.perf_counter()
    probe_s = time.perf_counter()
    for _, docs, _, _ in cases:
        for doc in docs:
            prober.deviation(doc)
    probe_s = time.perf_counter() - probe_s
    engine.clear_cache()

    def answer(segments, **kw):
        out = engine.generate(segments, max_new_tokens=args.max_new_tokens, stop=[eos], **kw)
        return [t for t in out.tokens if t != eos]

    full_logits, full_answers = [], []
    for _, docs, query, _ in cases:
        full_logits.append(np.asarray(engine.prefill(docs + [query], mode="full_recompute").logits, np.float64))
        if args.generate:
            full_answers.append(answer(docs + [query], mode="full_recompute"))
    policies = [("fixed", s) for s in args.fixed] + [("adaptive", t) for t in args.tols]
    rows = []
    for kind, value in policies:
        engine.clear_cache()
        kls, top1, em, agree, seam_sum, doc_count = [], [], [], [], 0, 0
        for i, (_, docs, query, gold) in enumerate(cases):
            segments = docs + [query]
            if kind == "fixed":
                seams = [knob(min(int(value), len(d)), len(d)) for d in docs]
            else:
                seams = prober.seams(segments, tol=value)
            seam_sum += sum(seam_tokens(s, len(d)) for s, d in zip(seams, docs))
            doc_count += len(docs)
            logits = np.asarray(engine.prefill(segments, mode="transition_rope_recompute", seam=seams).logits,
                                np.float64)
            kls.append(kl(full_logits[i], logits))
            top1.append(int(np.argmax(logits) == np.argmax(full_logits[i])))
            if args.generate:
                pred = answer(segments, mode="transition_rope_recompute", seam=seams)
                em.append(int(pred == gold))
                agree.append(int(pred == full_answers[i]))
        row = dict(policy=kind, value=value, seam_tokens=round(seam_sum / doc_count, 3),
                   kl_mean=float(np.mean(kls)), kl_p90=float(np.quantile(kls, 0.9)), top1=float(np.mean(top1)),
                   exact_match=float(np.mean(em)) if em else None, agreement=float(np.mean(agree)) if agree else None)
        rows.append(row)
        print(_line(row), flush=True)
    full_em = None
    if args.generate:
        full_em = float(np.mean([int(a == g) for a, (_, _, _, g) in zip(full_answers, cases)]))
    name = "the embedded model" if folder == DEFAULT_MODEL else folder.name
    return dict(model=name, device=str(jax.devices()[0]), dtype=args.dtype, docs=args.docs,
                prompts=args.prompts, questions=args.questions, filler=args.filler, seed=args.seed,
                probe_seed=args.probe_seed, probe_tokens=len(probe), rechunk=args.rechunk, window=args.window, cases=len(cases),
                probe_seconds=round(probe_s, 1), seconds=round(time.perf_counter() - started, 1),
                full_recompute_exact_match=full_em, policies=rows)


def _line(row: dict) -> str:
    label = f"{row['policy']} {row['value']:g}"
    extra = "" if row["exact_match"] is None else f"  EM {row['exact_match']:.3f}  agree {row['agreement']:.3f}"
    return (f"{label:16s} seam tokens {row['seam_tokens']:6.2f}  KL {row['kl_mean']:.4f} (p90 {row['kl_p90']:.4f})"
            f"  top-1 {row['top1']:.3f}{extra}")


def print_table(report: dict) -> None:
    print(f"\n{report['cases']} questions, documents {report['docs']}, full_recompute exact match "
          f"{report['full_recompute_exact_match']}")
    print("| policy | seam tokens per document | KL mean | KL p90 | top-1 = full | exact match | answer = full |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(report["policies"], key=lambda r: r["seam_tokens"]):
        em = "" if r["exact_match"] is None else f"{r['exact_match']:.3f}"
        ag = "" if r["agreement"] is None else f"{r['agreement']:.3f}"
        name = f"fixed {r['value']:g}" if r["policy"] == "fixed" else f"adaptive, tol {r['value']:g}"
        print(f"| {name} | {r['seam_tokens']:.2f} | {r['kl_mean']:.4f} | {r['kl_p90']:.4f} | {r['top1']:.3f} | "
              f"{em} | {ag} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a Hugging Face folder with tokenizer.json")
    parser.add_argument("--docs", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--prompts", type=int, default=6, help="prompts per number of documents")
    parser.add_argument("--questions", type=int, default=4, help="questions per prompt, each asked on its own")
    parser.add_argument("--filler", type=int, default=2)
    parser.add_argument("--fixed", type=int, nargs="*", default=[0, 1, 2, 3, 4, 6, 8, 12])
    parser.add_argument("--tols", type=float, nargs="*", default=[0.15, 0.2, 0.25, 0.3, 0.4])
    parser.add_argument("--window", type=int, default=32, help="the adaptive seam's longest seam")
    parser.add_argument("--probe-seed", type=int, default=999, help="the held-out prompt the probe context is from")
    parser.add_argument("--probe-docs", type=int, default=2, help="its documents in the probe context")
    parser.add_argument("--rechunk", action="store_true",
                        help="cut each prompt's documents, concatenated, into as many segments at random places "
                             "(the same tokens: full recompute is unchanged; segments open mid-sentence)")
    parser.add_argument("--generate", action="store_true", help="also greedy answers: exact match and agreement")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = run(args)
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
