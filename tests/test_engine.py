"""`hypic_jax.Engine` on tiny checkpoints of every architecture (Qwen3.5 dense and MoE, Ring-linear, Kimi-Linear).

Identities checked against computations that share none of the engine's stitching: full recompute equals the
model's own forward; prefix cache and a seam of the whole segment equal full recompute; with a seam of at least
W-1 tokens the first linear layer's state equals full recompute's; every PIC mode equals the naive reference of
tests/reference/pic.py (the modes written out token by token). After `warmup` a seeded random trace of every mode,
seam, salt and layout compiles nothing. Generation decodes like the model's own greedy generate, through the same
scheduler and sampler as the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import hypic_jax
from hypic_jax import cli
from hypic_jax.engine import Engine, EngineOptions, KernelOptions, backend_compiles
from hypic_jax.engine.programs import ProgramKey

from helpers import arch_params, on_worker_of, rel_err, tiny_checkpoint
from reference import pic

MODES = ("full_recompute", "prefix_cache", "addition", "transition", "transition_rope", "transition_rope_recompute")
RUNGS = (1024,)  # one rung keeps the CPU compiles few; the requests stay under it
MAX_SEGMENTS = 24
MAX_TRACE_TOKENS = 960
DOC_LEN, QUERY_LEN, NUM_DOCS = 20, 6, 3
SEAM = 4  # >= W - 1 = 3: the seam covers the conv warm-up, so the first layer is exact
ENGINE_ARCHS = arch_params("engine")


def _engine(model, **options):
    defaults = dict(max_prompt_tokens=RUNGS[-1], max_segments=MAX_SEGMENTS, token_rungs=RUNGS, cache_bytes=1 << 24,
                    max_new_tokens=8, max_batch=2)
    return Engine(model, **{**defaults, **options})


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    """arch -> (a warmed-up engine with small pools (16 MB: entries get evicted), its model, the vocabulary)."""
    made = {}

    def get(arch):
        if arch not in made:
            model, vocab, _ = tiny_checkpoints(arch)
            engine = _engine(model)
            engine.warmup(progress=False)
            made[arch] = (engine, model, vocab)
        return made[arch]

    yield get
    for engine, _, _ in made.values():
        engine.close()


def _request(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, vocab, DOC_LEN).tolist() for _ in range(NUM_DOCS)]
    return docs + [rng.integers(3, vocab, QUERY_LEN).tolist()]


def _first_linear_state(result):
    return np.asarray(result.decode[0].state)


def _corpus(vocab: int, rng: np.random.Generator, size: int = 30) -> list[list[int]]:
    lengths = np.exp(rng.uniform(0, np.log(300), size)).astype(int).clip(1, 300)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _trace(vocab: int, seed: int, count: int):
    rng = np.random.default_rng(seed)
    corpus = _corpus(vocab, rng)
    weights = 1.0 / np.arange(1, len(corpus) + 1)
    weights /= weights.sum()
    for _ in range(count):
        docs = [corpus[i] for i in rng.choice(len(corpus), int(rng.integers(1, MAX_SEGMENTS + 1)), p=weights)]
        while sum(map(len, docs)) > MAX_TRACE_TOKENS:  # a bounded prompt; still 1 to 24 segments of 1 to 300
            docs.pop()
        query = rng.integers(3, vocab, int(rng.integers(1, 33))).tolist()
        mode = MODES[int(rng.integers(len(MODES)))]
        seam = [0, 0.25, 1.0, 3, 8][int(rng.integers(5))]
        salt = [None, "tenant-b"][int(rng.integers(2))]
        yield docs + [query], mode, seam, salt


@pytest.mark.parametrize("arch", arch_params("engine", ("qwen_moe", "ring", "kimi")))
def test_random_trace_compiles_nothing_after_warmup(engines, arch):
    """A trace of 1 to 24 segments of 1 to 300 tokens from a shared corpus, every mode, seams of 0, a fraction and
    a count, hits and misses mixed, two tenants: no compilation, and every request checked against an identity
    that does not share its program (full recompute; the first linear layer's state with a seam of at least W-1
    tokens; the naive reference for the trace's first PIC request of under 400 tokens, while
    test_pic_modes_equal_the_naive_reference checks every mode against it on a fixed request)."""
    engine, model, vocab = engines(arch)
    assert engine.programs.stats.programs == len(engine.programs.keys_for(RUNGS[-1]))
    compiled = 0  # by the engine's calls (the reference compiles its own small programs)
    conv = engine.ladder.conv
    seen_hits = seen_misses = checked = 0
    for number, (segs, mode, seam, salt) in enumerate(_trace(vocab, seed=1, count=40)):
        before = backend_compiles()
        result = engine.prefill(segs, mode=mode, seam=seam, cache_salt=salt)
        seen_hits += result.stats.hits
        seen_misses += result.stats.misses
        exact = mode == "prefix_cache" or (mode == "transition_rope_recompute" and seam == 1.0)
        first_exact = mode == "transition_rope_recompute" and seam >= conv and engine.first_linear_layer() is not None
        if exact or first_exact:
            full = engine.prefill(segs, mode="full_recompute")
        compiled += backend_compiles() - before
        if exact:
            assert rel_err(result.logits, full.logits) < 1e-5, (mode, seam, [len(s) for s in segs])
        elif first_exact:
            layer = engine.first_linear_layer()
            np.testing.assert_allclose(np.asarray(result.decode[layer].state), np.asarray(full.decode[layer].state),
                                       rtol=2e-4, atol=2e-5)
        if mode in pic.PIC_MODES and checked < 1 and sum(map(len, segs)) < 400:
            assert rel_err(result.logits, pic.prefill(model, segs, mode, seam)) < 1e-4, (mode, seam)
            checked += 1
        assert np.all(np.isfinite(result.logits))
        assert result.stats.prompt_tokens == sum(map(len, segs))
    assert compiled == 0, "a request compiled after warmup"
    assert engine.stats["programs"]["serving_compiles"] == 0
    assert seen_hits > 0 and seen_misses > 0 and checked > 0


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_exact_modes_equal_full_recompute(engines, arch):
    engine, model, vocab = engines(arch)
    engine.clear_cache()
    segs = _request(vocab)
    reference = np.asarray(model.logits(np.concatenate(segs)[None]))[0, -1]

    full = engine.prefill(segs, mode="full_recompute")
    assert rel_err(full.logits, reference) < 1e-5
    assert full.stats.recomputed_tokens == full.stats.prompt_tokens == NUM_DOCS * DOC_LEN + QUERY_LEN

    whole_seam = engine.prefill(segs, mode="transition_rope_recompute", seam=1.0)
    assert rel_err(whole_seam.logits, reference) < 1e-5
    assert whole_seam.stats.cached_tokens == 0 and whole_seam.stats.cold_tokens == 0

    cold = engine.prefill(segs, mode="prefix_cache")
    assert rel_err(cold.logits, reference) < 1e-5
    assert (cold.stats.hits, cold.stats.misses) == (0, NUM_DOCS)
    warm = engine.prefill(segs, mode="prefix_cache")
    assert rel_err(warm.logits, reference) < 1e-5
    assert (warm.stats.hits, warm.stats.misses) == (NUM_DOCS, 0)
    assert warm.stats.recomputed_tokens == QUERY_LEN and warm.stats.cached_tokens == NUM_DOCS * DOC_LEN
    assert rel_err(_first_linear_state(warm), _first_linear_state(full)) < 1e-5

    swapped = engine.prefill([segs[1], segs[0], segs[2], segs[3]], mode="prefix_cache")
    assert swapped.stats.hits == 0  # a prefix cache only serves the same leading segments


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_pic_modes_equal_the_naive_reference(engines, arch):
    """Every PIC mode, on a miss (entries recorded, then stitched) and on a hit, equals the modes written out token
    by token (tests/reference/pic.py)."""
    engine, model, vocab = engines(arch)
    segs = _request(vocab, seed=9)
    shuffled = [segs[i] for i in (2, 0, 1)] + [segs[-1]]
    variants = (("addition", 0, segs), ("transition", 0, shuffled), ("transition_rope", 0, segs),
                ("transition_rope_recompute", SEAM, shuffled), ("transition_rope_recompute", 0.3, segs),
                ("transition_rope_recompute", (SEAM, 0, 1.0), segs))  # a seam per document
    if arch in ("ring", "kimi"):  # a fraction or a seam per document becomes token counts before any layer runs:
        variants = variants[:4]   # the Qwen checkpoints check those
    for mode, seam, request in variants:
        want = pic.prefill(model, request, mode, seam)
        for _ in range(2):  # its entries recorded and stitched, then read from the cache
            got = engine.prefill(request, mode=mode, seam=seam, cache_salt="reference")
            assert rel_err(got.logits, want) < 1e-5, (mode, seam)


@on_worker_of("engine-qwen_dense")
def test_a_seam_per_document(engines):
    """`seam` as one knob per document: every knob 1.0 is full recompute; the same knob for each equals that knob
    given once (the same entries, the same program); a wrong count or a bad knob is refused before any work."""
    engine, model, vocab = engines("qwen_dense")
    segs = _request(vocab, seed=13)
    docs = len(segs) - 1
    full = engine.prefill(segs, mode="full_recompute")
    whole = engine.prefill(segs, mode="transition_rope_recompute", seam=[1.0] * docs)
    assert rel_err(whole.logits, full.logits) < 1e-5
    assert whole.stats.cached_tokens == 0 and whole.stats.seam == (1.0,) * docs
    once = engine.prefill(segs, mode="transition_rope_recompute", seam=0.3, cache_salt="per-document")
    each = engine.prefill(segs, mode="transition_rope_recompute", seam=np.full(docs, 0.3), cache_salt="per-document")
    np.testing.assert_array_equal(each.logits, once.logits)
    assert each.stats.hits == docs
    with pytest.raises(ValueError, match=f"each of the {docs} documents"):
        engine.prefill(segs, mode="transition_rope_recompute", seam=[8] * (docs + 1))
    with pytest.raises(ValueError, match="seam must be >= 0"):
        engine.prefill(segs, mode="transition_rope_recompute", seam=[8, -1, 8][:docs])
    assert engine.prefill(segs, mode="addition", seam=[8]).stats.seam == 0.0  # the seam is not read there


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_greedy_generation_continues_every_exact_mode(engines, arch):
    """Generation decodes from the prefill's caches in a row of the batched decode cache: after every exact mode it
    continues exactly like the model's plain greedy generate."""
    engine, model, vocab = engines(arch)
    segs = _request(vocab, seed=7)
    expected = np.asarray(model.generate(np.concatenate(segs)[None], 4))[0].tolist()
    for mode, seam in (("full_recompute", None), ("prefix_cache", None), ("transition_rope_recompute", 1.0)):
        out = engine.generate(segs, max_new_tokens=4, mode=mode, seam=seam)
        assert out.tokens == expected and out.finish_reason == "length", mode


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_reordered_documents_are_served_from_the_cache(engines, arch):
    engine, model, vocab = engines(arch)
    engine.clear_cache()
    segs = _request(vocab, seed=1)
    full = engine.prefill(segs, mode="full_recompute")
    cold = engine.prefill(segs, seam=SEAM)
    assert (cold.stats.hits, cold.stats.misses, cold.stats.cold_tokens) == (0, NUM_DOCS, NUM_DOCS * DOC_LEN)
    # the first layer is linear and sees context-free inputs: composition through T is exact there
    assert rel_err(_first_linear_state(cold), _first_linear_state(full)) < 1e-5

    shuffled = [segs[i] for i in (2, 0, 1)] + [segs[-1]]
    warm = engine.prefill(shuffled, seam=SEAM)
    assert (warm.stats.hits, warm.stats.misses, warm.stats.cold_tokens) == (NUM_DOCS, 0, 0)
    assert warm.stats.recomputed_tokens == NUM_DOCS * SEAM + QUERY_LEN
    assert warm.stats.cached_tokens == NUM_DOCS * (DOC_LEN - SEAM)
    shuffled_full = engine.prefill(shuffled, mode="full_recompute")
    assert rel_err(_first_linear_state(warm), _first_linear_state(shuffled_full)) < 1e-5


