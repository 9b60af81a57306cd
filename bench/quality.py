"""Answer quality of every engine mode on held-out prompts of the generated corpus (hypic_jax.train.corpus).

For each prompt (documents as cached segments, then one question as the query segment) every mode of
`hypic_jax.engine.MODES` generates greedily until `<|eos|>`. Scores: exact match of the answer's tokens, and token
F1 for answers of several tokens (exact match for one-token answers), per task family, per number of documents and
per position of the answer's document (quarters of the prompt, by the last document its evidence lists: the
colleague's for multihop, the changing one for update; count questions, whose evidence is everywhere, are left out
of the positions), and crossed: per family and number of documents, per position and number of documents, per family
and position; beside the floor of answering every question of a family with its most frequent answer
(`most_frequent_answer`). `--families` picks the task families of the held-out prompts (the four of
`corpus.FAMILIES` by default; `update`, a value a later document changed, only when named); for update questions the
report also gives the share of answers that are the earlier, replaced value (`stale`). Held-out prompts come from a
seed stream of their own (four mixed integers, where training mixes three), so they are not training prompts.
`--seams` adds transition_rope_recompute at each seam (tokens, or a fraction < 1 of the segment); `--transformers`
adds transformers' own greedy generation on the whole prompt, an independent check of full_recompute.

`--entry-forms` runs every mode that reads cache entries once per form of the entries: "device" (the default: an
entry stays in the device pools as it was recorded), "float32", "bfloat16" and "bfloat16+t<=TOL" (`Engine`'s
host tier with `tier_dtype` None or "bfloat16", the last with `tier_transfer_tol` TOL, which leaves out the dense
T heads whose largest |entry| is at most TOL: before every question all device entries are demoted to the host tier, so
each of the question's documents is promoted back from the stored form; the first question of a prompt is preceded
by a prefill of the same request that records the entries, so no answer reads an entry that did not go through the
stored form). Each such question checks, in `engine.stats["tiers"]`, that its hits were all host promotions and
that nothing was prefilled cold. Reported per form: the promotions, the bytes per token of the entries in the host
tier, and the share of identical answers between the forms; and the bytes per token of an entry in each form at
the model's shape and at the Qwen3.5-35B-A3B shape (`bench/prefill.py` `full_config(40)`, bfloat16), for a
512-token segment with the seam's tokens left out (per segment token).

    python bench/quality.py --model DIR [--docs 2 4 8 16] [--prompts 8] [--seams 0 1 2 4 8 16 32 0.05]
    python bench/quality.py --modes transition_rope_recompute --entry-forms float32 bfloat16   # compact entries
    python bench/quality.py --small --model DIR     # CPU size: a few prompts of 2 and 4 documents
    python bench/quality.py --quantize fp8          # the same model with block-wise FP8 weights
    python bench/quality.py --from-json REPORT --plot quality.png   # print and draw a saved report
    python bench/quality.py --model DIR --families single multihop count needle update --docs 16 32 64 128 \
        --filler 20 --max-tokens 32768 --prompts 4 --questions 16      # long context: prompts up to 27k tokens
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import numpy as np


def heldout_prompts(seed: int, docs: list[int], prompts: int, questions: int, filler: int, families=None):
    from hypic_jax.train import corpus, trainer

    for n in docs:
        for i in range(prompts):
            yield n, trainer.heldout_prompt(seed, n, i, questions, filler, tuple(families or corpus.FAMILIES))


def token_f1(pred: list[int], gold: list[int]) -> float:
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def position_bucket(question, num_docs: int) -> str | None:
    if question.family == "count":
        return None
    quarter = min(3, 4 * question.evidence[-1] // num_docs)
    return f"q{quarter + 1}"


# entry form -> the host tier's (tier_dtype, tier_transfer_tol); "device" keeps entries in the pools
ENTRY_FORMS = {"device": None, "float32": (None, None), "bfloat16": ("bfloat16", None),
               "bfloat16+t<=0": ("bfloat16", 0.0), "bfloat16+t<=1e-3": ("bfloat16", 1e-3)}


def entry_shapes(model, tokens: int = 512, seam: int = 8) -> dict:
    """Bytes per token of an entry as the pools hold it and with every float32 piece in bfloat16, at the model's
    shape and the 35B-A3B shape (dense T heads dropped off the device depend on the data: `entries` measures
    them)."""
    import jax.numpy as jnp

    from cache_tiers import entry_bytes_per_token
    from common import full_config

    from hypic_jax.models import qwen3_5

    out = {}
    for name, layout in (("model", model.arch.pool_layout(model.config, model.dtype)),
                         ("35B-A3B", qwen3_5.pool_layout(full_config(40), jnp.bfloat16))):
        exact, compact = (entry_bytes_per_token(layout, tokens, c, seam) for c in (False, True))
        out[name] = dict(float32=round(exact, 1), bfloat16=round(compact, 1), ratio=round(exact / compact, 3))
    return dict(segment_tokens=tokens, seam=seam, **out)


def transformers_reference(folder: Path):
    """transformers' float32 model of the folder."""
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def run(args) -> dict:
    import jax

    import hypic_jax
    from hypic_jax.engine import Engine
    from hypic_jax.train import tokenizer as tok

    folder = Path(args.model)
    reference = transformers_reference(folder) if args.transformers else None  # before the modes: fail early
    model = hypic_jax.load(folder, dtype=args.dtype, quantize=args.quantize)
    tokenizer = tok.load_tokenizer(folder)
    eos = tokenizer.token_to_id(tok.EOS)
    cases = []  # (num_docs, doc segments, question segment, gold ids, question)
    skipped = 0
    families = getattr(args, "families", None)
    stale = {}  # question -> the earlier value's ids (update questions)
    for n, prompt in heldout_prompts(args.seed, args.docs, args.prompts, args.questions, args.filler, families):
        docs = [tok.encode(tokenizer, tok.document_text(d)) for d in prompt.documents]
        for q in prompt.questions:
            query = tok.encode(tokenizer, tok.question_text(q.text))
            gold = tok.encode(tokenizer, tok.answer_text(q.answer))[:-1]  # without <|eos|>
            if sum(map(len, docs)) + len(query) + len(gold) + 2 > args.max_tokens:
                skipped += 1
                continue
            cases.append((n, docs, query, gold, q))
            if q.distractor:
                stale[id(q)] = tok.encode(tokenizer, tok.answer_text(q.distractor))[:-1]
    forms = list(dict.fromkeys(getattr(args, "entry_forms", None) or ["device"]))
    runs = [(mode, None, form) for mode in args.modes for form in (forms[:1] if mode == "full_recompute" else forms)]
    runs += [("transition_rope_recompute", s, form) for s in args.seams for form in forms]
    engines = {}
    for form in {form for *_, form in runs}:
        tiers = {} if form == "device" else dict(host_cache_bytes=1 << 40, eviction="lru",
                                                   tier_dtype=ENTRY_FORMS[form][0],
                                                   tier_transfer_tol=ENTRY_FORMS[form][1])
        engines[form] = Engine(model, tokenizer=tokenizer, max_prompt_tokens=args.max_tokens,
                               max_segments=max(args.docs) + 1, max_new_tokens=args.max_new_tokens, seam=args.seam,
                               max_batch=1, **tiers)
        if form.startswith("bfloat16"):  # the host tier really stores T and S rounded
            assert any(dtype == np.dtype(jax.numpy.bfloat16) for *_, dtype in engines[form].mover.leaves)
    scores = collections.defaultdict(list)  # (run label, axis, value) -> [(em, f1)]
    predictions = collections.defaultdict(list)  # run label -> predicted answers, in case order
    entries = {}  # run label -> how its entries were served and stored
    same_run = collections.defaultdict(dict)  # label without the form -> form -> label
    started = time.perf_counter()
    for mode, seam, form in runs:
        base = mode if seam is None else f"trr@seam={seam:g}"
        label = base if form == "device" or mode == "full_recompute" else f"{base} [{form}]"
        same_run[base][form] = label
        engine = engines[form]
        engine.clear_cache()
        tiered = form != "device" and mode != "full_recompute"
        recorded, served = set(), collections.Counter()
        for n, docs, query, gold, q in cases:
            segments, seam_of_run = docs + [query], args.seam if seam is None else seam
            if tiered:
                prompt = tuple(map(tuple, docs))
                if prompt not in recorded:  # record the entries before the prompt's first question
                    engine.prefill(segments, mode=mode, seam=seam_of_run)
                    recorded.add(prompt)
                engine.demote_all()
                before = engine.stats["tiers"]["promotions"]
            out = engine.generate(segments, max_new_tokens=len(gold) + 3, stop=[eos], mode=mode, seam=seam_of_run)
            if tiered:
                promoted = {t: engine.stats["tiers"]["promotions"][t] - before[t] for t in before}
                st = out.stats
                if st.misses or st.cold_tokens or promoted["host"] != st.hits or promoted["disk"]:
                    raise RuntimeError(f"{label}: a question was not served from promoted {form} entries "
                                       f"(hits {st.hits}, misses {st.misses}, cold tokens {st.cold_tokens}, "
                                       f"promotions {promoted})")
                served["questions"] += 1
                served["promotions"] += promoted["host"]
                served["cached_tokens"] += st.cached_tokens
            predictions[label].append(_strip(list(out.tokens), eos))
            _record(scores, label, n, q, predictions[label][-1], gold, stale.get(id(q)))
        if tiered:
            engine.demote_all()
            held = engine.tiers.host.values()
            stored, stored_tokens = sum(p.nbytes for p in held), sum(len(p.tokens) for p in held)
            kept = [(len(p.kept[j]), engine.mover.leaves[j][1][0]) for p in held for j in p.kept]
            entries[label] = dict(form=form, **served, entries=len(held), bytes=stored,
                                  bytes_per_segment_token=round(stored / max(stored_tokens, 1), 1),
                                  transfer_heads_stored=round(sum(k for k, _ in kept) / sum(h for _, h in kept), 4)
                                  if kept else None,
                                  stored_dtypes=sorted({a.dtype.name for p in held for a in p.arrays}))
    if reference is not None:
        import torch

        for n, docs, query, gold, q in cases:
            ids = torch.tensor([[t for s in docs for t in s] + query])
            with torch.no_grad():
                out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(gold) + 3,
                                         do_sample=False, eos_token_id=eos, pad_token_id=eos)
            predictions["transformers"].append(_strip(out[0, ids.shape[1]:].tolist(), eos))
            _record(scores, "transformers", n, q, predictions["transformers"][-1], gold, stale.get(id(q)))
    # a floor to read the scores against: every question of a family answered with that family's most frequent
    # answer among these cases (counts are small numbers, so this floor is high for them)
    common = {}
    for family in {q.family for *_, q in cases}:
        golds = collections.Counter(tuple(g) for _, _, _, g, q in cases if q.family == family)
        common[family] = list(golds.most_common(1)[0][0])
    for n, docs, query, gold, q in cases:
        _record(scores, "most_frequent_answer", n, q, common[q.family], gold)
    table = collections.defaultdict(dict)
    for (label, axis, value), rows in sorted(scores.items(), key=lambda kv: str(kv[0])):
        em, f1 = np.mean(rows, axis=0)
        table[label][f"{axis}={value}"] = dict(em=round(float(em), 4), f1=round(float(f1), 4), n=len(rows))
    # how often a run generates exactly what full_recompute generates: meaningful even where scores are at chance
    reference = predictions.get("full_recompute")
    agreement = {label: round(float(np.mean([a == b for a, b in zip(preds, reference)])), 4)
                 for label, preds in predictions.items()} if reference else {}
    # how often the same run gives the same answer from entries of another form (against the first form given)
    across_forms = {}
    for base, labels in same_run.items():
        first, *others = list(labels.values())
        for other in others:
            across_forms[f"{other} vs {first}"] = round(float(np.mean(
                [a == b for a, b in zip(predictions[other], predictions[first])])), 4)
    return dict(model=str(folder), device=str(jax.devices()[0]), dtype=args.dtype, quantize=args.quantize, seed=args.seed, docs=args.docs,
                prompts=args.prompts, questions=args.questions, filler=args.filler, families=families,
                cases=len(cases),
                skipped_over_budget=skipped, seconds=round(time.perf_counter() - started, 1), scores=dict(table),
                agreement_with_full_recompute=agreement, entry_forms=forms, entries=entries,
                agreement_across_entry_forms=across_forms,
                entry_bytes_per_token=entry_shapes(model) if any(f != "device" for f in forms) else None,
                samples=[dict(family=q.family, question=q.text, answer=q.answer,
                              full_recompute=tokenizer.decode(pred).strip())
                         for (_, _, _, _, q), pred in zip(cases[:12], predictions.get("full_recompute", []))])


