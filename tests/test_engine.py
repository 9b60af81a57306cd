"""The PIC engine on tiny random checkpoints of every supported architecture (Qwen3.5 dense and MoE, Ring-linear,
Kimi-Linear), built the way the parity tests build them.

Exactness identities: full_recompute == model.logits; prefix_cache == full recompute (cold and warm);
transition_rope_recompute with seam = 1.0 == full recompute; with a seam of at least W-1 tokens the first
(linear) layer's composed state equals full recompute to float32 rounding. Behaviour: reordered documents are
served from the cache with only seams and query recomputed; addition deviates far more than transition; a byte
budget smaller than one request never breaks it; bad inputs raise ValueError.

Compilations dominate the run time (layouts are static), so every test of an architecture uses documents of one
length: the reordered request, seam = 1.0 and full recompute share compilations.
"""

from __future__ import annotations

import functools
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hypic_jax
from hypic_jax import cli
from hypic_jax.engine import Engine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ARCHS = ("qwen_dense", "qwen_moe", "ring", "kimi")
DOC_LEN, QUERY_LEN, NUM_DOCS = 20, 6, 3
SEAM = 4  # >= W - 1 = 3: the seam covers the conv warm-up, so the first layer is exact
SLOW_DECAY = float(np.log(0.05))  # A_log of linear layers: long memory, so a dropped transfer T shows


def on_worker_of(group: str):
    """Tests of one tiny checkpoint share it and their compiled programs (module-scoped, and JAX's caches): under
    xdist (`--dist loadgroup`, pyproject.toml) they run on one worker, which builds and compiles them once."""
    return pytest.mark.xdist_group(group)


def arch_params(module: str, archs=ARCHS) -> list:
    """`archs` as parameters, each architecture's tests in a group of their own (`on_worker_of`)."""
    return [pytest.param(arch, marks=on_worker_of(f"{module}-{arch}")) for arch in archs]


ENGINE_ARCHS = arch_params("engine")


def _slow_decay(params):
    """Set every linear layer's A_log to a slow decay (random-init gates forget within a few tokens)."""

    def visit(tree):
        if isinstance(tree, dict):
            return {k: (jnp.full_like(v, SLOW_DECAY) if k == "A_log" else visit(v)) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(visit(v) for v in tree)
        return tree

    return visit(params)


@functools.lru_cache(maxsize=None)
def _build(arch: str, folder: str):
    from pathlib import Path

    folder = Path(folder)
    if arch.startswith("qwen"):
        from qwen_helpers import build, save

        save(build(arch.split("_")[1]), folder)
        vocab = 128
    elif arch == "ring":
        pytest.importorskip("mlx.core")
        from test_ring_linear import TINY_CONFIG, _build_reference, _write_checkpoint

        config = {**TINY_CONFIG, "num_hidden_layers": 3}  # linear, linear, full attention
        _write_checkpoint(_build_reference(config), config, folder)
        vocab = config["vocab_size"]
    else:
        from test_kimi_linear import build_reference

        build_reference(folder)
        vocab = 128
    model = hypic_jax.load(folder, dtype="float32")
    model = type(model)(model.arch, model.config, _slow_decay(model.params))
    return model, vocab, folder


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return lambda arch: _build(arch, str(root / arch))[:2]


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory, build):
    root = tmp_path_factory.getbasetemp()
    return lambda arch: next(p for p in root.glob(f"engine*/{arch}") if p.is_dir())