def test_a_prefill_in_pieces_records_what_the_whole_prefill_would(engines):
    """`prefill_piece` prefills the segments no tier holds in order, whole, up to its budget; afterwards the
    request's prefill finds every one of them and gives the logits of the prefill that computed them itself."""
    engine, _, vocab = engines("qwen_dense")
    segs = _request(vocab, seed=5)
    with pytest.raises(ValueError, match="budget"):
        engine.prefill_piece(segs, budget=0)
    assert engine.prefill_piece(segs, mode="full_recompute", budget=1).tokens == 0
    for mode in ("transition_rope_recompute", "prefix_cache"):
        whole = engine.prefill(segs, mode=mode, seam=SEAM, cache_salt=f"whole-{mode}")
        salt, done, left = f"pieces-{mode}", [], NUM_DOCS * DOC_LEN
        while left:  # a budget of 1.5 segments: one segment per piece
            piece = engine.prefill_piece(segs, mode=mode, seam=SEAM, cache_salt=salt, budget=DOC_LEN * 3 // 2)
            assert (piece.tokens, piece.segments, piece.left) == (DOC_LEN, 1, left - DOC_LEN), (mode, piece)
            done.append(piece)
            left = piece.left
        assert engine.prefill_piece(segs, mode=mode, seam=SEAM, cache_salt=salt, budget=1).tokens == 0
        after = engine.prefill(segs, mode=mode, seam=SEAM, cache_salt=salt)
        assert (after.stats.hits, after.stats.misses) == (NUM_DOCS, 0), mode
        assert sum(p.cached_tokens for p in done) == after.stats.cached_tokens, mode
        assert rel_err(after.logits, whole.logits) < 1e-5, mode


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_addition_deviates_far_more_than_transition(engines, arch):
    """HYPIC's ablation: dropping T (addition) breaks decaying / delta-rule states; composing with T does not.
    Asserted on the mechanism, the first linear layer's state after the request (seam-free modes: what remains in
    `transition` is the conv warm-up of each segment's first W-1 tokens), and on the logits for Qwen, whose tiny
    random nets separate them clearly. Ring RoPEs its linear keys, so its fair comparison is transition_rope."""
    engine, model, vocab = engines(arch)
    segs = _request(vocab, seed=2)
    full = engine.prefill(segs, mode="full_recompute")
    transition = "transition_rope" if arch == "ring" else "transition"
    added = engine.prefill(segs, mode="addition")
    composed = engine.prefill(segs, mode=transition)
    assert composed.stats.hits == NUM_DOCS  # both modes use the same seam-free entries
    state_added = rel_err(_first_linear_state(added), _first_linear_state(full))
    state_composed = rel_err(_first_linear_state(composed), _first_linear_state(full))
    assert state_added > 2 * state_composed, (state_added, state_composed)
    if arch.startswith("qwen"):
        assert rel_err(added.logits, full.logits) > 2 * rel_err(composed.logits, full.logits)


@on_worker_of("engine-qwen_dense")
def test_cache_keys_separate_tenants_and_seams(engines):
    engine, model, vocab = engines("qwen_dense")
    segs = _request(vocab, seed=4)
    engine.prefill(segs, cache_salt="tenant-a", seam=SEAM)
    assert engine.prefill(segs, cache_salt="tenant-b", seam=SEAM).stats.hits == 0
    assert engine.prefill(segs, cache_salt="tenant-a", seam=SEAM).stats.hits == NUM_DOCS
    assert engine.prefill(segs, cache_salt="tenant-a", seam=2).stats.hits == 0  # another seam, another entry


@on_worker_of("engine-qwen_moe")
def test_generate_samples_on_the_device_by_seed(engines):
    """One sampler for every request: a seed gives the same tokens every time and whatever runs beside it; top_k 1
    is greedy at any temperature; stop ids end the generation after the stop token; logprobs come back per token."""
    engine, model, vocab = engines("qwen_moe")
    segs = _request(vocab, seed=12)
    greedy = engine.generate(segs, max_new_tokens=6, mode="full_recompute")
    one = engine.generate(segs, max_new_tokens=6, temperature=1.5, top_k=1, seed=5, mode="full_recompute")
    assert one.tokens == greedy.tokens
    draws = [engine.generate(segs, max_new_tokens=6, temperature=2.0, seed=s, mode="full_recompute").tokens
             for s in (1, 1, 2)]
    assert draws[0] == draws[1] and draws[0] != draws[2]
    stop = greedy.tokens[2]
    stopped = engine.generate(segs, max_new_tokens=6, stop=[stop], mode="full_recompute")
    assert stopped.tokens == greedy.tokens[:greedy.tokens.index(stop) + 1] and stopped.finish_reason == "stop"
    ranked = engine.generate(segs, max_new_tokens=3, logprobs=2, mode="full_recompute")
    assert [t for t, _, _ in ranked.logprobs] == ranked.tokens and all(len(top) == 2 for _, _, top in ranked.logprobs)
    assert ranked.logprobs[0][2][0][0] == greedy.tokens[0]  # the greedy token is the likeliest
    assert engine.generate(segs, max_new_tokens=0).tokens == []


@on_worker_of("engine-qwen_dense")
def test_eviction_under_a_small_budget_never_breaks_a_request(engines):
    """Pools with room for a few entries: a request's entries stay pinned until it ends, the evicted entries' room
    is reused by the next request, and every answer is the roomy engine's."""
    roomy, model, vocab = engines("qwen_dense")
    segs = _request(vocab, seed=3)
    expected = roomy.prefill(segs, seam=SEAM, cache_salt="roomy")
    probe = _engine(model, cache_bytes=1).pools
    tight = _engine(model, cache_bytes=NUM_DOCS * (probe.slot_bytes + 32 * probe.token_bytes), compile_cache="none",
                    mean_entry_tokens=32)
    for request in (segs, [segs[i] for i in (2, 0, 1)] + [segs[-1]], segs):
        got = tight.prefill(request, seam=SEAM)
        want = roomy.prefill(request, seam=SEAM, cache_salt="roomy")
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    other = _request(vocab, seed=13)
    tight.prefill(other, seam=SEAM)  # evicts the first request's entries
    assert tight.cache.stats.evictions >= NUM_DOCS
    np.testing.assert_allclose(tight.prefill(segs, seam=SEAM).logits, expected.logits, rtol=1e-5, atol=1e-5)
    tight.close()


@on_worker_of("engine-qwen_moe")
def test_a_cache_too_small_for_a_request(engines):
    """Pools with room for one entry at a time: `prefix_cache` records the prefixes that fit and computes the
    rest (equal to full recompute, on a miss and on a hit); a PIC request, whose entries must all be in the pools
    at once, is refused with a ValueError that names the cache (the server's 400), gives its room back, and the
    engine serves the next request."""
    _, model, vocab = engines("qwen_moe")
    kwargs = dict(max_prompt_tokens=256, max_segments=8, token_rungs=(256,), max_new_tokens=1, max_batch=1,
                  compile_cache="none")
    probe = Engine(model, cache_bytes=1, **kwargs).pools
    engine = Engine(model, cache_bytes=probe.slot_bytes + 512 * probe.token_bytes, **kwargs)
    assert engine.pools.slots == 2  # slot 0 is the null one: one entry fits
    rng = np.random.default_rng(5)
    segs = [rng.integers(3, vocab, n).tolist() for n in (20, 33, 7, 5)]
    full = engine.prefill(segs, mode="full_recompute")
    misses = engine.prefill(segs, mode="prefix_cache")
    hit = engine.prefill(segs, mode="prefix_cache")
    assert (misses.stats.hits, hit.stats.hits) == (0, 1)  # the first prefix was recorded, the others computed
    for out in (misses, hit):
        assert rel_err(out.logits, full.logits) < 1e-5
    with pytest.raises(ValueError, match="no room in the cache"):
        engine.prefill(segs, mode="transition_rope_recompute", seam=4)
    assert engine.pools.free_slots() + len(engine.cache) == 1
    assert rel_err(engine.prefill(segs, mode="full_recompute").logits, full.logits) < 1e-6


@on_worker_of("engine-qwen_dense")
def test_concurrent_requests_under_a_tight_budget_match_sequential_ones(engines):
    """Requests from several threads on one engine, with pools of about two entries: entries are inserted, replaced
    and evicted while other requests hold them, and pool room is freed and reused meanwhile. Every answer equals
    the one the roomy engine gives for the same request, and no pool room leaks."""
    roomy, model, vocab = engines("qwen_dense")
    base = _request(vocab, seed=8)
    requests = [[base[i] for i in order] + [base[-1]] for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0), (0, 2, 1))]
    want = [roomy.prefill(r, seam=SEAM, cache_salt="roomy").logits for r in requests]
    probe = roomy.pools
    tight = _engine(model, cache_bytes=NUM_DOCS * (probe.slot_bytes + 32 * probe.token_bytes), compile_cache="none",
                    mean_entry_tokens=32)
    tight.warmup(progress=False)
    got, errors = {}, []

    def worker(j):
        try:
            for _ in range(2):
                got.setdefault(j, []).append(tight.prefill(requests[j], seam=SEAM).logits)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for j, logits in got.items():
        for one in logits:
            np.testing.assert_allclose(one, want[j], rtol=1e-5, atol=1e-5)
    assert tight.pools.free_slots() + len(tight.cache) == tight.pools.slots - 1  # no slot leaked
    tight.close()


