"""`make demo`: held-out questions to the embedded model, the PIC engine on a tiny in-memory model, then (with
--families) the composition table.

Question part (when the package holds its trained model, `hypic_jax.checkpoint.embedded`, or with --model DIR): a few
held-out questions of the generated corpus (`hypic_jax.train`), each asked after the same documents in another
order, in every mode on the engine (`hypic_jax.Engine`). For each mode it prints the
answer, the cached tokens and the time to first token; the first question of each mode starts from an empty cache,
the later ones find the documents cached. Every program the requests use is compiled, and run once, beforehand by
the same requests, so the times are serving times.

Engine part: a tiny random Qwen3.5-style hybrid (Gated DeltaNet + gated full attention, built in memory, no
download) serves a RAG-shaped request (a few documents and a query, as token ids) twice: cold, then with the documents
shuffled. For every mode it prints the cache hits, the recomputed tokens, the time to first token and how far the
last logits are from full recompute. Compilation is done beforehand on other documents of the same lengths, so the
times are serving times.

Family part (--families): for each linear-attention family a random sequence is cut into segments. Each segment is
summarised on its own (as a cache would store it), then the segments are stitched back together two ways:
  naive:    add the zero-start states (drop T), what earlier position-independent caches do;
  transfer: compose (T, S) pairs with one associative scan.
Both are compared with the full recomputation of the whole sequence, and the cost of building T_C is compared with
the plain chunked pass over the same tokens.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.core import linear_attn as la
from hypic_jax.engine import MODES, Engine
from hypic_jax.engine.programs import backend_compiles
from hypic_jax.models import qwen3_5
from hypic_jax.models.base import Model

FAMILY_BUILDERS = {
    "linear": lambda q, k, v, r: la.linear_attention(q, k, v, scale=k.shape[-1] ** -0.5),
    "retnet": lambda q, k, v, r: la.retnet(q, k, v),
    "lightning": lambda q, k, v, r: la.lightning(q, k, v, layer_factor=0.5),
    "mamba2": lambda q, k, v, r: la.mamba2(
        v, r(v.shape[:2]), A_log=jnp.zeros(v.shape[1]), dt_bias=jnp.full(v.shape[1], -4.0), B=k[:, :1], C=q[:, :1]
    ),
    "gla": lambda q, k, v, r: la.gla(q, k, v, gk=jax.nn.log_sigmoid(r(k.shape) + 3.0) / 4),
    "delta_net": lambda q, k, v, r: la.delta_net(q, k, v, beta=jax.nn.sigmoid(r(v.shape[:2]))),
    "gated_delta_net": lambda q, k, v, r: la.gated_delta_net(
        q, k, v, a=r(v.shape[:2]), b=r(v.shape[:2]), A_log=jnp.zeros(v.shape[1]), dt_bias=jnp.full(v.shape[1], -3.0)
    ),
    "kda": lambda q, k, v, r: la.kda(
        q, k, v, g_raw=r(k.shape), A_log=jnp.zeros(k.shape[1]), dt_bias=jnp.full(k.shape[1:], -3.0), b=r(v.shape[:2])
    ),
}


def median_time(fn, *args, repeats: int = 5) -> float:
    """Median wall time of a jitted call after one compiling call (seconds)."""
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run(segments: int, segment_len: int, heads: int, head_dim: int, chunk_size: int) -> list[dict]:
    length = segments * segment_len
    rows = []
    for index, (name, build) in enumerate(FAMILY_BUILDERS.items()):
        keys = iter(jax.random.split(jax.random.PRNGKey(index), 8))
        rand = lambda shape: jax.random.normal(next(keys), shape)  # noqa: E731
        inputs = build(rand((length, heads, head_dim)), rand((length, heads, head_dim)), rand((length, heads, head_dim)), rand)

        full = jax.jit(lambda inp: inp.chunked(chunk_size=chunk_size))
        _, state_full = full(inputs)
        pieces = jax.tree_util.tree_map(lambda x: x.reshape((segments, segment_len) + x.shape[1:]), inputs)
        summarize = jax.jit(jax.vmap(lambda seg: seg.summarize(chunk_size=chunk_size)))
        summaries = summarize(pieces)  # what a cache stores, one entry per segment
        composed = jax.jit(la.prefix_states)(summaries, None)[-1]
        naive = jnp.sum(summaries.state, axis=0)
        norm = float(jnp.linalg.norm(state_full))
        rows.append(
            dict(
                family=name,
                form=summaries.form,
                naive=float(jnp.linalg.norm(naive - state_full)) / norm,
                transfer=float(jnp.linalg.norm(composed - state_full)) / norm,
                build_cost=median_time(summarize, pieces) / median_time(full, inputs),
            )
        )
    return rows


def tiny_model() -> Model:
    """The demo's model: a tiny random Qwen3.5-style hybrid (3 Gated DeltaNet + 1 full-attention layers, vocabulary
    512, float32), built in memory."""
    config = qwen3_5.Config(
        vocab_size=512, hidden_size=64, layer_types=qwen3_5.default_layer_types(4), mlp_types=("dense",) * 4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128,
    )
    params = qwen3_5.init_params(config, jax.random.key(0), jnp.float32)
    # random-init gates forget within a few tokens; slow them down so that the modes differ visibly
    for layer in params["layers"]:
        if "A_log" in layer["mixer"]:
            layer["mixer"]["A_log"] = jnp.full_like(layer["mixer"]["A_log"], np.log(0.03))
    return Model(qwen3_5, config, params)


def engine_demo(docs: int = 4, doc_len: int = 48, query_len: int = 12, seam: float = 8) -> list[dict]:
    """Run every mode on a cold request, then on the same documents shuffled; returns one row per (mode, request)."""
    model = tiny_model()
    config = model.config
    rng = np.random.default_rng(0)

    def request(seed_docs):
        return [rng.integers(0, config.vocab_size, doc_len).tolist() for _ in range(seed_docs)]

    prompt = docs * doc_len + query_len
    measured = Engine(model, seam=seam, max_prompt_tokens=prompt, token_rungs=(64, prompt), max_segments=docs,
                      max_new_tokens=1, max_batch=1)
    measured.warmup(progress=False)  # every program a request of these lengths uses: no compilation below
    documents, query = request(docs), rng.integers(0, config.vocab_size, query_len).tolist()
    shuffled = [documents[i] for i in rng.permutation(docs)]
    rows = []
    for mode in MODES:
        measured.clear_cache()  # every mode starts cold
        for label, segs in (("cold", documents + [query]), ("shuffled", shuffled + [query])):
            reference = measured.prefill(segs, mode="full_recompute").logits
            result = measured.prefill(segs, mode=mode)
            deviation = float(np.linalg.norm(result.logits - reference) / np.linalg.norm(reference))
            rows.append(dict(result.stats.as_dict(), request=label, deviation=deviation))
    return rows


def print_engine_demo(rows: list[dict]) -> None:
    print(f"hypic-jax engine demo on {jax.devices()[0].platform}: tiny random Qwen3.5-style model (3 GDN + 1 full "
          "attention layers), float32\nrequest: 4 documents x 48 tokens + a 12-token query; run cold, then with the "
          "documents shuffled; seam = 8 tokens\n")
    header = (f"{'mode':<26} {'request':<9} {'hits':>4} {'miss':>4} {'cached':>6} {'recomp':>6} {'cold':>5} "
              f"{'TTFT ms':>8} {'dev vs full':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mode']:<26} {r['request']:<9} {r['hits']:>4} {r['misses']:>4} {r['cached_tokens']:>6} "
              f"{r['recomputed_tokens']:>6} {r['cold_tokens']:>5} {1e3 * r['ttft_s']:>8.1f} {r['deviation']:>11.2e}")
    print("\ncached = tokens served from existing entries, recomp = fresh tokens of the final forward, cold = tokens "
          "prefilled in isolation to create entries; dev = ||logits - full recompute|| / ||full recompute||\n")


QA_FAMILIES = ("single", "multihop", "count", "needle")


def _pick_questions(prompt, count: int) -> list:
    """Up to `count` distinct questions of the prompt, one of each family first."""
    picked, texts = [], set()
    for family in QA_FAMILIES + (None,):
        for q in prompt.questions:
            if len(picked) < count and q.text not in texts and (family is None or q.family == family):
                picked.append(q)
                texts.add(q.text)
                if family is not None:
                    break
    return picked


def qa_demo(folder: str | Path, *, docs: int = 8, questions: int = 4, seed: int = 0, index: int = 0,
            dtype: str | None = None, seam: float = 8, max_new_tokens: int = 16, progress: bool = False) -> dict:
    """Held-out questions to a model folder of `hypic_jax.train` (Hugging Face folder with its tokenizer.json).

    One held-out prompt of `docs` documents (`trainer.heldout_prompt(seed, docs, index)`), `questions` of its
    questions (one per family first), each asked after the documents in a new random order, in every mode of
    `MODES` on one `Engine` (greedy, until `<|eos|>`). Each mode starts from an empty cache. Before the
    reported run, the programs it uses are compiled and the first two questions run once in every mode (the
    result's `timed_compiles` counts compilations during the reported run).
    dtype: None is float32 on the CPU, bfloat16 elsewhere. Returns the documents, the questions with
    their orders, and one row per (question, mode)."""
    import hypic_jax
    from hypic_jax.engine import seam_tokens
    from hypic_jax.train import tokenizer as tok
    from hypic_jax.train import trainer

    folder = Path(folder)
    if dtype is None:
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    model = hypic_jax.load(folder, dtype=dtype)
    tokenizer = tok.load_tokenizer(folder)
    eos = tokenizer.token_to_id(tok.EOS)
    prompt = trainer.heldout_prompt(seed, docs, index, questions=max(16, questions), filler=2)
    asked = _pick_questions(prompt, questions)
    doc_ids = [tok.encode(tokenizer, tok.document_text(d)) for d in prompt.documents]
    query_ids = [tok.encode(tokenizer, tok.question_text(q.text)) for q in asked]
    rng = np.random.default_rng(seed)
    orders = []
    for _ in asked:  # each order differs from the one before it
        order = rng.permutation(docs)
        while docs > 1 and orders and (order == orders[-1]).all():
            order = rng.permutation(docs)
        orders.append([int(i) for i in order])
    requests = [[doc_ids[i] for i in order] + [query] for order, query in zip(orders, query_ids)]
    # two token rungs: one for the fresh tokens of a PIC request (seams and query), one for the whole prompt
    prompt_tokens = sum(map(len, doc_ids)) + max(map(len, query_ids))
    round_up = lambda n: -(-n // 128) * 128  # noqa: E731
    small = round_up(sum(seam_tokens(seam, len(d)) for d in doc_ids) + max(map(len, query_ids)))
    large = max(round_up(prompt_tokens), small)
    rungs = (small,) if small == large else (small, large)
    engine = Engine(model, tokenizer=tokenizer, max_prompt_tokens=large, token_rungs=rungs, max_segments=docs + 1,
                    max_new_tokens=max_new_tokens, seam=seam, cache_bytes=256 << 20, max_batch=1)

    def run_all(count=len(asked)):
        rows = []
        for mode in MODES:
            engine.clear_cache()
            for number, (question, segments) in enumerate(zip(asked[:count], requests[:count])):
                out = engine.generate(segments, max_new_tokens=max_new_tokens, stop=[eos], mode=mode)
                answer = tokenizer.decode([t for t in out.tokens if t != eos]).strip()
                rows.append(dict(out.stats.as_dict(), question=number, answer=answer,
                                 correct=answer == question.answer, finish_reason=out.finish_reason))
        return rows

    started = time.perf_counter()
    # the span programs of the two rungs these requests use, compiled in parallel, and the decode programs; then
    # the first two questions run in every mode (a cold request and one that hits), which takes every path of the
    # timed run
    spans = {("cold", large), ("pic", small), ("plain", large)}
    engine.programs.compile([k for k in engine.programs.keys_for(large)
                             if (k.kind, k.tokens) in spans or k.kind not in ("cold", "pic", "plain", "commit")],
                            progress=progress)
    if progress:
        print("running a cold and a cached request in every mode once (the timed run follows) ...", flush=True)
    run_all(2)
    warm_s = time.perf_counter() - started
    compiles = backend_compiles()
    rows = run_all()
    layer_types = list(model.config.layer_types)
    return dict(
        model=folder.name, dtype=dtype, platform=jax.devices()[0].platform, seam=seam,
        parameters=int(sum(x.size for x in jax.tree.leaves(model.params))),
        linear_layers=sum(t != "full_attention" for t in layer_types),
        full_layers=sum(t == "full_attention" for t in layer_types),
        documents=list(prompt.documents), document_tokens=[len(d) for d in doc_ids],
        questions=[dict(family=q.family, text=q.text, answer=q.answer, evidence=list(q.evidence), order=order,
                        tokens=sum(map(len, segments)))
                   for q, order, segments in zip(asked, orders, requests)],
        rows=rows, programs=engine.stats["programs"]["programs"], warm_s=warm_s,
        timed_compiles=backend_compiles() - compiles)


def print_qa_demo(result: dict, width: int = 116) -> None:
    qs, rows = result["questions"], result["rows"]
    print(textwrap.fill(
        f"hypic-jax questions demo on {result['platform']}: model {result['model']} (Qwen3.5 architecture, "
        f"{result['linear_layers']} Gated DeltaNet + {result['full_layers']} gated attention layers, "
        f"{result['parameters'] / 1e6:.1f}M parameters), {result['dtype']}, seam = "
        f"{result['seam']:g} tokens", width))
    print(textwrap.fill(
        f"{len(result['documents'])} held-out documents ({sum(result['document_tokens'])} tokens); each question is "
        "asked after all of them, every time in another order. Each mode starts from an empty cache: its first "
        "request prefills the documents, the later ones find them cached. Compiled (and run) beforehand: "
        f"{result['programs']} programs, in {result['warm_s']:.0f} s; compiled while timed: "
        f"{result['timed_compiles']}.", width) + "\n")
    print("documents")
    for i, (text, n) in enumerate(zip(result["documents"], result["document_tokens"])):
        print(textwrap.fill(text, width, initial_indent=f"  [{i}] ", subsequent_indent=" " * 6)
              + f" ({n} tokens)")
    header = f"  {'mode':<26} {'answer':<18} {'exact':>5} {'cached':>6} {'recomp':>6} {'cold':>5} {'TTFT ms':>8}"
    for number, q in enumerate(qs):
        where = ", ".join(f"[{e}]" for e in q["evidence"])
        print(f"\nquestion {number + 1} of {len(qs)} ({q['family']}, answer in {where}): {q['text']}")
        print(f"  gold answer: {q['answer']}; documents in the order {' '.join(map(str, q['order']))} "
              f"({q['tokens']} tokens with the question)")
        print(header)
        print("  " + "-" * (len(header) - 2))
        for r in rows:
            if r["question"] != number:
                continue
            answer = " ".join(r["answer"].split())  # on one line
            answer = answer if len(answer) <= 18 else answer[:17] + "~"
            print(f"  {r['mode']:<26} {answer:<18} {'yes' if r['correct'] else 'no':>5} {r['cached_tokens']:>6} "
                  f"{r['recomputed_tokens']:>6} {r['cold_tokens']:>5} {1e3 * r['ttft_s']:>8.1f}")
    exact = {m: sum(r["correct"] for r in rows if r["mode"] == m) for m in MODES}
    print("\n" + textwrap.fill("exact answers per mode: " + ", ".join(f"{m} {n}/{len(qs)}" for m, n in exact.items()),
                               width))
    print(textwrap.fill("cached = tokens served from existing entries, recomp = fresh tokens of the final forward, "
                        "cold = tokens prefilled in isolation to create entries; TTFT = the prefill until the first "
                        "token's logits", width) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", action="store_true", help="also print the per-family composition table")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine demo")
    parser.add_argument("--model", default=None, help="a model folder of hypic_jax.train for the question demo "
                        "(default: the embedded model, when the package holds it)")
    parser.add_argument("--no-questions", action="store_true", help="skip the question demo")
    parser.add_argument("--docs", type=int, default=8, help="documents of the question demo")
    parser.add_argument("--questions", type=int, default=4, help="questions of the question demo")
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--segment-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    args = parser.parse_args(argv)
    if not args.no_questions:
        from hypic_jax.checkpoint.embedded import embedded_model

        folder = args.model or embedded_model()
        if folder is not None:
            print_qa_demo(qa_demo(folder, docs=args.docs, questions=args.questions, progress=True))
    if not args.no_engine:
        print_engine_demo(engine_demo())
    if not args.families:
        return
    print(
        f"hypic-jax demo on {jax.devices()[0].platform}: {args.segments} segments x {args.segment_len} tokens, "
        f"{args.heads} heads of {args.head_dim}, float32, chunk {args.chunk_size}\n"
        "errors are ||S_composed - S_full|| / ||S_full|| of the final state; build cost = summarising every "
        "segment (T_C, S(C|0)) / one plain chunked pass over the same tokens\n"
    )
    header = f"{'family':<16} {'T form':<9} {'naive addition':>15} {'transfer op':>12} {'T_C build cost':>15}"
    print(header)
    print("-" * len(header))
    for row in run(args.segments, args.segment_len, args.heads, args.head_dim, args.chunk_size):
        print(
            f"{row['family']:<16} {row['form']:<9} {row['naive']:>15.2e} {row['transfer']:>12.2e} "
            f"{row['build_cost']:>14.2f}x"
        )


if __name__ == "__main__":
    main()