def _request(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, vocab, DOC_LEN).tolist() for _ in range(NUM_DOCS)]
    return docs + [rng.integers(3, vocab, QUERY_LEN).tolist()]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _first_linear_state(result):
    return np.asarray(result.decode[0].state)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_exact_modes_equal_full_recompute(build, arch):
    model, vocab = build(arch)
    engine = Engine(model)
    segs = _request(vocab)
    reference = np.asarray(model.logits(np.concatenate(segs)[None]))[0, -1]

    full = engine.prefill(segs, mode="full_recompute")
    assert _rel(full.logits, reference) < 1e-5
    assert full.stats.recomputed_tokens == full.stats.prompt_tokens == NUM_DOCS * DOC_LEN + QUERY_LEN

    whole_seam = engine.prefill(segs, mode="transition_rope_recompute", seam=1.0)
    assert _rel(whole_seam.logits, reference) < 1e-5
    assert whole_seam.stats.cached_tokens == 0 and whole_seam.stats.cold_tokens == 0

    cold = engine.prefill(segs, mode="prefix_cache")
    assert _rel(cold.logits, reference) < 1e-5
    assert (cold.stats.hits, cold.stats.misses) == (0, NUM_DOCS)
    warm = engine.prefill(segs, mode="prefix_cache")
    assert _rel(warm.logits, reference) < 1e-5
    assert (warm.stats.hits, warm.stats.misses) == (NUM_DOCS, 0)
    assert warm.stats.recomputed_tokens == QUERY_LEN and warm.stats.cached_tokens == NUM_DOCS * DOC_LEN
    # relative to the state's norm: elementwise, float32 rounding of entries near 0 reaches 1e-6 (Ring's states)
    assert _rel(_first_linear_state(warm), _first_linear_state(full)) < 1e-5

    swapped = engine.prefill([segs[1], segs[0], segs[2], segs[3]], mode="prefix_cache")
    assert swapped.stats.hits == 0  # a prefix cache only serves the same leading segments


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_greedy_decoding_continues_from_every_exact_mode(build, arch):
    """full_recompute decodes from the architecture's own prefill caches, prefix_cache and a whole seam from the
    span forward's: all three must continue exactly like the model's plain greedy generate."""
    model, vocab = build(arch)
    engine = Engine(model)
    segs = _request(vocab, seed=7)
    expected = np.asarray(model.generate(np.concatenate(segs)[None], 4))[0].tolist()
    for mode, seam in (("full_recompute", None), ("prefix_cache", None), ("transition_rope_recompute", 1.0)):
        assert engine.generate(segs, max_new_tokens=4, mode=mode, seam=seam).tokens == expected, mode


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_reordered_documents_are_served_from_the_cache(build, arch):
    model, vocab = build(arch)
    engine = Engine(model, mode="transition_rope_recompute", seam=SEAM)
    segs = _request(vocab, seed=1)
    full = engine.prefill(segs, mode="full_recompute")

    cold = engine.prefill(segs)
    assert (cold.stats.hits, cold.stats.misses, cold.stats.cold_tokens) == (0, NUM_DOCS, NUM_DOCS * DOC_LEN)
    # the first layer is linear and sees context-free inputs: composition through T is exact there
    assert _rel(_first_linear_state(cold), _first_linear_state(full)) < 1e-5

    order = [2, 0, 1]
    shuffled = [segs[i] for i in order] + [segs[-1]]
    warm = engine.prefill(shuffled)
    assert (warm.stats.hits, warm.stats.misses, warm.stats.cold_tokens) == (NUM_DOCS, 0, 0)
    assert warm.stats.recomputed_tokens == NUM_DOCS * SEAM + QUERY_LEN
    assert warm.stats.cached_tokens == NUM_DOCS * (DOC_LEN - SEAM)
    shuffled_full = engine.prefill(shuffled, mode="full_recompute")
    assert _rel(_first_linear_state(warm), _first_linear_state(shuffled_full)) < 1e-5
    assert np.isfinite(warm.logits).all()  # deeper layers are approximate (seam window); no bound on a random net