@on_worker_of("engine-qwen_moe")
def test_kernel_choices_keep_the_results_the_cache_and_the_checkpoint(engines, tmp_path):
    """Kernel choices live in the engine's options, not the model's config: engines with other choices (the fold
    as a loop, in blocks and as the Pallas kernel in interpret mode, the linear cores through the Pallas kernels,
    the MoE's ragged matmul, unrolled layers) give the same logits, share the model fingerprint (so one engine's
    disk entries are another's hits), and a checkpoint written by `hypic-jax convert` records no kernel choice."""
    from hypic_jax.checkpoint import config_to_dict

    _, model, vocab = engines("qwen_moe")
    segs = _request(vocab, seed=3)
    shuffled = [segs[i] for i in (1, 2, 0)] + [segs[-1]]
    folder = tmp_path / "disk"
    small = dict(max_prompt_tokens=128, token_rungs=(128,), max_segments=4, max_new_tokens=1, max_batch=1,
                 compile_cache="none", disk_cache_dir=str(folder), disk_write_through=True)
    base = Engine(model, seam=SEAM, kernels=KernelOptions(fold="xla", linear="xla"), **small)
    want = [base.prefill(r) for r in (segs, shuffled)]
    base.close()
    for kernels in (KernelOptions(fold="blocked"), KernelOptions(fold="pallas", linear="pallas", moe="ragged"),
                    KernelOptions(scan_layers=False, compose="f32")):
        engine = Engine(model, seam=SEAM, kernels=kernels, **small)
        assert engine.fingerprint == base.fingerprint
        for request, expected in zip((segs, shuffled), want):
            got = engine.prefill(request)
            assert rel_err(got.logits, expected.logits) < 1e-5, kernels
            assert got.stats.hits == NUM_DOCS, kernels  # the first engine's entries, read from the disk tier
        engine.close()
    assert not {"chunk_size", "gdn_kernel", "moe_kernel"} & set(config_to_dict(model.config))
    with pytest.raises(ValueError, match="fold"):
        KernelOptions(fold="fast")


