"""Bad requests to the engine: each is refused with an error that names the argument, before any device work,
and leaves the engine as it was (cache counters, entries, pool room); the engine then serves as before.

On the demo's tiny in-memory model (`hypic_jax.demo.tiny_model`: no checkpoint, no reference stack), one `Engine`
of one token rung and one decode row shared by the module.
"""

from __future__ import annotations

import numpy as np
import pytest

from hypic_jax.demo import tiny_model
from hypic_jax.engine import MODES, Engine, EngineOptions, backend_compiles, seam_tokens
from hypic_jax.cache.pools import PoolFull

from helpers import rel_err

pytestmark = pytest.mark.xdist_group("engine-inputs")

LIMITS = dict(max_prompt_tokens=128, token_rungs=(128,), max_segments=6, max_new_tokens=8, max_batch=1)


class _Tokens:
    def __init__(self, ids):
        self.ids = ids


class CharTokenizer:
    """One token per character (its code point, below the tiny model's vocabulary of 512)."""

    def encode(self, text, add_special_tokens=False):
        return _Tokens([ord(c) % 512 for c in text])

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, tokenizer=CharTokenizer(), cache_bytes=64 << 20, **LIMITS) as engine:
        yield engine


def _state(engine):
    """What a refused request must not change."""
    return (engine.cache.stats, sorted(engine.cache._entries), engine.pools.free_slots(),
            len(engine.pools._free_pages), engine.programs.stats.programs)


def _refused(engine, error, match, call):
    """`call()` raises `error` matching `match` without compiling or running a program or touching the cache."""
    before, compiles = _state(engine), backend_compiles()
    with pytest.raises(error, match=match):
        call()
    assert backend_compiles() == compiles
    assert _state(engine) == before


GOOD = [[5, 6, 7, 8], [9, 10, 11]]


def test_segments_that_are_not_a_list_of_segments(engine):
    """A flat list of ids would become one one-token segment per id (the last one the query), bytes and a dict
    would iterate as ints and as keys, and a nested segment would be flattened into one: each is refused by name.
    Arrays, tuples and generators of segments are served."""
    for bad in ([5, 6, 7], [[5, 6], 7], [np.int64(5), [6]], (5.0, [6])):
        _refused(engine, TypeError, "is a single value", lambda: engine.prefill(bad))
    for bad in (5, b"abc", {"a": [1]}, {1, 2}, np.array(5)):
        _refused(engine, TypeError, "segments must be a string or a list of segments", lambda: engine.prefill(bad))
    for bad in ([[[1, 2], [3, 4]], [5]], [np.ones((2, 3), np.int32), [5]]):  # a nested segment, not flattened
        _refused(engine, ValueError, r"segment 0 is a nested list or array of shape \(2, 2\)|shape \(2, 3\)",
                 lambda: engine.prefill(bad))
    assert engine.segment_tokens(np.array([5, 6])) == [[5, 6]]  # a 1-D array is still one segment
    assert engine.segment_tokens([np.array([[5, 6]]), [7]]) == [[5, 6], [7]]  # and a tokenizer's [1, n] batch
    assert engine.segment_tokens(([1, 2] for _ in range(2))) == [[1, 2], [1, 2]]
    assert engine.segment_tokens([(1, 2), np.array([3], np.uint8)]) == [[1, 2], [3]]


def test_infinite_and_huge_float_ids_are_named(engine):
    """A float id is checked against the vocabulary before any integer cast, which would turn infinity into
    -9223372036854775808."""
    _refused(engine, ValueError, r"token id inf outside the vocabulary \[0, 512\)",
             lambda: engine.prefill([[float("inf")], [3]]))
    _refused(engine, ValueError, r"segment 1 holds token id 1e\+300 outside",
             lambda: engine.prefill([[3], [1e300]]))
    assert engine.segment_tokens([[1.0, 2.0], [3]]) == [[1, 2], [3]]


