"""The shape-stable engine (`hypic_jax.runtime.StableEngine`) on tiny checkpoints of every architecture.

After `warmup`, a seeded random trace (1 to 24 segments of 1 to 300 tokens drawn from a shared corpus, every mode,
seams of 0, a fraction and a count, hits and misses mixed, two tenants) compiles nothing, counted by JAX's own
compile events. Every request is checked against an identity that does not share its program: full recompute,
prefix cache and a whole seam equal the plain full recompute; with a seam of at least W-1 tokens the first
linear layer's state equals full recompute's. A few PIC requests are also checked against the static-layout
engine (`hypic_jax.Engine`), which stitches by another implementation.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from hypic_jax import layout as lay
from hypic_jax.engine import Engine
from hypic_jax.runtime import StableEngine, backend_compiles

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_engine import _build, _rel, arch_params, on_worker_of  # noqa: E402  (the engine tests' tiny checkpoints)

ARCHS = ("qwen_moe", "ring", "kimi")
RUNTIME_ARCHS = arch_params("runtime", ARCHS)  # an architecture's tests on one worker: its engine warms up once
MODES = ("full_recompute", "prefix_cache", "addition", "transition", "transition_rope", "transition_rope_recompute")
RUNGS = (1024,)  # one rung keeps the CPU compiles few; the trace's requests stay under it
MAX_SEGMENTS = 24
MAX_TRACE_TOKENS = 960


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime")
    made = {}

    def get(arch):
        if arch not in made:
            model, vocab, _ = _build(arch, str(root / arch))
            # small pools (16 MB): the trace's entries are evicted as well
            engine = StableEngine(model, max_prompt_tokens=RUNGS[-1], max_segments=MAX_SEGMENTS,
                                  token_rungs=RUNGS, cache_bytes=1 << 24, max_new_tokens=8)
            made[arch] = (engine, model, vocab)
        return made[arch]

    return get


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


@pytest.mark.parametrize("arch", RUNTIME_ARCHS)
def test_random_trace_compiles_nothing_after_warmup(engines, arch):
    engine, model, vocab = engines(arch)
    report = engine.warmup(progress=False)
    assert report["programs"] == 4 * len(RUNGS) + 1  # cold, pic, plain, commit per rung; decode
    before = backend_compiles()
    conv = engine.ladder.conv
    seen_hits = seen_misses = 0
    for segs, mode, seam, salt in _trace(vocab, seed=1, count=40):
        result = engine.prefill(segs, mode=mode, seam=seam, cache_salt=salt)
        seen_hits += result.stats.hits
        seen_misses += result.stats.misses
        exact = mode == "prefix_cache" or (mode == "transition_rope_recompute" and seam == 1.0)
        first_exact = mode == "transition_rope_recompute" and seam >= conv and engine.first_linear_layer() is not None
        if exact or first_exact:
            full = engine.prefill(segs, mode="full_recompute")
        if exact:
            assert _rel(result.logits, full.logits) < 1e-5, (mode, seam, [len(s) for s in segs])
        elif first_exact:
            layer = engine.first_linear_layer()
            np.testing.assert_allclose(np.asarray(result.decode[layer].state), np.asarray(full.decode[layer].state),
                                       rtol=2e-4, atol=2e-5)
        assert np.all(np.isfinite(result.logits))
        assert result.stats.prompt_tokens == sum(map(len, segs))
    assert backend_compiles() == before, "a request compiled after warmup"
    assert engine.stats["programs"]["serving_compiles"] == 0
    assert seen_hits > 0 and seen_misses > 0


@pytest.mark.parametrize("arch", RUNTIME_ARCHS)
def test_pic_modes_match_the_static_engine(engines, arch):
    engine, model, vocab = engines(arch)
    static = Engine(model)
    rng = np.random.default_rng(7)
    docs = [rng.integers(3, vocab, n).tolist() for n in (17, 2, 40)]
    segs = docs + [rng.integers(3, vocab, 5).tolist()]
    for mode, seam in [("transition_rope_recompute", 4), ("addition", 0)]:
        for _ in range(2):  # cold, then from the cache
            ours = engine.prefill(segs, mode=mode, seam=seam)
            theirs = static.prefill(segs, mode=mode, seam=seam)
            assert _rel(ours.logits, theirs.logits) < 1e-5, (mode, seam)
            assert (ours.stats.cached_tokens, ours.stats.recomputed_tokens) == (
                theirs.stats.cached_tokens, theirs.stats.recomputed_tokens)


@on_worker_of("runtime-qwen_moe")
def test_generate_and_limits(engines):
    engine, model, vocab = engines("qwen_moe")
    rng = np.random.default_rng(3)
    segs = [rng.integers(3, vocab, n).tolist() for n in (30, 11, 4)]
    static = Engine(model)
    for mode in ("full_recompute", "prefix_cache", "transition_rope_recompute"):
        ours = engine.generate(segs, max_new_tokens=6, mode=mode)
        theirs = static.generate(segs, max_new_tokens=6, mode=mode)
        assert ours.tokens == theirs.tokens, mode
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        engine.prefill([[5] * (RUNGS[-1] + 1)])
    with pytest.raises(ValueError, match="max_segments"):
        engine.prefill([[5]] * (MAX_SEGMENTS + 2))
    with pytest.raises(ValueError, match="context capacity"):
        engine.generate([[5] * 100], max_new_tokens=RUNGS[-1])
    # a request that fails after its entries were given pool room gives the room back: every slot and page is
    # either free or held by a stored entry (slot 0 and page 0 are the null ones)
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


@on_worker_of("runtime-qwen_moe")
def test_a_cache_too_small_for_a_request(engines):
    """Pools with room for one entry at a time: `prefix_cache` records the prefixes that fit and computes the
    rest (equal to full recompute, on a miss and on a hit); a PIC request, whose entries must all be in the pools
    at once, is refused with a ValueError that names the cache (the server's 400), gives its room back, and the
    engine serves the next request."""
    _, model, vocab = engines("qwen_moe")
    kwargs = dict(max_prompt_tokens=256, max_segments=8, token_rungs=(256,), max_new_tokens=0)
    probe = StableEngine(model, cache_bytes=1, **kwargs).pools
    engine = StableEngine(model, cache_bytes=probe.slot_bytes + 512 * probe.token_bytes, **kwargs)
    assert engine.pools.slots == 2  # slot 0 is the null one: one entry fits
    rng = np.random.default_rng(5)
    segs = [rng.integers(3, vocab, n).tolist() for n in (20, 33, 7, 5)]
    full = engine.prefill(segs, mode="full_recompute")
    misses = engine.prefill(segs, mode="prefix_cache")
    hit = engine.prefill(segs, mode="prefix_cache")
    assert (misses.stats.hits, hit.stats.hits) == (0, 1)  # the first prefix was recorded, the others computed
    for out in (misses, hit):
        assert _rel(out.logits, full.logits) < 1e-5
    with pytest.raises(ValueError, match="no room in the cache"):
        engine.prefill(segs, mode="transition_rope_recompute", seam=4)
    assert engine.pools.free_slots() + len(engine.cache) == 1
    again = engine.prefill(segs, mode="full_recompute")
    assert _rel(again.logits, full.logits) < 1e-6


def test_padding_is_inert_across_capacities():
    """One layout built into two capacities gives the same arrays where the smaller one has them."""
    spans = [lay.Span(lay.FRESH, 5), lay.Span(lay.CACHED, 7, canonical_start=2, slot=3, kv_rows=np.arange(16, 23)),
             lay.Span(lay.FRESH, 3)]
    small = lay.Capacity(tokens=16, pieces=6, keys=32, records=6, chunk=4, conv=3)
    large = lay.Capacity(tokens=64, pieces=10, keys=96, records=10, chunk=4, conv=3)
    a = lay.build(spans, small, isolated=False, tokens=np.arange(8), summaries=True)
    b = lay.build(spans, large, isolated=False, tokens=np.arange(8), summaries=True)
    assert int(a.num_pieces) == int(b.num_pieces) == 3 and int(a.num_keys) == int(b.num_keys) == 15
    np.testing.assert_array_equal(a.key_positions[:15], b.key_positions[:15])
    np.testing.assert_array_equal(a.key_offset[:15], np.r_[np.zeros(5), np.full(7, 3), np.zeros(3)])
    assert a.piece_slot[1] == 3 and a.piece_kind.tolist()[:4] == [lay.PIECE_FRESH, lay.PIECE_CACHED, lay.PIECE_FRESH,
                                                                   lay.PIECE_PAD]
    # the kernels' segment offsets: fresh pieces of 5 and 3 tokens, the cached piece and the padding hold none
    assert a.piece_starts.tolist() == [0, 5, 5, 8, 8, 8, 8] and b.piece_starts.tolist()[:4] == [0, 5, 5, 8]
    isolated = lay.build([lay.Span(lay.FRESH, 9, record_from=4, record_slot=1), lay.Span(lay.FRESH, 2)], small,
                         isolated=True, tokens=np.arange(11), summaries=True)
    assert isolated.piece_starts.tolist() == [0, 4, 9, 11, 11, 11, 11]  # a recorded span is a seam and its interior
    # conv predecessors of the first token after the cached span: its stored tail (table rows after F)
    tail = [1 + small.tokens + 1 * 3 + j for j in range(3)]
    assert a.conv_rows[5].tolist() == tail
    with pytest.raises(ValueError, match="capacity"):
        lay.build([lay.Span(lay.FRESH, 17)], small, isolated=False, tokens=np.arange(17), summaries=False)
    # one packed int32 vector per request (`layout.pack`) unpacks to the same fields, dtypes and shapes
    for arrays, cap in ((a, small), (b, large)):
        packed = lay.pack(arrays)
        assert packed.dtype == np.int32 and packed.shape == (lay.packed_size(cap),)
        back = jax.jit(lay.unpack, static_argnums=1)(packed, cap)
        for field in dataclasses.fields(lay.LayoutArrays):
            want, got = np.asarray(getattr(arrays, field.name)), np.asarray(getattr(back, field.name))
            assert got.dtype == want.dtype and got.shape == want.shape, field.name
            np.testing.assert_array_equal(got, want, err_msg=field.name)
    with pytest.raises(ValueError, match="packed layout"):
        lay.unpack(lay.pack(a), large)



@pytest.mark.parametrize("floor,ceiling,fine_from", [(64, 65536, 1024), (50, 5000, 1024), (16, 3000, 256),
                                                     (64, 100, 1024), (1, 1, 1024), (64, 40000, 1 << 20)])
def test_ladder_padding_bound(floor, ceiling, fine_from):
    """Every request size from 1 to the ceiling fits a rung; the padding stays under 1.25x from `fine_from` on
    (1.5x below it), and the rungs are increasing from the floor."""
    ladder = lay.Ladder(max_tokens=ceiling, max_pieces=4, min_tokens=floor, fine_from=fine_from)
    rungs = np.asarray(ladder.rungs)
    assert rungs[0] == floor and np.all(np.diff(rungs) > 0) and rungs[-1] >= ceiling
    sizes = np.arange(1, ceiling + 1)
    fitted = rungs[np.searchsorted(rungs, sizes)]
    sample = sizes[:: max(1, ceiling // 300)]
    assert [ladder.rung(int(n)) for n in sample] == fitted[:: max(1, ceiling // 300)].tolist()
    above = sizes > max(floor, fine_from)
    assert np.all(fitted[above] <= 1.25 * sizes[above])
    below = (sizes > floor) & ~above
    assert np.all(fitted[below] <= 1.5 * sizes[below])
    with pytest.raises(ValueError, match="largest compiled capacity"):
        ladder.rung(int(rungs[-1]) + 1)

@pytest.mark.parametrize("isolated", [True, False])
def test_masked_attention_kernel_matches_the_xla_loop(isolated):
    """The Pallas flash kernel (interpret mode) and the XLA loop read the same mask from a layout: packed isolated
    spans (each query sees only its span) or stitched spans with cached keys and padding."""
    import jax.numpy as jnp

    from hypic_jax import stitch

    rng = np.random.default_rng(int(isolated))
    if isolated:
        spans = [lay.Span(lay.FRESH, n) for n in (7, 33, 1, 20)]
    else:
        spans = [lay.Span(lay.FRESH, 5), lay.Span(lay.CACHED, 40, canonical_start=3, slot=1,
                                                   kv_rows=np.arange(16, 56)), lay.Span(lay.FRESH, 9)]
    fresh = sum(s.length for s in spans if s.kind == lay.FRESH)
    cap = lay.Capacity(tokens=96, pieces=8, keys=96 if isolated else 128, records=8, chunk=16, conv=3)
    arrays = lay.build(spans, cap, isolated=isolated, tokens=np.zeros(fresh, np.int32), summaries=True)
    q = jnp.asarray(rng.standard_normal((cap.tokens, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((cap.keys, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((cap.keys, 2, 16)), jnp.float32)
    xla = stitch.masked_attention(q, k, v, arrays, isolated=isolated, scale=0.25, block_q=16, block_k=32,
                                  use_kernel=False)
    kernel = stitch.masked_attention(q, k, v, arrays, isolated=isolated, scale=0.25, use_kernel=True)
    valid = np.asarray(arrays.valid)
    assert _rel(np.asarray(kernel)[valid], np.asarray(xla)[valid]) < 1e-5
    # and against the dense definition, query by query
    pos, seg = np.asarray(arrays.positions), np.asarray(arrays.token_segment)
    kpos, kseg = np.asarray(arrays.key_positions), np.asarray(arrays.key_segment)
    for i in np.flatnonzero(valid)[::7]:
        vis = (kpos <= pos[i]) & (np.arange(cap.keys) < int(arrays.num_keys)) & ((kseg == seg[i]) if isolated else True)
        logits = np.einsum("hgd,khd->hgk", np.asarray(q[i]).reshape(2, 2, 16), np.asarray(k)) * 0.25
        logits = np.where(vis, logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        want = np.einsum("hgk,khd->hgd", w, np.asarray(v)).reshape(4, 16)
        np.testing.assert_allclose(np.asarray(xla[i]), want, rtol=1e-4, atol=1e-5)


@on_worker_of("runtime-qwen_moe")
def test_pools_are_written_in_place(engines):
    """Span programs only read the pools; the commit program only writes them, so XLA updates the donated pools
    in place instead of copying them whole on every request (a cost proportional to the cache's size)."""
    import re

    import jax

    from hypic_jax.runtime import ProgramKey

    engine, _, _ = engines("qwen_moe")
    pool_shapes = {",".join(map(str, a.shape)) for a in jax.tree.leaves(engine.pools.arrays)}
    hlo = engine.programs._lower(ProgramKey("commit", RUNGS[0], 0)).compile().as_text()
    copied = {shape for shape in re.findall(r"= \w+\[([\d,]+)\]\S* copy\(", hlo) if shape in pool_shapes}
    assert not copied, f"the commit program copies pools of shapes {copied}"
    assert "input_output_alias" in hlo
    span = engine.programs._lower(ProgramKey("pic", RUNGS[0], engine.max_keys))
    outputs = {",".join(map(str, a.shape)) for a in jax.tree.leaves(span.out_info)}
    assert not outputs & pool_shapes, "a span program returns whole pools"


@on_worker_of("runtime-qwen_moe")
def test_a_write_refused_before_it_runs_leaves_the_pools_usable(engines):
    """The commit program donates the pools; when it is refused before running (nothing donated), the engine keeps
    its pools and the next request is served as before."""
    from hypic_jax.runtime import ProgramKey

    engine, _, vocab = engines("qwen_moe")
    rng = np.random.default_rng(11)
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
    assert _rel(engine.prefill(segs, mode="full_recompute").logits, want) < 1e-6


def test_a_restarted_engine_loads_its_programs_whole(tmp_path):
    """With compile_cache, an engine stores every compiled program whole (`executables.ExecutableStore`); a new
    engine of the same model and choices loads them all without an XLA compilation and answers the same; a damaged
    file is compiled again (and replaced); other choices (here the fold) are other programs."""
    from hypic_jax.runtime import ProgramKey

    model, vocab, _ = _build("qwen_moe", str(tmp_path / "model"))

    def make(**kw):
        return StableEngine(model, max_prompt_tokens=64, max_segments=3, token_rungs=(64,), cache_bytes=1 << 22,
                            max_new_tokens=4, compile_cache=tmp_path / "cache", **kw)

    rng = np.random.default_rng(5)
    segs = [rng.integers(3, vocab, 11).tolist(), rng.integers(3, vocab, 9).tolist(), [4, 5, 6]]
    first = make()
    warm = first.warmup(progress=False)
    stored = sorted((tmp_path / "cache" / "hypic-programs").glob("*.jaxexec"))
    assert warm["loaded"] == 0 and len(stored) == warm["programs"]
    want = [np.asarray(first.prefill(segs, mode=m).logits) for m in ("transition_rope_recompute",) * 2]

    second = make()
    before = backend_compiles()
    warm = second.warmup(progress=False)
    assert warm["loaded"] == warm["programs"] and backend_compiles() == before
    got = [np.asarray(second.prefill(segs, mode=m).logits) for m in ("transition_rope_recompute",) * 2]
    for a, b in zip(got, want):  # a miss (cold + stitched programs), then all cached
        np.testing.assert_array_equal(a, b)
    assert second.programs.stats.serving_compiles == 0

    stored[0].write_bytes(b"damaged")
    third = make()
    warm = third.warmup(progress=False)
    assert warm["loaded"] == warm["programs"] - 1 and stored[0].stat().st_size > 100  # compiled and replaced
    key = ProgramKey("pic", 64, third.max_keys)
    other = make(fold_impl="xla")
    assert other.programs._digest(key) != third.programs._digest(key)