@on_worker_of("engine-qwen_moe")
def test_restarted_engines_load_their_programs_whole(engines, tmp_path):
    """With a compile cache an engine stores every compiled program whole (`engine.store.ExecutableStore`); a new
    engine of the same model and choices loads them all without an XLA compilation and answers the same; a damaged
    file is compiled again (and replaced); other kernel choices are other programs."""
    _, model, vocab = engines("qwen_moe")

    def make(**kw):
        return Engine(model, max_prompt_tokens=64, max_segments=3, token_rungs=(64,), cache_bytes=1 << 22,
                      max_new_tokens=4, max_batch=1, compile_cache=str(tmp_path / "cache"), **kw)

    rng = np.random.default_rng(5)
    segs = [rng.integers(3, vocab, 11).tolist(), rng.integers(3, vocab, 9).tolist(), [4, 5, 6]]
    first = make()
    warm = first.warmup(progress=False)
    stored = sorted((tmp_path / "cache" / "hypic-programs").glob("*.jaxexec"))
    assert warm["loaded"] == 0 and len(stored) == warm["programs"]
    want = [np.asarray(first.prefill(segs).logits) for _ in range(2)]

    second = make()
    before = backend_compiles()
    warm = second.warmup(progress=False)
    assert warm["loaded"] == warm["programs"] and backend_compiles() == before
    got = [np.asarray(second.prefill(segs).logits) for _ in range(2)]
    for a, b in zip(got, want):  # a miss (cold + stitched programs), then all cached
        np.testing.assert_array_equal(a, b)
    assert second.programs.stats.serving_compiles == 0

    stored[0].write_bytes(b"damaged")
    third = make()
    warm = third.warmup(progress=False)
    # compiled again; the damaged file is replaced, or removed where JAX's own cache served the compilation
    assert warm["loaded"] == warm["programs"] - 1
    assert not stored[0].exists() or stored[0].stat().st_size > 100
    key = ProgramKey("pic", 64, third.max_keys)
    other = make(kernels=KernelOptions(fold="xla"))
    assert other.programs._digest(key) != third.programs._digest(key)
    for engine in (first, second, third, other):
        engine.close()