@pytest.mark.parametrize("arch", arch_params("engine", ("qwen_moe", "kimi")))
def test_tuning_knobs_change_nothing_but_speed(build, arch, monkeypatch):
    """The Pallas fold with the seams entering it as chunk steps (the GPU default) reading the cached interiors in
    place from the entry pool, the same without the pool, stacked cache entries and the blocked fold, in interpret
    mode here, give the plain engine's results; invalid knob values are refused."""
    from hypic_jax.pallas import compose

    folds = []
    original = compose.span_fold_pallas

    def spy(*args, **kwargs):
        folds.append(len(args) > 6 and args[6] is not None)  # slots given: interiors read from the pool
        return original(*args, **kwargs)

    monkeypatch.setattr(compose, "span_fold_pallas", spy)
    model, vocab = build(arch)
    segs = _request(vocab, seed=3)
    shuffled = [segs[i] for i in (1, 2, 0)] + [segs[-1]]
    base = Engine(model, seam=SEAM, pool_entries=False, stack_entries=False)  # every entry piece by piece
    seam_fold = Engine(model, seam=SEAM, prefix_impl="pallas")
    unpooled = Engine(model, seam=SEAM, prefix_impl="pallas", pool_entries=False, command_buffers=True)
    tuned = Engine(model, seam=SEAM, stack_entries=True, prefix_impl="pallas", prefix_block=0, attention_programs=64)
    for request in (segs, shuffled):  # cold (entries recorded, then stitched), then served from the cache
        want = base.prefill(request)
        for engine in (seam_fold, unpooled, tuned):
            got = engine.prefill(request)
            assert _rel(got.logits, want.logits) < 1e-5
            assert (got.stats.hits, got.stats.misses) == (want.stats.hits, want.stats.misses)
    assert True in folds and False in folds  # the seam fold ran, from the pool and from stacked interiors
    assert seam_fold.pool.in_use == NUM_DOCS and unpooled.pool.in_use == 0
    entry = next(iter(tuned.cache._entries.values()))
    assert len(entry.layers) == len(model.params["layers"])  # a StackedLayers still reads as one piece per layer
    for bad in (dict(prefix_block=1), dict(prefix_block=-2), dict(attention_programs=0), dict(prefix_impl="x"),
                dict(seam_precision="fp8")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Engine(model, **bad)


@on_worker_of("engine-qwen_moe")
def test_seam_precision_follows_the_model_dtype(build, monkeypatch):
    """The seam fold's seam products run single-pass bf16 only for a bfloat16 model on tensor-core composition (the
    precision of that model's own GDN kernel for the same tokens); float32 models and SpanMode(seam_precision=None)
    keep the composition's algorithm, and the request's results stay those of the plain engine."""
    from hypic_jax.pallas import compose

    seen = []
    original = compose.span_fold_pallas

    def spy(*args, **kwargs):
        seen.append(kwargs["config"].seam_algorithm)
        return original(*args, **kwargs)

    monkeypatch.setattr(compose, "span_fold_pallas", spy)
    model, vocab = build("qwen_moe")
    segs = _request(vocab, seed=5)
    low = type(model)(model.arch, model.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.params))
    for m, want in ((model, None), (low, "bf16")):
        engine = Engine(m, seam=SEAM, prefix_impl="pallas", compose_algorithm="bf16x3")
        seen.clear()  # the fold is traced once per layout (the cold request's combine), then reused
        engine.prefill(segs)
        got = engine.prefill([segs[i] for i in (2, 0, 1)] + [segs[-1]])
        assert seen and set(seen) == {want}
        assert np.isfinite(np.asarray(got.logits)).all()
    exact = Engine(low, seam=SEAM, prefix_impl="pallas", compose_algorithm="bf16x3", seam_precision=None)
    seen.clear()
    exact.prefill(segs)
    exact.prefill([segs[i] for i in (2, 0, 1)] + [segs[-1]])
    assert set(seen) == {None}


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_addition_deviates_far_more_than_transition(build, arch):
    """HYPIC's ablation: dropping T (addition) breaks decaying / delta-rule states; composing with T does not.

    Asserted on the mechanism, the first linear layer's state after the request (seam-free modes: what remains
    in `transition` is the conv warm-up of each segment's first W-1 tokens). Measured (seeds 2, 7): addition /
    transition state deviation Qwen 0.70-0.79 / 0.06-0.09, Ring 0.61-0.67 / 0 (with RoPE correction), Kimi
    0.64-0.65 / 0.21-0.27. On the logits of these tiny random nets only Qwen separates clearly (0.59 / 0.13-0.19;
    Ring 0.75-1.02 / 0.43-0.70, Kimi ~0.9 for both), so the logit gap is asserted for Qwen only. Ring RoPEs its
    linear keys, so its transition needs the RoPE correction to be the fair comparison."""
    model, vocab = build(arch)
    engine = Engine(model)
    segs = _request(vocab, seed=2)
    full = engine.prefill(segs, mode="full_recompute")
    transition = "transition_rope" if arch == "ring" else "transition"
    added = engine.prefill(segs, mode="addition")
    composed = engine.prefill(segs, mode=transition)
    assert composed.stats.hits == NUM_DOCS  # both modes use the same seam-free entries
    state_added = _rel(_first_linear_state(added), _first_linear_state(full))
    state_composed = _rel(_first_linear_state(composed), _first_linear_state(full))
    assert state_added > 2 * state_composed, (state_added, state_composed)
    if arch.startswith("qwen"):
        assert _rel(added.logits, full.logits) > 2 * _rel(composed.logits, full.logits)