def _strip(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def _record(scores, label, n, q, pred, gold, stale=None) -> None:
    """Score one answer under every axis it belongs to; `stale`: the ids of the value a later document replaced
    (update questions), recorded as axis "stale" (its "em": the share of answers that are that earlier value)."""
    em = float(pred == gold)
    f1 = token_f1(pred, gold) if len(gold) > 1 else em
    keys = [("all", "all"), ("family", q.family), ("docs", n), ("family@docs", f"{q.family}@{n}")]
    bucket = position_bucket(q, n)
    if bucket:
        keys += [("position", bucket), ("position@docs", f"{bucket}@{n}"), ("family@position", f"{q.family}@{bucket}")]
    for axis, value in keys:
        scores[(label, axis, value)].append((em, f1))
    if stale is not None:
        was = float(pred == stale)
        scores[(label, "stale", q.family)].append((was, token_f1(pred, stale) if len(stale) > 1 else was))


def _crossed_order(column: str):
    """Crossed columns ("family@docs=count@16") by their first value, then the second (numbers as numbers)."""
    first, second = column.split("=", 1)[1].rsplit("@", 1)
    return (first, int(second)) if second.isdigit() else (first, 0, second)


def print_tables(report: dict) -> None:
    scores = report["scores"]
    every = {c for row in scores.values() for c in row}
    columns = sorted((c for c in every if "@" not in c.split("=")[0] and not c.startswith("stale=")),
                     key=lambda c: (c.split("=")[0] != "all", c.split("=")[0], c))
    print(f"{report['cases']} questions ({report['skipped_over_budget']} over the token budget skipped), "
          f"model {report['model']}, {report['device']}; cells: F1 (exact match for one-token answers)")
    agreement = report.get("agreement_with_full_recompute", {})
    print(f"{'run':<38}{'EM all':>8}{'same as full':>14}" + "".join(f"{c:>17}" for c in columns))
    for label, row in scores.items():
        same = f"{agreement[label]:>14.3f}" if label in agreement else f"{'':>14}"
        print(f"{label:<38}{row['all=all']['em']:>8.3f}{same}"
              + "".join(f"{row[c]['f1']:>17.3f}" if c in row else f"{'':>17}" for c in columns))
    # exact match per (family, number of documents), (position, number of documents), (family, position), with the
    # questions per cell
    for axis, words in (("family@docs", "family and number of documents"),
                        ("position@docs", "quarter of the prompt holding the answer and number of documents"),
                        ("family@position", "family and quarter of the prompt holding the answer")):
        crossed = sorted((c for c in every if c.startswith(axis + "=")), key=_crossed_order)
        if not crossed:
            continue
        print(f"exact match per {words} (questions per cell in the first row)")
        names = [c.split("=", 1)[1] for c in crossed]
        print(f"{'run':<38}" + "".join(f"{n:>13}" for n in names))
        first = next(iter(scores.values()))
        print(f"{'(questions)':<38}" + "".join(f"{first.get(c, {}).get('n', 0):>13}" for c in crossed))
        for label, row in scores.items():
            print(f"{label:<38}" + "".join(f"{row[c]['em']:>13.3f}" if c in row else f"{'':>13}" for c in crossed))
    stale = sorted(c for c in every if c.startswith("stale="))
    for column in stale:  # how often a run answers with the value a later document replaced
        family = column.split("=", 1)[1]
        print(f"{family}: share of answers that are the earlier, replaced value (exact match against it): "
              + ", ".join(f"{label} {row[column]['em']:.3f}" for label, row in scores.items() if column in row))
    for label, info in (report.get("entries") or {}).items():
        print(f"{label}: {info['questions']} questions served from {info['promotions']} host promotions "
              f"({info['cached_tokens']} cached tokens); {info['entries']} entries stored as "
              f"{'/'.join(info['stored_dtypes'])}, {info['bytes_per_segment_token']:,.1f} bytes per segment token"
              + (f", {info['transfer_heads_stored']:.1%} of T's heads stored"
                 if info.get("transfer_heads_stored") is not None else ""))
    for pair, share in (report.get("agreement_across_entry_forms") or {}).items():
        print(f"same answer, {pair}: {share:.4f}")
    shapes = report.get("entry_bytes_per_token")
    if shapes:
        for name in ("model", "35B-A3B"):
            row = shapes[name]
            print(f"entry of a {shapes['segment_tokens']}-token segment, seam {shapes['seam']}, {name} shape: "
                  f"{row['float32']:,.1f} bytes per token exact, {row['bfloat16']:,.1f} with bfloat16 T and S "
                  f"({row['ratio']:.3f}x smaller)")


def plot(report: dict, path: str) -> None:
    """Two panels: F1 per task family of each mode (beside the most-frequent-answer floor), and the seam ablation
    (transition_rope_recompute against the seam, between addition and full_recompute)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = report["scores"]
    modes = [m for m in scores if not m.startswith("trr@") and m != "transformers"]
    families = sorted({c.split("=", 1)[1] for row in scores.values() for c in row if c.startswith("family=")})
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw=dict(width_ratios=[3, 2]))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [scores[mode].get(f"family={f}", {}).get("f1", 0.0) for f in families] + [scores[mode]["all=all"]["f1"]]
        left.bar(np.arange(len(families) + 1) + (i - (len(modes) - 1) / 2) * width, values, width, label=mode)
    left.set_xticks(np.arange(len(families) + 1), families + ["all"])
    left.set_ylabel("F1 (exact match for one-token answers)")
    left.set_ylim(0, 1.05)
    left.legend(fontsize=7, ncol=2)
    left.set_title(f"{report['cases']} held-out questions, {', '.join(map(str, report['docs']))} documents")
    seams = sorted((float(m.split("=")[1]), m) for m in scores if m.startswith("trr@"))
    if seams:
        labels = [f"{v:g}" if v >= 1 or v == 0 else f"{v:.0%}" for v, _ in seams]
        right.plot(range(len(seams)), [scores[m]["all=all"]["f1"] for _, m in seams], "o-",
                   label="transition_rope_recompute")
        for mode, style in (("full_recompute", "--"), ("addition", ":")):
            if mode in scores:
                right.axhline(scores[mode]["all=all"]["f1"], linestyle=style, color="gray", label=mode)
        right.set_xticks(range(len(seams)), labels)
        right.set_xlabel("seam (tokens, or a fraction of each segment)")
        right.set_ylabel("F1, all questions")
        right.set_ylim(0, 1.05)
        right.legend(fontsize=8)
        right.set_title("seam ablation")
    else:
        right.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    from hypic_jax.engine import MODES
    from hypic_jax.train import EMBEDDED_MODEL
    from hypic_jax.train.corpus import ALL_FAMILIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face folder with tokenizer.json (default: the "
                        "embedded model)")
    parser.add_argument("--small", action="store_true", help="CPU size: 2 and 4 documents, 2 prompts of 4 "
                        "questions each, prompts up to 1024 tokens (options given explicitly win)")
    parser.add_argument("--docs", type=int, nargs="+", default=None, help="documents per prompt (2 4 8 16)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per number of documents (8)")
    parser.add_argument("--questions", type=int, default=None, help="questions per prompt, each asked on its own (8)")
    parser.add_argument("--filler", type=int, default=2, help="filler sentences per document")
    parser.add_argument("--families", nargs="+", default=None, choices=ALL_FAMILIES,
                        help="task families of the held-out prompts (default: the four of corpus.FAMILIES; update "
                        "only when named)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seam", type=float, default=8, help="seam of transition_rope_recompute")
    parser.add_argument("--seams", type=float, nargs="*", default=[], help="seam ablation: trr at each of these")
    parser.add_argument("--entry-forms", nargs="+", default=["device"], choices=list(ENTRY_FORMS),
                        help="run each mode that reads entries with them in each form: device (kept in the pools), "
                        "or promoted from the host tier for every hit: float32 (exact), bfloat16 (every float32 "
                        "piece rounded), bfloat16+t<=TOL (also without the dense T heads at most TOL)")
    parser.add_argument("--transformers", action="store_true", help="also transformers' greedy generation")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest prompt (4096)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", default=None, choices=["fp8"],
                        help="fp8: the projections and experts as block-wise FP8 weights (`hypic_jax.load`)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--plot", default=None, help="draw the report as a PNG here (needs matplotlib: the bench "
                        "extra)")
    parser.add_argument("--from-json", default=None, help="print (and --plot) a saved report instead of running")
    args = parser.parse_args(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        print_tables(report)
        if args.plot:
            plot(report, args.plot)
        return
    preset = dict(docs=[2, 4], prompts=2, questions=4, max_tokens=1024) if args.small else dict(
        docs=[2, 4, 8, 16], prompts=8, questions=8, max_tokens=4096)
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model is None:
        if not EMBEDDED_MODEL.exists():
            parser.error(f"no embedded model at {EMBEDDED_MODEL}; pass --model")
        args.model = str(EMBEDDED_MODEL)
    report = run(args)
    print_tables(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