@on_worker_of("engine-qwen_moe")
def test_a_background_warmup_serves_while_the_larger_rungs_compile(engines):
    """`warmup(ready_tokens=...)` returns once the small rungs are compiled; a request that needs a larger one waits
    for its program instead of compiling it, and nothing counts as a compilation while serving."""
    _, model, vocab = engines("qwen_moe")
    engine = Engine(model, max_prompt_tokens=256, token_rungs=(64, 256), max_segments=4, max_new_tokens=2,
                    max_batch=1, compile_cache="none")
    report = engine.warmup(progress=False, ready_tokens=64)
    # cold, pic, plain and commit of the 256-token rung; the truncating samplers' insert and step
    assert report["pending"] == 6
    rng = np.random.default_rng(3)
    small = [rng.integers(3, vocab, 30).tolist(), [5, 6]]
    large = [rng.integers(3, vocab, 150).tolist(), [5, 6]]
    engine.prefill(small)
    sampled = engine.generate(small, max_new_tokens=2, temperature=1.0, top_p=0.5, seed=1)  # waits for its sampler
    assert len(sampled.tokens) == 2
    out = engine.prefill(large, mode="full_recompute")
    assert rel_err(out.logits, np.asarray(model.logits(np.concatenate(large)[None]))[0, -1]) < 1e-5
    assert engine.programs.wait(timeout=600)
    assert engine.stats["programs"]["serving_compiles"] == 0 and engine.stats["programs"]["pending"] == 0
    engine.close()


@on_worker_of("engine-qwen_moe")
@pytest.mark.parametrize("guard", ["count", "refuse"])
def test_the_compile_guard_counts_or_refuses_a_program_outside_the_ladder(engines, guard):
    """Warmed up for short prompts only, a longer one needs a program outside the warmed-up ladder: the engine
    compiles it and counts it (guard "count"), or refuses the request with `CompileWhileServing` and stays usable
    (guard "refuse")."""
    from hypic_jax.engine import CompileWhileServing

    _, model, vocab = engines("qwen_moe")
    engine = Engine(model, max_prompt_tokens=256, token_rungs=(64, 256), max_segments=4, max_new_tokens=1,
                    max_batch=1, compile_cache="none", compile_guard=guard)
    engine.warmup(max_prompt_tokens=64, progress=False)
    long = [[3 + i % 100 for i in range(147)], [5, 6]]
    if guard == "refuse":
        with pytest.raises(CompileWhileServing, match="refuses to compile while serving"):
            engine.prefill(long, mode="full_recompute")
        assert engine.stats["programs"]["serving_compiles"] == 0
    else:
        engine.prefill(long, mode="full_recompute")
        assert engine.stats["programs"]["serving_compiles"] == 2  # the plain program and its commit
    assert np.isfinite(engine.prefill([[5, 6, 7], [8]], mode="full_recompute").logits).all()
    engine.close()


@on_worker_of("engine-qwen_moe")
def test_closing_writes_the_tiers_to_disk_and_a_new_engine_serves_them(engines, tmp_path):
    """`close()` (here through `with`) writes the device tier to the disk tier; a new engine on the same folder
    serves every document from disk with the same logits; a closed engine refuses requests; a damaged file is
    never served (the request recomputes the entry)."""
    _, model, vocab = engines("qwen_moe")
    options = dict(max_prompt_tokens=128, token_rungs=(128,), max_segments=4, max_new_tokens=1, max_batch=1,
                   compile_cache="none", disk_cache_dir=str(tmp_path / "disk"))
    segs = _request(vocab, seed=21)
    with Engine(model, **options) as first:
        want = first.prefill(segs).logits
        assert first.tiers.disk.stats.entries == 0  # nothing written before close (no write-through)
    with pytest.raises(RuntimeError, match="closed"):
        first.prefill(segs)
    files = sorted((tmp_path / "disk").rglob("*.seg"))
    assert len(files) == NUM_DOCS
    with Engine(model, **options) as second:
        second.programs._compiled.update(first.programs._compiled)  # same options: the first engine's programs
        got = second.prefill(segs)
        assert (got.stats.hits, got.stats.misses) == (NUM_DOCS, 0)
        assert rel_err(got.logits, want) < 1e-6
    files[0].write_bytes(files[0].read_bytes()[:-8] + b"\0" * 8)  # a damaged payload
    with Engine(model, **options) as third:
        third.programs._compiled.update(first.programs._compiled)
        got = third.prefill(segs)
        assert (got.stats.hits, got.stats.misses) == (NUM_DOCS - 1, 1)
        assert rel_err(got.logits, want) < 1e-6