@on_worker_of("engine-qwen_dense")
@pytest.mark.parametrize("prefix_impl", ("associative", "pallas"))
def test_eviction_under_a_small_budget_never_breaks_a_request(build, prefix_impl):
    """A budget for one entry: the request's entries stay pinned (and their pool slots unshared) until it ends,
    the evicted entries' slots are reused by the next request, and every answer is the roomy engine's."""
    model, vocab = build("qwen_dense")
    segs = _request(vocab, seed=3)
    roomy = Engine(model, seam=SEAM, prefix_impl=prefix_impl)
    expected = roomy.prefill(segs)
    entry_bytes = roomy.cache.stats.bytes // NUM_DOCS
    tight = Engine(model, seam=SEAM, cache_bytes=entry_bytes + entry_bytes // 2, prefix_impl=prefix_impl)
    first = tight.prefill(segs)
    np.testing.assert_allclose(first.logits, expected.logits, rtol=1e-6, atol=1e-6)
    stats = tight.cache.stats
    assert stats.evictions == NUM_DOCS - 1 and stats.entries == 1 and stats.bytes <= stats.capacity_bytes
    assert tight.pool.in_use == 1  # the evicted entries gave their slots back
    capacity = tight.pool.capacity
    assert capacity >= NUM_DOCS  # grown past the budget's one slot: the running request pinned three entries
    again = tight.prefill(segs)  # two of three entries are gone: recomputed, same answer
    assert again.stats.misses == NUM_DOCS - 1
    np.testing.assert_allclose(again.logits, expected.logits, rtol=1e-6, atol=1e-6)
    assert tight.pool.in_use == 1 and tight.pool.capacity == capacity  # freed slots reused, no growth
    shuffled = [segs[i] for i in (2, 0, 1)] + [segs[-1]]
    np.testing.assert_allclose(tight.prefill(shuffled).logits, roomy.prefill(shuffled).logits, rtol=1e-6, atol=1e-6)


@on_worker_of("engine-qwen_dense")
def test_cache_keys_separate_tenants_and_seams(build):
    model, vocab = build("qwen_dense")
    segs = _request(vocab, seed=4)
    engine = Engine(model, seam=SEAM)
    engine.prefill(segs, cache_salt="tenant-a")
    assert engine.prefill(segs, cache_salt="tenant-b").stats.hits == 0
    assert engine.prefill(segs, cache_salt="tenant-a").stats.hits == NUM_DOCS
    assert engine.prefill(segs, cache_salt="tenant-a", seam=2).stats.hits == 0  # another seam, another entry


@on_worker_of("engine-qwen_dense")
def test_bad_inputs_raise_clear_errors(build):
    model, vocab = build("qwen_dense")
    engine = Engine(model, max_context=64)
    cases = [
        ([], "at least one segment"),
        ([[5, 6], []], "segment 1 is empty"),
        ([[5] * 40, [6] * 30], "over the model's context of 64"),
        ([[5, vocab]], f"token id {vocab} outside the vocabulary"),
        ([[-1, 5]], "token id -1 outside the vocabulary"),
        (["some text"], "need a tokenizer"),
        ([[5, 1.5]], "not integers"),
        ([[[1, 2], [3]]], "not integers"),
    ]
    for segments, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.prefill(segments)
    with pytest.raises(ValueError, match="unknown mode"):
        engine.prefill([[5, 6]], mode="telepathy")
    with pytest.raises(ValueError, match="seam must be >= 0"):
        engine.prefill([[5, 6], [7]], seam=-1)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.generate([[5] * 60], max_new_tokens=10)
    with pytest.raises(ValueError, match="compose_algorithm"):
        Engine(model, compose_algorithm="fp8")


def _write_word_tokenizer(folder, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))