def test_only_none_means_the_default_mode(engine):
    """Only None means the engine's mode: an empty or zero mode is unknown, not the default."""
    for bad in ("", 0, "Prefix_Cache", "transiton"):
        _refused(engine, ValueError, "unknown mode", lambda: engine.prefill(GOOD, mode=bad))
        _refused(engine, ValueError, "unknown mode", lambda: engine.generate(GOOD, mode=bad))


def test_seam_values(engine, model):
    """NaN and infinite seams are refused by name, and so are strings and bools (True would mean the whole
    segment), alone or as a document's knob, in every mode, per request and as the engine's default (an option: a
    ValueError naming it)."""
    for mode in ("full_recompute", "transition_rope_recompute"):
        for bad in (float("nan"), float("inf"), -float("inf")):
            _refused(engine, ValueError, "seam must be a finite number",
                     lambda: engine.prefill(GOOD, mode=mode, seam=bad))
        for bad in ("8", True, [True], ["8"], [[1]]):  # a sequence is a knob per document, each a number
            _refused(engine, TypeError, "seam must be a number", lambda: engine.prefill(GOOD, mode=mode, seam=bad))
        _refused(engine, ValueError, "seam must be >= 0", lambda: engine.prefill(GOOD, mode=mode, seam=-1))
        _refused(engine, ValueError, "token count and must be an integer",
                 lambda: engine.prefill(GOOD, mode=mode, seam=1.5))
    for bad, match in ((True, "seam must be a number"), (float("nan"), "seam must be a finite number"),
                       (1.5, "token count and must be an integer")):
        with pytest.raises(ValueError, match=match):
            Engine(model, seam=bad, **LIMITS)
    assert [seam_tokens(s, 10) for s in (0, 0.25, 1.0, 1, 3, 3.0, np.int64(3), np.float32(0.5), 100)] == [
        0, 3, 10, 10, 3, 3, 3, 5, 10]


def test_cache_salt_must_be_a_string(engine):
    """A salt is a string: 5 would key the same entries as "5" (it enters the key as text), in every mode."""
    for bad in (5, ["a"], b"tenant"):
        for mode in ("full_recompute", "transition_rope_recompute"):
            _refused(engine, TypeError, "cache_salt must be a string",
                     lambda: engine.prefill([[5] * 20, [3]], mode=mode, cache_salt=bad))


def test_generation_arguments_are_checked_before_the_prefill(engine):
    """Sampling arguments are checked before the prefill runs (no device work, no entries stored): integer
    max_new_tokens and seeds, finite non-negative temperatures (a negative one is not greedy decoding), non-empty
    stop strings (an empty one would stop at the first token) and stop ids in the vocabulary; NumPy integers are
    accepted."""
    cases = [
        (TypeError, "max_new_tokens must be an integer", dict(max_new_tokens=2.5)),
        (TypeError, "max_new_tokens must be an integer", dict(max_new_tokens=None)),
        (TypeError, "max_new_tokens must be an integer", dict(max_new_tokens=True)),
        (ValueError, "max_new_tokens must be >= 0", dict(max_new_tokens=-1)),
        (ValueError, "temperature must be a finite number >= 0", dict(temperature=-1.0)),
        (ValueError, "temperature must be a finite number >= 0", dict(temperature=float("nan"))),
        (ValueError, "temperature must be a finite number >= 0", dict(temperature=float("inf"))),
        (TypeError, "temperature must be a number", dict(temperature="1")),
        (ValueError, r"top_p must lie in \(0, 1\]", dict(top_p=float("nan"))),
        (TypeError, "top_p must be a number", dict(top_p=None)),
        (ValueError, r"seed must lie in \[0, 2\*\*64\)", dict(seed=-1, temperature=1.0)),
        (ValueError, r"seed must lie in \[0, 2\*\*64\)", dict(seed=1 << 64, temperature=1.0)),
        (TypeError, "seed must be an integer", dict(seed=1.5, temperature=1.0)),
        (ValueError, "stop strings must not be empty", dict(stop="")),
        (ValueError, "stop strings must not be empty", dict(stop=["x", ""])),
        (TypeError, "stop must be strings or token ids", dict(stop=5.0)),
        (TypeError, "stop must be strings or token ids", dict(stop=[None])),
        (ValueError, r"stop token id -1 lies outside the vocabulary \[0, 512\)", dict(stop=-1)),
        (ValueError, "stop token id 512 lies outside", dict(stop=[512])),
        (ValueError, "unknown mode", dict(mode="")),
        (TypeError, "cache_salt", dict(cache_salt=1)),
    ]
    for error, match, kwargs in cases:
        _refused(engine, error, match, lambda: engine.generate([[5] * 20, [6, 7]], **kwargs))
    # accepted: NumPy integers as stop, seed and max_new_tokens, a seed of None
    out = engine.generate(GOOD, max_new_tokens=np.int64(2), stop=np.int64(7), seed=np.int64(3), temperature=0.5)
    assert 1 <= len(out.tokens) <= 2
    assert engine.generate(GOOD, max_new_tokens=1, seed=None).tokens == engine.generate(GOOD, max_new_tokens=1).tokens