_CRASH_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import numpy as np
from helpers import load_tiny
from hypic_jax.engine import Engine
model, vocab, _ = load_tiny("qwen_moe", {folder!r})
rng = np.random.default_rng(21)
segs = [rng.integers(3, vocab, 20).tolist() for _ in range(3)] + [rng.integers(3, vocab, 6).tolist()]
for disk, through in (({through!r}, True), ({plain!r}, False)):
    engine = Engine(model, max_prompt_tokens=128, token_rungs=(128,), max_segments=4, max_new_tokens=1, max_batch=1,
                    cache_bytes=1 << 22, compile_cache={programs!r}, disk_cache_dir=disk, disk_write_through=through)
    logits = engine.prefill(segs).logits
np.save({out!r}, logits)
if {kill!r}:
    os.kill(os.getpid(), signal.SIGKILL)
"""  # without the kill, the interpreter exits normally with both engines still open


@on_worker_of("engine-qwen_moe")
@pytest.mark.parametrize("kill", [True, False])
def test_what_survives_a_killed_or_exiting_process(engines, tiny_checkpoints, tmp_path, tmp_path_factory, kill):
    """What survives `kill -9`: with write-through every entry reached the disk when it was stored, so a new engine
    serves them all; without it the entries lived on the device only and the new engine recomputes them. A process
    that exits without closing its engines writes their tiers to disk at interpreter exit. Either way a new engine
    on each folder starts cleanly and answers the same."""
    _, model, vocab = engines("qwen_moe")
    killed_model, _, folder = tiny_checkpoints("qwen_moe")
    programs = str(tmp_path_factory.getbasetemp() / "killed-programs")  # the engines compile alike: once
    disks = dict(through=str(tmp_path / "through"), plain=str(tmp_path / "plain"))
    script = _CRASH_SCRIPT.format(tests=os.path.dirname(__file__), folder=str(folder), programs=programs,
                                  out=str(tmp_path / "logits.npy"), kill=kill, **disks)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == (-signal.SIGKILL if kill else 0), done.stderr[-3000:]
    want = np.load(tmp_path / "logits.npy")
    rng = np.random.default_rng(21)
    segs = [rng.integers(3, vocab, 20).tolist() for _ in range(3)] + [rng.integers(3, vocab, 6).tolist()]
    for name, disk in disks.items():
        with Engine(killed_model, max_prompt_tokens=128, token_rungs=(128,), max_segments=4, max_new_tokens=1,
                    max_batch=1, cache_bytes=1 << 22, compile_cache=programs, disk_cache_dir=disk) as engine:
            got = engine.prefill(segs)
            assert got.stats.hits == (0 if kill and name == "plain" else NUM_DOCS), name
            assert rel_err(got.logits, want) < 1e-6


def _write_word_tokenizer(folder, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))


@on_worker_of("engine-qwen_dense")
def test_from_pretrained_text_prompts_and_the_diag_cli(engines, tmp_path, capsys):
    """`Engine.from_pretrained` picks up the folder's tokenizer and context; text segments split on the separator,
    stop strings end the text before them, and `hypic-jax diag` prints per-layer deviations."""
    _, model, vocab = engines("qwen_dense")
    model_plain, _, folder = tiny_checkpoint("qwen_dense", str(tmp_path / "model"))
    _write_word_tokenizer(folder, vocab)
    engine = Engine.from_pretrained(folder, dtype="float32", seam=SEAM, max_prompt_tokens=128, token_rungs=(128,),
                                    max_segments=4, max_new_tokens=8, max_batch=1, compile_cache="none")
    assert engine.max_context == model.max_context and engine.tokenizer is not None
    plain = hypic_jax.load(folder, dtype="float32")  # the folder's own weights (not slowed)
    segs = _request(vocab, seed=5)
    text = " <<PIC_SEP>> ".join(" ".join(f"w{t}" for t in seg) for seg in segs)
    assert engine.segment_tokens(text) == segs
    greedy = engine.generate(text, max_new_tokens=5, mode="full_recompute")
    expected = np.asarray(plain.generate(np.concatenate(segs)[None], 5))[0].tolist()
    assert greedy.tokens == expected and greedy.text == " ".join(f"w{t}" for t in expected)
    stopped = engine.generate(text, max_new_tokens=5, mode="full_recompute", stop=f"w{expected[2]}")
    assert stopped.finish_reason == "stop" and stopped.tokens == expected[:3]
    assert stopped.text.split() == [f"w{t}" for t in expected[:2]]  # the text ends before the stop string
    engine.close()

    args = ["diag", str(folder), "--dtype", "float32", "--mode", "transition", "--max-prompt-tokens", "128",
            "--token-rungs", "128", "--max-segments", "4", "--compile-cache", "none", "--segments"]
    args += [" ".join(map(str, seg)) for seg in segs] + ["--token-ids"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "linear" in out and "full" in out and "logits" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["mode"] == "transition" and report["rows"][0]["kind"] == "linear"
    assert report["rows"][-1]["layer"] == "logits" and report["rows"][-1]["deviation"] > 0


@on_worker_of("engine-qwen_dense")
def test_diagnose_is_zero_for_an_exact_mode_and_grows_without_transfers(engines):
    engine, model, vocab = engines("qwen_dense")
    segs = _request(vocab, seed=6)
    exact = engine.diagnose(segs, mode="transition_rope_recompute", seam=1.0)
    assert max(row["deviation"] for row in exact) < 1e-5
    added = engine.diagnose(segs, mode="addition")
    assert [row["layer"] for row in added] == list(range(len(model.params["layers"]))) + ["logits"]
    assert added[0]["deviation"] > 1e-3  # the first (linear) layer already sees the dropped transfers
    assert engine.stats["programs"]["diagnostic"] == 2  # the plain and pic programs with hidden states, apart


@on_worker_of("engine-qwen_dense")
def test_adaptive_seam_measures_each_document_once_and_feeds_prefill(engines):
    """`SeamProbe`: a document's deviation is the relative change of its first tokens' hidden states at the inputs
    of the full-attention layers, alone against after the probe (the probe's prefix cached: the same as the whole
    text recomputed as one segment); seams fall as the tolerance grows; the knobs it returns give
    `Engine.prefill` exactly those seams (one token included, which the knob 1 would not)."""
    from hypic_jax.engine import seam_tokens
    from hypic_jax.engine.adaptive_seam import SeamProbe, knob

    engine, model, vocab = engines("qwen_dense")
    rng = np.random.default_rng(11)
    probe = rng.integers(3, vocab, 30).tolist()
    docs = [rng.integers(3, vocab, n).tolist() for n in (5, 12, 40)]
    query = rng.integers(3, vocab, QUERY_LEN).tolist()
    prober = SeamProbe(engine, probe, window=8)
    feeds = [i - 1 for i, kind in enumerate(engine.layer_kinds) if kind == "full" and i > 0]
    assert feeds and prober.feeds == feeds

    for doc in docs:
        head = doc[:8]
        got = prober.deviation(doc)
        assert got.shape == (len(head),) and np.all(np.isfinite(got)) and np.all(got >= 0)
        _, alone = engine.query_hidden_states([head], "full_recompute")
        _, whole = engine.query_hidden_states([probe + head], "full_recompute")  # no cache, one segment
        alone, after = np.asarray(alone, np.float64)[feeds], np.asarray(whole, np.float64)[feeds, -len(head):]
        want = (np.linalg.norm(after - alone, axis=-1) / np.linalg.norm(after, axis=-1)).max(axis=0)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert got.max() > 1e-3  # the probe moves the tokens (slow decays: the state carries)
        # tolerances: at or over the largest deviation nothing is recomputed; under the smallest, the window
        assert prober.seam_for(doc, got.max()) == int(np.argmax(got <= got.max()))
        assert prober.seam_for(doc, 0.99 * got.min()) == len(head)
        seams = [prober.seam_for(doc, tol) for tol in np.linspace(0, got.max(), 9)]
        assert seams == sorted(seams, reverse=True)

    calls = []
    engine.query_hidden_states = lambda *a, **k: calls.append(a)  # memoized: nothing runs again
    try:
        for doc in docs:
            prober.deviation(list(doc))
    finally:
        del engine.query_hidden_states
    assert calls == []

    for tol in np.unique(np.concatenate([prober.deviation(d) for d in docs])):
        knobs = prober.seams(docs + [query], tol=tol)
        want = [prober.seam_for(d, tol) for d in docs]
        assert [seam_tokens(k, len(d)) for k, d in zip(knobs, docs)] == want
        result = engine.prefill(docs + [query], mode="transition_rope_recompute", seam=knobs)
        assert result.stats.recomputed_tokens == sum(want) + len(query)
    assert knob(1, 40) < 1 and seam_tokens(knob(1, 40), 40) == 1 and knob(1, 1) == 1
    with pytest.raises(ValueError, match="before its query"):
        prober.seams([query])
    with pytest.raises(ValueError, match="window"):
        SeamProbe(engine, probe, window=0)
    with pytest.raises(ValueError, match="empty"):
        SeamProbe(engine, [])
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        SeamProbe(engine, probe, window=engine.max_prompt_tokens)


def test_options_derive_from_the_model_and_map_to_flags(tmp_path):
    """Limits left unset fit the model's context (a 4,096-token model gets a prompt limit beside its generation
    room); given limits that do not fit are refused naming both; every option is one flag of `hypic-jax serve`,
    parsed back to the same field."""
    options = EngineOptions().resolve(max_context=4096, backend="cpu")
    assert options.limits.max_prompt_tokens + options.limits.max_new_tokens <= 4096
    assert options.limits.max_prompt_tokens == 3840 and options.limits.max_batch == 8
    assert EngineOptions().resolve(max_context=None, backend="gpu").limits.ladder == "fine"
    small = EngineOptions().resolve(max_context=300, backend="cpu").limits
    assert small.max_new_tokens == 150 and small.max_prompt_tokens == 150
    with pytest.raises(ValueError, match="exceeds the model's context of 4096"):
        EngineOptions.from_kwargs(max_prompt_tokens=4000, max_new_tokens=200).resolve(max_context=4096,
                                                                                      backend="cpu")
    with pytest.raises(TypeError, match="did you mean max_prompt_tokens"):
        EngineOptions.from_kwargs(max_prompt_token=5)
    with pytest.raises(ValueError, match="peer_cache_bytes needs"):
        EngineOptions.from_kwargs(peer_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="host_cache_bytes"):
        EngineOptions.from_kwargs(tensor_parallel=2, host_cache_bytes=1)
    with pytest.raises(ValueError, match="max_segments"):
        EngineOptions.from_kwargs(max_segments=0)
    parser = cli.parser()
    args = parser.parse_args(["serve", "--cache-gb", "0.5", "--max-prompt-tokens", "2048", "--no-scan-layers",
                              "--linear-kernel", "xla", "--seam", "0.25", "--token-rungs", "512,2048", "--tp", "2",
                              "--port", "9000"])
    options = cli.engine_options(args)
    assert options.pools.cache_bytes == 1 << 29 and options.limits.max_prompt_tokens == 2048
    assert options.kernels == KernelOptions(linear="xla", scan_layers=False)
    assert options.requests.seam == 0.25 and options.limits.token_rungs == (512, 2048)
    assert options.parallel.tensor_parallel == 2 and args.port == 9000
    assert cli.engine_options(parser.parse_args(["serve"])) == EngineOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-segments", "0"])


def test_cache_entries_reach_on_drop_once_and_only_when_unpinned():
    """The engine frees an entry's pool room in on_drop: that must never run while a request holds the entry."""
    from hypic_jax.cache.index import Entry, SegmentCache

    dropped = []
    cache = SegmentCache(capacity_bytes=10, on_drop=lambda e: dropped.append(e.key))
    entry = lambda key: Entry(key=key, tokens=(1,), kind="pic", seam=0, layers=(), nbytes=6)  # noqa: E731
    with cache.pinned() as pins:
        a = cache.insert(pins.add(entry("a")))
        cache.insert(pins.add(entry("b")))  # over budget, but both pinned
        assert dropped == [] and len(cache) == 2
        cache.insert(pins.add(entry("a")))  # replaces the pinned "a": dropped, on_drop deferred
        assert a.dropped and dropped == []
    assert dropped == ["a", "b"]  # unpins: the replaced "a", then "b" evicted (least recent) down to the budget
    assert len(cache) == 1 and cache.stats.evictions == 1
    cache.clear()
    assert dropped == ["a", "b", "a"]  # the second "a"