@on_worker_of("engine-qwen_dense")
def test_text_prompt_generate_and_diag_cli(build, folder_of, capsys):
    model, vocab = build("qwen_dense")
    folder = folder_of("qwen_dense")
    _write_word_tokenizer(folder, vocab)
    engine = Engine.from_pretrained(folder, dtype="float32", seam=SEAM)
    engine.params = model.params  # the slow-decay weights every other test uses (same compilations)
    segs = _request(vocab, seed=5)
    text = " <<PIC_SEP>> ".join(" ".join(f"w{t}" for t in seg) for seg in segs)
    assert engine.segment_tokens(text) == segs

    greedy = engine.generate(text, max_new_tokens=5, mode="full_recompute")
    expected = np.asarray(model.generate(np.concatenate(segs)[None], 5))[0].tolist()
    assert greedy.tokens == expected and greedy.text == " ".join(f"w{t}" for t in expected)
    stopped = engine.generate(text, max_new_tokens=5, mode="full_recompute", stop=f"w{expected[1]}")
    assert stopped.tokens == expected[:2] and stopped.finish_reason == "stop"
    prefixed = engine.generate(text, max_new_tokens=5, mode="prefix_cache")
    assert prefixed.tokens == expected  # exact mode, decoding from the span forward's caches
    sampled = engine.generate(text, max_new_tokens=4, temperature=0.7, top_p=0.9, seed=3)
    assert len(sampled.tokens) == 4 and sampled.stats.mode == "transition_rope_recompute"

    args = ["diag", str(folder), "--dtype", "float32", "--mode", "transition", "--segments"]
    args += [" ".join(map(str, seg)) for seg in segs] + ["--token-ids"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "linear" in out and "full" in out and "logits" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["rows"][1]["kind"] == "linear" and report["rows"][0]["deviation"] == 0.0


@on_worker_of("engine-ring")
def test_random_order_many_requests_keep_counters_consistent(build):
    model, vocab = build("ring")
    engine = Engine(model, mode="transition_rope")
    segs = _request(vocab, seed=6)
    rng = random.Random(0)
    for _ in range(3):
        docs = segs[:-1]
        rng.shuffle(docs)
        engine.prefill(docs + [segs[-1]])
    stats = engine.cache.stats
    assert stats.misses == NUM_DOCS and stats.hits == 2 * NUM_DOCS and stats.entries == NUM_DOCS


def test_dropped_entries_reach_on_drop_once_and_only_when_unpinned():
    """The engine frees an entry's pool slot in on_drop: that must never run while a request holds the entry."""
    from hypic_jax.cache import Entry, SegmentCache

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
    right after the lookup skips it, and its on_drop (which frees the entry's pool slot) runs once, after the
    request lets go. Pinned after the lookup instead, the entry could be evicted in between and its slot freed
    twice (once by the eviction, once by the unpinning), the second time while another entry may own it."""
    import threading

    from hypic_jax.cache import Entry, SegmentCache

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


def test_entry_pool_slots_layout_and_growth():
    """Pool rows hold exactly what was stored; pieces of another layout stay out of the pool; growth keeps rows."""
    from hypic_jax import linear_attn as la
    from hypic_jax.pool import EntryPool
    from hypic_jax.spans import KVEntry, LinearEntry, PoolSlot

    rng = np.random.default_rng(0)

    def layers(dim=4):
        arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
        return (LinearEntry(la.Summary("dense", arr(2, dim, dim), arr(2, dim, dim)), arr(3, 8)),
                KVEntry(arr(5, 1, 4), arr(5, 1, 4)))

    pool = EntryPool()
    stored = [layers() for _ in range(3)]
    pool.reserve(stored[0], 2)
    slots = []
    for entry in stored:  # the third store grows the pool (2 -> 4) with the first two rows in place
        slot, kept = pool.store(entry)
        assert isinstance(kept[0], PoolSlot) and kept[1] is entry[1]
        slots.append(slot)
    assert pool.capacity == 4 and pool.in_use == 3 and len(set(slots)) == 3
    for slot, entry in zip(slots, stored):
        np.testing.assert_array_equal(pool.pools[0].summary.transfer[slot], entry[0].summary.transfer)
        np.testing.assert_array_equal(pool.pools[0].conv[slot], entry[0].conv)
    assert pool.pools[1] is None
    other = layers(dim=8)  # another state width: not this pool's layout, kept as arrays
    assert pool.store(other) == (None, other)
    pool.release(slots[1])
    assert pool.store(stored[1])[0] == slots[1] and pool.capacity == 4  # the freed slot, no growth
    with pytest.raises(ValueError, match="not in use"):
        pool.release(99)
    assert not pool.trim()  # slots in use: the pools stay
    for slot in slots:
        pool.release(slot)
    assert pool.trim() and pool.pools is None and pool.capacity == 0
    slot, _ = pool.store(stored[0])  # allocates anew
    np.testing.assert_array_equal(pool.pools[0].conv[slot], stored[0][0].conv)


@on_worker_of("engine-qwen_dense")
def test_concurrent_requests_under_a_tight_budget_match_sequential_ones(build):
    """Requests from several threads on one engine, with a budget of about one entry: entries are inserted,
    replaced (two threads missing the same document) and evicted while other requests hold them, and pool slots
    are freed and reused meanwhile. Every answer equals the one a roomy engine gives for the same request."""
    import threading

    model, vocab = build("qwen_dense")
    base = _request(vocab, seed=8)
    requests = [[base[i] for i in order] + [base[-1]] for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0), (0, 2, 1))]
    roomy = Engine(model, seam=SEAM)
    want = [roomy.prefill(r).logits for r in requests]
    entry_bytes = roomy.cache.stats.bytes // NUM_DOCS
    tight = Engine(model, seam=SEAM, cache_bytes=entry_bytes + entry_bytes // 2)
    tight.prefill(requests[0])  # compile first: threads then race on the cache, not on compilation
    got, errors = {}, []

    def worker(j):
        try:
            for _ in range(2):
                got.setdefault(j, []).append(tight.prefill(requests[j]).logits)
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
    stats = tight.cache.stats
    assert stats.bytes <= stats.capacity_bytes and tight.pool.in_use == stats.entries  # no slot leaked


_COMPILE_CACHE_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax import monitoring
import hypic_jax
from hypic_jax.engine import Engine
hits = []
monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
engine = Engine.from_pretrained({folder!r}, dtype="float32", seam=4, compile_cache={cache!r})
rng = np.random.default_rng(0)
segs = [rng.integers(3, 128, 12).tolist() for _ in range(3)] + [rng.integers(3, 128, 5).tolist()]
first = np.asarray(engine.prefill(segs).logits)
jax.clear_caches()  # in-memory programs gone: the next request must come from the folder
engine.clear_cache()
again = np.asarray(engine.prefill(segs).logits)
print("HITS", len(hits), "SAME", bool(np.array_equal(first, again)))
"""


def test_compile_cache_serves_programs_from_disk(tmp_path):
    """Engine(compile_cache=...) keeps compiled programs in a folder (JAX's persistent cache, process-wide, hence a
    child process here): after the in-memory caches are cleared the same request loads them from the folder and
    gives the same logits; a path that cannot be a folder is refused."""
    import os
    import subprocess
    import sys

    from qwen_helpers import build, save

    save(build("moe"), tmp_path / "model")  # here: the child needs neither torch nor transformers
    cache = tmp_path / "programs"
    script = _COMPILE_CACHE_SCRIPT.format(folder=str(tmp_path / "model"), cache=str(cache))
    env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("HITS"))
    _, hits, _, same = line.split()
    assert int(hits) > 0 and same == "True"
    assert any(cache.iterdir())
    (tmp_path / "file").write_text("x")
    from hypic_jax.engine import use_compile_cache

    with pytest.raises(ValueError, match="compile_cache"):
        use_compile_cache(tmp_path / "file" / "sub")


# Last in the module (and in its worker's group): it clears JAX's caches, which every test of the same checkpoint
# after it would otherwise compile again.
@on_worker_of("engine-qwen_moe")
def test_positioned_attention_path_with_and_without_packed_heads(build, monkeypatch):
    """The GPU's attention path of the combine (the positioned flash kernel, run here in the Pallas interpreter),
    with the query heads of a key/value head packed into one program or not, gives the XLA path's logits."""
    import functools

    from hypic_jax import spans
    from hypic_jax.pallas import attention as pattn

    model, vocab = build("qwen_moe")
    segs = _request(vocab, seed=7)
    shuffled = [segs[i] for i in (1, 2, 0)] + [segs[-1]]
    plain = Engine(model, seam=SEAM)
    want = [plain.prefill(r).logits for r in (segs, shuffled)]
    used = []

    def interpreted(*args, config, **kwargs):
        used.append(config.pack_gqa)
        return pattn.positioned_attention(*args, config=config, interpret=True, **kwargs)

    monkeypatch.setattr(spans, "_positioned_kernel_fits", lambda q, k, v: True)
    monkeypatch.setattr(spans, "positioned_attention", interpreted)
    jax.clear_caches()  # the plain engine's compiled programs (XLA path) share these engines' jit keys
    try:
        for pack in (False, True):
            engine = Engine(model, seam=SEAM, attention_pack_gqa=pack)
            for request, logits in zip((segs, shuffled), want):
                assert _rel(engine.prefill(request).logits, logits) < 1e-5
    finally:
        jax.clear_caches()  # no program compiled with the interpreted kernel outlives the patch
    assert set(used) == {False, True}