def test_warmup_limits(engine):
    """warmup limits are integers from 1 to the engine's (0 would compile a rung and switch the engine to
    serving)."""
    for bad in (0, -5, 10.5):
        _refused(engine, ValueError, "max_prompt_tokens must be an integer >= 1",
                 lambda: engine.warmup(max_prompt_tokens=bad, progress=False))
    _refused(engine, ValueError, "exceeds the engine's 128", lambda: engine.warmup(max_prompt_tokens=129))
    _refused(engine, TypeError, "max_segments", lambda: engine.warmup(max_segments=7))  # one segment capacity
    assert not engine.programs.serving


def test_a_request_that_can_never_fit_leaves_the_cache_alone(model):
    """A PIC request needing more entries at once than the pools hold is refused before it looks anything up (found
    while allocating, it would first evict every other entry and count its lookups); the entries stay and serve
    (exactly: a prefix hit equals full recompute)."""
    probe = Engine(model, cache_bytes=1, **LIMITS)
    pools = probe.pools
    probe.close()
    engine = Engine(model, cache_bytes=pools.slot_bytes * 2 + 1024 * pools.token_bytes, **LIMITS)
    assert engine.pools.slots == 3  # slot 0 is the null one: two entries fit
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 512, 20).tolist() for _ in range(4)]
    query = [5, 6]
    engine.prefill([docs[0], query], mode="prefix_cache")
    engine.prefill([docs[1], query], mode="transition_rope_recompute", seam=4)
    _refused(engine, PoolFull, "no room in the cache for this request: it needs 3 entries",
             lambda: engine.prefill(docs[:3] + [query], mode="transition_rope_recompute", seam=4))
    assert isinstance(PoolFull("x"), ValueError)  # the server's 400
    hit = engine.prefill([docs[0], query], mode="prefix_cache")
    assert (hit.stats.hits, hit.stats.misses) == (1, 0)
    assert rel_err(hit.logits, engine.prefill([docs[0], query], mode="full_recompute").logits) < 1e-5
    pic = engine.prefill([docs[1], query], mode="transition_rope_recompute", seam=4)
    assert (pic.stats.hits, pic.stats.misses) == (1, 0)
    # two documents fit at once: served (and the seam-1.0 identity holds on the engine after the refusal)
    segs = docs[2:] + [query]
    assert engine.prefill(segs, mode="transition_rope_recompute", seam=4).stats.misses == 2
    whole = engine.prefill(segs, mode="transition_rope_recompute", seam=1.0)
    assert rel_err(whole.logits, engine.prefill(segs, mode="full_recompute").logits) < 1e-5