def test_a_lookup_pins_its_entry_before_another_thread_can_evict_it():
    """`lookup(..., pins=)` pins the entry it finds inside the cache's lock: an eviction that another thread runs
    right after the lookup skips it, and its on_drop (which frees the entry's pool room) runs once, after the
    request lets go."""
    from hypic_jax.cache.index import Entry, SegmentCache

    dropped = []
    cache = SegmentCache(capacity_bytes=100, on_drop=lambda e: dropped.append(e.key))
    cache.insert(Entry(key="a", tokens=(1,), kind="pic", seam=0, layers=(), nbytes=6))
    evicted = threading.Event()
    real_lock = cache._lock

    class EvictInside:  # runs another thread's eviction the moment the lookup lets go of the lock
        depth = 0

        def __enter__(self):
            out = real_lock.__enter__()
            self.depth += 1
            return out

        def __exit__(self, *exc):
            self.depth -= 1
            out = real_lock.__exit__(*exc)
            if self.depth == 0 and not evicted.is_set():
                evicted.set()
                worker = threading.Thread(target=cache.evict_one)
                worker.start()
                worker.join(10)
                assert not worker.is_alive()
            return out

    with cache.pinned() as pins:
        cache._lock = EvictInside()
        found = cache.lookup("a", (1,), pins=pins)
        cache._lock = real_lock
        assert evicted.is_set() and found is not None and found.pins == 1
        assert "a" in cache and dropped == []  # the eviction found it pinned
        cache.insert(Entry(key="a", tokens=(1,), kind="pic", seam=0, layers=(), nbytes=6))  # replaced while held
        assert dropped == []
    assert dropped == ["a"]  # once, when the request let go


@on_worker_of("engine-qwen_moe")
def test_pools_are_written_in_place(engines):
    """Span programs only read the pools; the commit program only writes them, so XLA updates the donated pools in
    place instead of copying them whole on every request (a cost proportional to the cache's size)."""
    import re

    engine, _, _ = engines("qwen_moe")
    pool_shapes = {",".join(map(str, a.shape)) for a in jax.tree.leaves(engine.pools.arrays)}
    hlo = engine.programs._lower(ProgramKey("commit", RUNGS[0], 0)).compile().as_text()
    copied = {shape for shape in re.findall(r"= \w+\[([\d,]+)\]\S* copy\(", hlo) if shape in pool_shapes}
    assert not copied, f"the commit program copies pools of shapes {copied}"
    assert "input_output_alias" in hlo
    span = engine.programs._lower(ProgramKey("pic", RUNGS[0], engine.max_keys))
    outputs = {",".join(map(str, a.shape)) for a in jax.tree.leaves(span.out_info)}
    assert not outputs & pool_shapes, "a span program returns whole pools"


@on_worker_of("engine-qwen_moe")
def test_a_failed_request_gives_its_room_back_and_a_refused_write_keeps_the_pools(engines):
    """A request that fails after its entries were given pool room gives the room back (every slot and page is
    free or held by a stored entry); the commit program donates the pools, and one refused before it runs (nothing
    donated) leaves them usable for the next request."""
    engine, _, vocab = engines("qwen_moe")
    rng = np.random.default_rng(11)

    def accounted():
        pools, entries = engine.pools, list(engine.cache._entries.values())
        pages = sum(len({int(r) // pools.page for r in np.asarray(e.rows)}) for e in entries if e.rows is not None)
        return (pools.free_slots() + len(entries), len(pools._free_pages) + pages)

    assert accounted() == (engine.pools.slots - 1, engine.pools.pages - 1)
    real_run = engine._run

    def failing(kind, *args, **kwargs):
        if kind == "cold":
            raise RuntimeError("the device failed")
        return real_run(kind, *args, **kwargs)

    engine._run = failing
    try:
        with pytest.raises(RuntimeError, match="device failed"):
            engine.prefill([rng.integers(3, vocab, 9).tolist(), [4, 5]], mode="transition_rope_recompute")
    finally:
        engine._run = real_run
    assert accounted() == (engine.pools.slots - 1, engine.pools.pages - 1)

    segs = [rng.integers(3, vocab, n).tolist() for n in (20, 9, 3)]
    want = engine.prefill(segs, mode="full_recompute").logits
    key = ProgramKey("commit", RUNGS[0], 0)
    real = engine.programs.get(key)

    def refused(pools, writes):
        raise TypeError("refused before running")

    engine.programs._compiled[key] = refused
    try:
        with pytest.raises(TypeError, match="refused"):
            engine.prefill(segs, mode="full_recompute")
    finally:
        engine.programs._compiled[key] = real
    assert engine.pools.arrays is not None
    assert rel_err(engine.prefill(segs, mode="full_recompute").logits, want) < 1e-6
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        engine.prefill([[5] * (RUNGS[-1] + 1)])
    with pytest.raises(ValueError, match="max_segments"):
        engine.prefill([[5]] * (MAX_SEGMENTS + 2))
    with pytest.raises(ValueError, match="over the engine's max_new_tokens"):
        engine.generate([[5] * 100], max_new_tokens=9)