def test_limits_and_identities_at_the_edges(engine):
    """A prompt exactly at max_prompt_tokens with max_segments documents is served, and its exact modes equal full
    recompute (prefix cache cold and hit, a whole seam); one token or one segment more is refused. A single
    segment (the query alone) equals full recompute in every mode."""
    rng = np.random.default_rng(1)
    segs = [rng.integers(3, 512, 20).tolist() for _ in range(6)] + [rng.integers(3, 512, 8).tolist()]
    assert sum(map(len, segs)) == 128
    full = engine.prefill(segs, mode="full_recompute")
    for mode, seam, hits in [("prefix_cache", 8, 0), ("prefix_cache", 8, 6), ("transition_rope_recompute", 1.0, 0),
                             ("transition_rope_recompute", 20, 0)]:
        out = engine.prefill(segs, mode=mode, seam=seam)
        assert rel_err(out.logits, full.logits) < 1e-5, (mode, seam)
        assert out.stats.hits == hits
    _refused(engine, ValueError, "over the engine's max_prompt_tokens of 128",
             lambda: engine.prefill(segs[:-1] + [segs[-1] + [3]]))
    _refused(engine, ValueError, "over the engine's max_segments of 6", lambda: engine.prefill([[3]] * 6 + segs[-2:]))
    single = [rng.integers(3, 512, 5).tolist()]
    reference = engine.prefill(single, mode="full_recompute").logits
    for mode in MODES:
        assert rel_err(engine.prefill(single, mode=mode).logits, reference) < 1e-6, mode


def test_bad_cache_folders_and_budgets(model, tmp_path):
    """A disk_cache_dir that is a file (or lies under one) and a negative cache_bytes are refused, naming the
    argument."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="disk_cache_dir .* is a file, not a folder"):
        Engine(model, disk_cache_dir=afile, **LIMITS)
    with pytest.raises(ValueError, match="disk_cache_dir .*: cannot create it"):
        Engine(model, disk_cache_dir=afile / "sub", **LIMITS)
    with pytest.raises(ValueError, match="cache_bytes must be a whole number >= 0"):
        Engine(model, cache_bytes=-1, **LIMITS)


def test_engine_sizes_must_be_whole_numbers(model):
    """Sizes are integers: min_tokens below 1 would make rungs of 0 and negative tokens, and a float or a bool
    would reach the programs' shapes (max_batch=True would mean one row)."""
    base = dict(max_prompt_tokens=128, max_segments=4, max_new_tokens=4)
    for name, value in (("min_tokens", 0), ("min_tokens", -3), ("max_prompt_tokens", 100.5),
                        ("max_prompt_tokens", 0), ("max_segments", True), ("max_new_tokens", -1),
                        ("max_batch", True), ("max_batch", 2.0), ("mean_entry_tokens", 0)):
        with pytest.raises(ValueError, match=f"{name} must be a whole number >= "):
            Engine(model, **{**base, name: value})
    engine = Engine(model, **base, max_batch=np.int64(3), min_tokens=np.int64(32))
    assert engine.batch_buckets == (1, 2, 3) and engine.ladder.rungs[0] == 32
    with pytest.raises(ValueError, match="min_batch_bucket must be a whole number >= 1"):
        Engine(model, **base, min_batch_bucket=0)
    # the smallest bucket: one stream steps in a program of two rows (an accelerator's default), or of max_batch
    for max_batch, smallest, buckets in ((8, 2, (2, 4, 8)), (3, 2, (2, 3)), (6, 3, (4, 6)), (2, 4, (2,))):
        engine = Engine(model, **base, max_batch=max_batch, min_batch_bucket=smallest)
        assert engine.batch_buckets == buckets and engine.batch_bucket(1) == buckets[0]
    assert EngineOptions().resolve(max_context=None, backend="gpu").limits.min_batch_bucket == 2
    assert EngineOptions().resolve(max_context=None, backend="cpu").limits.min_batch_bucket == 1
