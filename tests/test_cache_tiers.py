"""Cache tiers of the engine (`hypic_jax.cache.tiers`): device pools, host memory, disk.

On one tiny Qwen3.5-MoE checkpoint and one token rung, with pools small enough that requests evict: demotion
then promotion returns an entry bit for bit; a second engine on the same folder (a restart) serves the first
one's entries with the same logits; flipped bytes and truncated files are detected, counted and recomputed; files
of another model are never served; a budget of 0 switches a tier off; salts stay apart; the cost policy leaves an
entry out of a tier slower than recomputing it; threads interleaving requests across the tiers keep every exact
identity and compile nothing after warmup.

Every engine here has the same pool shapes, so the engines after the first reuse its compiled programs.
"""

from __future__ import annotations

import os
import shutil
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax.cache.index import entry_key
from hypic_jax.engine import Engine, backend_compiles
from hypic_jax.cache import tiers as tr

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import rel_err  # noqa: E402

# the module on one xdist worker (`--dist loadgroup`, pyproject.toml): the donor engine warmed up once
pytestmark = pytest.mark.xdist_group("cache_tiers")

BASE = dict(max_prompt_tokens=256, max_segments=8, token_rungs=(256,), max_new_tokens=8, cache_bytes=1 << 19,
            mean_entry_tokens=64, max_batch=1)
SEAM = 4


@pytest.fixture(scope="module")
def make(tmp_path_factory, tiny_checkpoints):
    root = tmp_path_factory.mktemp("tiers")
    model, vocab, _ = tiny_checkpoints("qwen_moe")
    donor = Engine(model, **BASE, host_cache_bytes=1 << 20)
    donor.warmup(progress=False)

    def make(**options) -> Engine:
        # another model of the same shapes (`options["model"]`) runs the same programs: weights are arguments
        engine = Engine(options.pop("model", model), **{**BASE, **options})
        # the same pool shapes: the donor's compiled programs run this engine too
        engine.programs._compiled.update(donor.programs._compiled)
        if (engine.mover.leaves, engine.mover.droppable) == (donor.mover.leaves, donor.mover.droppable):
            # the copy programs too, where pieces are stored alike
            engine.mover.adopt(donor.mover)
        return engine

    make.vocab, make.root, make.model = vocab, root, model
    return make


def _docs(vocab, seed, count=4, low=24, high=56):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(low, high, count)]


def _evict_device(engine, sync: bool = True) -> None:
    engine.demote_all(sync=sync)  # sync: the demotions reach the host tier
    assert len(engine.cache) == 0


def _files(folder) -> list:
    return sorted(folder.glob(f"*/*{tr.SUFFIX}"))


def test_demotion_then_promotion_round_trips_exactly(make):
    folder = make.root / "round_trip"
    segs = _docs(make.vocab, 1) + [[5, 6, 7]]
    # a host budget that holds any two of the four entries and no three (an entry's host bytes: its staged buffers)
    mover = make(host_cache_bytes=1).mover
    sizes = sorted(mover.layout(mover.bucket(len(d) - SEAM))[1] for d in segs[:-1])
    assert sizes[-1] + sizes[-2] < sum(sizes[:3])
    engine = make(host_cache_bytes=sizes[-1] + sizes[-2], disk_cache_dir=folder)
    engine.prefill(segs, seam=SEAM)
    warm = engine.prefill(segs, seam=SEAM)
    assert warm.stats.hits == 4
    _evict_device(engine)
    stats = engine.stats["tiers"]
    assert stats["host"]["entries"] == 2 and stats["disk"]["entries"] == 2, stats
    back = engine.prefill(segs, seam=SEAM)
    assert (back.stats.hits, back.stats.misses, back.stats.cold_tokens) == (4, 0, 0)
    assert engine.stats["tiers"]["promotions"] == {"host": 2, "disk": 2}
    np.testing.assert_allclose(back.logits, warm.logits, rtol=0, atol=1e-6)

    # prefix entries: exact, so also equal to the full recompute
    full = engine.prefill(segs, mode="full_recompute")
    engine.prefill(segs, mode="prefix_cache")
    _evict_device(engine, sync=False)  # demotions in flight: a lookup waits for its entry's
    again = engine.prefill(segs, mode="prefix_cache")
    assert again.stats.hits == 4 and again.stats.recomputed_tokens == len(segs[-1])
    assert rel_err(again.logits, full.logits) < 1e-5
    assert engine.persist() == engine.stats["tiers"]["disk"]["entries"] == len(_files(folder))
    assert engine.stats["tiers"]["demote_errors"] == 0


def test_restart_serves_the_disk_and_detects_corruption(make):
    folder = make.root / "restart"
    first = make(disk_cache_dir=folder, disk_write_through=True)
    segs = _docs(make.vocab, 2) + [[9, 8]]
    first.prefill(segs, seam=SEAM)
    cached = first.prefill(segs, seam=SEAM)
    prefix = first.prefill(segs, mode="prefix_cache")
    assert len(_files(folder)) == 8  # 4 PIC + 4 prefix entries, written when stored

    second = make(disk_cache_dir=folder)  # a new process on the same folder
    assert second.stats["tiers"]["disk"]["entries"] == 8
    again = second.prefill(segs, seam=SEAM)
    assert (again.stats.hits, again.stats.cold_tokens) == (4, 0)
    np.testing.assert_allclose(again.logits, cached.logits, rtol=0, atol=1e-6)
    again_prefix = second.prefill(segs, mode="prefix_cache")
    assert again_prefix.stats.hits == 4
    np.testing.assert_allclose(again_prefix.logits, prefix.logits, rtol=0, atol=1e-6)
    assert second.stats["tiers"]["promotions"]["disk"] == 8

    # a flipped payload byte and a truncated file, found when read: dropped, counted, recomputed
    path = lambda doc: second.tiers.disk.path_of(  # noqa: E731
        entry_key(doc, fingerprint=second.fingerprint, kind="pic", seam=SEAM))
    flipped, truncated = path(segs[0]), path(segs[1])
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0x40
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    second.clear_cache()
    result = second.prefill(segs, seam=SEAM)
    assert (result.stats.hits, result.stats.misses) == (2, 2)
    assert second.stats["tiers"]["disk"]["corrupt"] == 2
    assert not flipped.exists() and not truncated.exists()
    assert rel_err(result.logits, cached.logits) < 1e-5

    # a flipped header byte, found when the folder is scanned (the index rebuilt from the headers)
    header = path(segs[2])
    data = bytearray(header.read_bytes())
    data[40] ^= 0x01
    header.write_bytes(bytes(data))
    second.tiers.disk.scan()
    assert second.stats["tiers"]["disk"]["corrupt"] == 3 and not header.exists()
    assert second.stats["tiers"]["disk"]["entries"] == 5
    second.clear_cache()
    assert second.prefill(segs, seam=SEAM).stats.hits == 1


def test_files_of_another_model_are_never_served(make):
    folder = make.root / "foreign"
    owner = make(disk_cache_dir=folder, disk_write_through=True)
    segs = _docs(make.vocab, 3) + [[4]]
    owner.prefill(segs, seam=SEAM)
    files = _files(folder)
    assert len(files) == 4

    other = make(disk_cache_dir=folder, model=make.model.replace(source="another checkpoint"))
    assert other.fingerprint != owner.fingerprint
    assert other.stats["tiers"]["disk"]["foreign"] == 4 and other.stats["tiers"]["disk"]["entries"] == 0
    # one of the owner's files under the very name the other model looks for: still not served
    theirs = other.tiers.disk.path_of(entry_key(segs[0], fingerprint=other.fingerprint, kind="pic", seam=SEAM))
    theirs.parent.mkdir(exist_ok=True)
    shutil.copy(owner.tiers.disk.path_of(entry_key(segs[0], fingerprint=owner.fingerprint, kind="pic", seam=SEAM)),
                theirs)
    other.tiers.disk.scan()
    assert other.stats["tiers"]["disk"]["entries"] == 0 and other.stats["tiers"]["disk"]["foreign"] == 9
    result = other.prefill(segs, seam=SEAM)
    assert result.stats.hits == 0 and result.stats.misses == 4
    assert all(f.exists() for f in files)  # another model's files are left alone


def test_a_budget_of_zero_switches_a_tier_off(make):
    folder = make.root / "off"
    segs_list = [_docs(make.vocab, 10 + i) + [[3]] for i in range(4)]
    none = make(host_cache_bytes=0, disk_cache_dir=folder, disk_cache_bytes=0)
    assert not none.tiers.enabled
    host_only = make(host_cache_bytes=1 << 20)
    assert host_only.tiers.disk is None
    for engine in (none, host_only):
        for segs in segs_list:
            engine.prefill(segs, seam=SEAM)
        assert engine.stats["cache"]["evictions"] > 0
    assert none.stats["tiers"]["demotions"] == 0 and not folder.exists()
    assert host_only.stats["tiers"]["host"]["entries"] == host_only.stats["cache"]["evictions"]


def test_salts_stay_apart_in_every_tier(make):
    engine = make(host_cache_bytes=1 << 20, disk_cache_dir=make.root / "salt", disk_write_through=True)
    segs = _docs(make.vocab, 4) + [[7, 7]]
    engine.prefill(segs, seam=SEAM, cache_salt="tenant-a")
    _evict_device(engine)
    assert engine.prefill(segs, seam=SEAM, cache_salt="tenant-b").stats.hits == 0
    _evict_device(engine)
    engine.tiers.clear()  # the host tier empty: tenant-a's entries only on disk
    assert engine.prefill(segs, seam=SEAM).stats.hits == 0  # no salt is a salt of its own
    assert engine.prefill(segs, seam=SEAM, cache_salt="tenant-a").stats.hits == 4


def test_an_entry_cheaper_to_recompute_is_not_kept(make):
    slow = make(host_cache_bytes=1 << 20, host_bandwidth=1.0, disk_cache_dir=make.root / "slow", disk_bandwidth=1.0)
    lru = make(host_cache_bytes=1 << 20, host_bandwidth=1.0, eviction="lru")
    for engine in (slow, lru):
        for i in range(3):
            engine.prefill(_docs(make.vocab, 20 + i) + [[3]], seam=SEAM)
        _evict_device(engine)
    stats = slow.stats["tiers"]
    assert stats["host"]["entries"] == stats["disk"]["entries"] == 0
    assert stats["host"]["skipped"] == stats["disk"]["skipped"] == stats["demotions"] > 0
    assert lru.stats["tiers"]["host"]["entries"] == lru.stats["tiers"]["demotions"] > 0  # LRU keeps everything


def test_cost_model_and_policy():
    cost = tr.CostModel()
    truth = (2e-3, 3e-5, 4e-8)
    for lengths in ([64], [256], [64] * 4, [128, 32], [200]):
        cost.observe(lengths, truth[0] + truth[1] * sum(lengths) + truth[2] * sum(n * n for n in lengths))
    assert cost.calibrated
    np.testing.assert_allclose(cost.constants, truth, rtol=1e-6)

    bandwidths = tr.Bandwidths(host=1e9, disk=1e8)
    policy = tr.Policy("cost", cost, lambda: bandwidths)
    assert policy.saved_s("disk", 100, 10**6) < policy.saved_s("host", 100, 10**6) < policy.saved_s("device", 100, 1)
    # more recompute time saved per byte ranks higher; a second use doubles it
    assert policy.rank("host", 200, 10**5, 1) > policy.rank("host", 20, 10**5, 1)
    assert policy.rank("host", 20, 10**5, 2) > policy.rank("host", 20, 10**5, 1)
    assert not policy.keeps("disk", 10, 10**9)
    with pytest.raises(ValueError, match="eviction"):
        tr.Policy("fifo", cost, lambda: bandwidths)


def test_threads_interleaving_across_tiers_keep_identities_and_compile_nothing(make):
    engine = make(host_cache_bytes=150_000, disk_cache_dir=make.root / "threads")
    engine.warmup(progress=False)
    rng = np.random.default_rng(5)
    corpus = [rng.integers(3, make.vocab, int(n)).tolist() for n in rng.integers(8, 48, 24)]
    weights = 1.0 / np.arange(1, len(corpus) + 1)
    weights /= weights.sum()
    before = backend_compiles()
    failures: list = []

    def worker(seed):
        local = np.random.default_rng(seed)
        try:
            for _ in range(8):
                docs = [corpus[i] for i in local.choice(len(corpus), int(local.integers(1, 6)), p=weights)]
                segs = docs + [local.integers(3, make.vocab, 3).tolist()]
                full = engine.prefill(segs, mode="full_recompute")
                for mode, seam in (("prefix_cache", 0), ("transition_rope_recompute", 1.0)):
                    result = engine.prefill(segs, mode=mode, seam=seam)
                    assert rel_err(result.logits, full.logits) < 1e-5, (mode, seam)
                result = engine.prefill(segs, seam=SEAM)
                assert np.all(np.isfinite(result.logits))
        except Exception as error:  # noqa: BLE001 (reported below)
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert backend_compiles() == before, "a request compiled after warmup"
    stats = engine.stats["tiers"]
    assert stats["demote_errors"] == 0
    assert stats["promotions"]["host"] > 0 and stats["promotions"]["disk"] > 0, stats
    assert engine.stats["cache"]["evictions"] > 0


def test_bfloat16_tiers_halve_the_summaries_within_a_measured_bound(make):
    folder = make.root / "compact"
    exact = make(host_cache_bytes=1 << 20)
    compact = make(host_cache_bytes=1 << 20, disk_cache_dir=folder, tier_dtype="bfloat16")
    segs = _docs(make.vocab, 6) + [[8, 9, 10]]
    deviation, stored, held = {}, {}, {}
    for name, engine in (("exact", exact), ("compact", compact)):
        engine.prefill(segs, seam=SEAM)
        warm = engine.prefill(segs, seam=SEAM)
        _evict_device(engine)
        stored[name] = engine.stats["tiers"]["host"]["bytes"]
        held[name] = list(engine.tiers.host.values())
        back = engine.prefill(segs, seam=SEAM)
        assert back.stats.hits == 4 and engine.stats["tiers"]["promotions"]["host"] == 4
        deviation[name] = rel_err(back.logits, warm.logits)
    # every float32 piece (T, S, and this float32 model's K/V rows and conv tails, padded to the entry's bucket of
    # pages) is stored in half its bytes
    mover = exact.mover
    float32 = sum(n for p in held["exact"] for (_, n), (_, _, dtype) in zip(mover.layout(p.staged.bucket)[0],
                                                                           mover.leaves) if dtype == np.float32)
    assert float32 >= sum(a.nbytes for p in held["exact"] for a in p.arrays if a.dtype == np.float32)
    assert len(held["exact"]) == 4 and float32 > 0 and stored["exact"] - stored["compact"] == float32 // 2
    assert {a.dtype for p in held["compact"] for a in p.arrays} == {np.dtype(jnp.bfloat16)}
    assert deviation["exact"] < 1e-6
    assert 0 < deviation["compact"] < 1e-2, deviation  # rounded T and S, composed in float32
    # on disk the form is part of the header: an exact engine never reads a bfloat16 file
    compact.persist()
    files = _files(folder)
    assert len(files) == 4
    reader = make(disk_cache_dir=folder)
    assert reader.stats["tiers"]["disk"]["entries"] == 0 and reader.stats["tiers"]["disk"]["foreign"] == 4
    again = make(disk_cache_dir=folder, tier_dtype="bfloat16")
    assert again.stats["tiers"]["disk"]["entries"] == 4
    assert again.prefill(segs, seam=SEAM).stats.hits == 4


def test_negligible_transfer_heads_are_not_stored(make):
    """tier_transfer_tol: a dense T's head is stored only when its largest |entry| exceeds the tolerance; the
    stored heads are the exact ones, the dropped ones were within the tolerance, tolerance 0 (only heads whose T
    decayed to exact zeros) serves the exact logits, and the kept heads survive a restart from disk. Every other
    linear value head of the model forgets at once (its gate's decay underflows to 0), as fast heads of trained
    models do over a document."""
    import jax

    def fast_heads(path, leaf):
        return leaf.at[::2].set(np.log(1e4)) if getattr(path[-1], "key", None) == "A_log" else leaf

    base = make.model
    model = base.replace(params=jax.tree_util.tree_map_with_path(fast_heads, base.params))
    exact = make(model=model, host_cache_bytes=1 << 20)
    segs = _docs(make.vocab, 7) + [[9, 10, 11]]
    exact.prefill(segs, seam=SEAM)
    warm = exact.prefill(segs, seam=SEAM)
    _evict_device(exact)
    reference = {p.key: p for p in exact.tiers.host.values()}
    assert len(reference) == 4
    for tol in (0.0, 1e-3):
        folder = make.root / f"dropped-{tol:g}"
        engine = make(model=model, host_cache_bytes=1 << 20, disk_cache_dir=folder, tier_transfer_tol=tol)
        droppable = {j for j, flag in enumerate(engine.mover.droppable) if flag}
        assert droppable and all(engine.mover.leaves[j][0] == "slot" for j in droppable)
        engine.prefill(segs, seam=SEAM)
        engine.prefill(segs, seam=SEAM)
        _evict_device(engine)
        dropped = 0
        for pieces in engine.tiers.host.values():
            ref = reference[pieces.key]
            assert set(pieces.kept) == droppable
            for j, (got, want) in enumerate(zip(pieces.arrays, ref.arrays)):
                if j not in droppable:
                    np.testing.assert_array_equal(got, want)
                    continue
                heads = pieces.kept[j].astype(int)
                np.testing.assert_array_equal(got, want[heads])
                gone = np.setdiff1d(np.arange(want.shape[0]), heads)
                assert np.abs(want[gone]).max(initial=0.0) <= tol
                assert (np.abs(want[heads]).max(axis=(1, 2), initial=0.0) > tol).all()
                dropped += len(gone)
            assert pieces.nbytes < ref.nbytes or not dropped
        assert dropped > 0, f"no head of T was negligible at tolerance {tol}"
        back = engine.prefill(segs, seam=SEAM)
        assert back.stats.hits == 4 and engine.stats["tiers"]["promotions"]["host"] == 4
        if tol == 0.0:
            np.testing.assert_allclose(back.logits, warm.logits, rtol=0, atol=1e-6)
        assert rel_err(back.logits, warm.logits) < 1e-5
        assert engine.persist() == 4
        _evict_device(engine)
        restarted = make(model=model, disk_cache_dir=folder, tier_transfer_tol=tol)
        again = restarted.prefill(segs, seam=SEAM)
        assert again.stats.hits == 4 and restarted.stats["tiers"]["promotions"]["disk"] == 4
        np.testing.assert_allclose(again.logits, back.logits, rtol=0, atol=1e-6)
        assert make(model=model, disk_cache_dir=folder).stats["tiers"]["disk"]["foreign"] == 4  # another form


def test_compact_entry_bytes_per_token_at_the_35b_shape(monkeypatch):
    """bench/cache_tiers.py's bytes per token of an entry off the device (a 512-token segment, seam 8, per
    segment token; quality.py reports it) at the Qwen3.5-35B-A3B shape: 268,800 exact (the figure of
    bench/RESULTS.md), 145,920 with T and S in bfloat16 (1.84x smaller: this bfloat16 model's K/V and conv tails
    keep their bytes), 84,480 without T as well (3.18x: 30 layers x 32 heads x 128 x 128 x 2 bytes / 512)."""
    from pathlib import Path

    import jax.numpy as jnp

    from hypic_jax.models import qwen3_5

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    from cache_tiers import entry_bytes_per_token
    from prefill import full_config

    layout = qwen3_5.pool_layout(full_config(40), jnp.bfloat16)
    assert entry_bytes_per_token(layout, 512, False, seam=8) == 268_800
    assert entry_bytes_per_token(layout, 512, True, seam=8) == 145_920
    assert entry_bytes_per_token(layout, 512, True, seam=8, transfer_kept=0.0) == 84_480


def test_an_entry_on_its_way_to_disk_is_still_found(make, monkeypatch):
    """A demotion that pushes an older entry from the host tier to disk writes its file in the background: a
    lookup of that older entry meanwhile finds it in memory (exact logits), and never waits for the drive."""
    folder = make.root / "spilling"
    engine = make(host_cache_bytes=1 << 20, disk_cache_dir=folder, eviction="lru")
    first, second = (_docs(make.vocab, seed, count=1, low=40, high=41) + [[5, 6, 7]] for seed in (11, 12))
    warm = engine.prefill(first, seam=SEAM)
    engine.prefill(second, seam=SEAM)
    with engine._device_lock:
        assert engine.cache.evict_one()  # the first entry (least recently used) to the host tier
    engine.sync_tiers()
    (held,) = engine.tiers.host.values()
    engine.tiers.host.capacity_bytes = held.nbytes * 3 // 2  # room for one entry: the next demotion spills it
    gate, writing = threading.Event(), threading.Event()
    write = tr.DiskStore.put

    def slow_write(store, pieces):
        writing.set()
        assert gate.wait(30)
        return write(store, pieces)

    monkeypatch.setattr(tr.DiskStore, "put", slow_write)
    with engine._device_lock:
        assert engine.cache.evict_one()  # the second entry: the first goes to disk
    try:
        assert writing.wait(30)
        back = engine.prefill(first, seam=SEAM)  # while the file is held back
        assert (back.stats.hits, back.stats.misses) == (1, 0)
        np.testing.assert_allclose(back.logits, warm.logits, rtol=0, atol=1e-6)
    finally:
        gate.set()
    engine.sync_tiers()
    assert engine.stats["tiers"]["disk"]["entries"] == 1 and len(_files(folder)) == 1


def test_a_promotion_overlaps_the_cold_prefill_and_a_failed_request_gives_it_back(make, monkeypatch):
    """A request with a host hit and a miss: the promotion's copy is issued while planning and written into the
    pools only after the cold prefill was issued (exact logits either way); when the request fails between the two,
    the promoted entry goes back to its tier, and the next request still hits it."""
    engine = make(host_cache_bytes=1 << 20)
    held_doc, new_doc = _docs(make.vocab, 13, count=2, low=30, high=50)
    query = [4, 5, 6]
    engine.prefill([held_doc, query], seam=SEAM)
    _evict_device(engine)
    order = []
    cold, finish = engine._prefill_missing, engine._finish_promotions

    def cold_then_note(*args, **kwargs):
        assert engine._promoting, "the promotion was not in flight when the cold prefill was issued"
        order.append("cold")
        return cold(*args, **kwargs)

    def finish_then_note():
        order.append("promotions")
        return finish()

    monkeypatch.setattr(engine, "_prefill_missing", cold_then_note)
    monkeypatch.setattr(engine, "_finish_promotions", finish_then_note)
    mixed = engine.prefill([held_doc, new_doc, query], seam=SEAM)
    assert order == ["cold", "promotions"] and (mixed.stats.hits, mixed.stats.misses) == (1, 1)
    reference = make().prefill([held_doc, new_doc, query], seam=SEAM)
    np.testing.assert_allclose(mixed.logits, reference.logits, rtol=0, atol=1e-6)

    _evict_device(engine)

    def broken(*args, **kwargs):
        raise RuntimeError("the cold prefill failed")

    monkeypatch.setattr(engine, "_prefill_missing", broken)
    with pytest.raises(RuntimeError, match="cold prefill failed"):
        engine.prefill([held_doc, _docs(make.vocab, 14, count=1)[0], query], seam=SEAM)
    assert engine.stats["tiers"]["host"]["entries"] == 2 and not engine._promoting
    monkeypatch.setattr(engine, "_prefill_missing", cold)
    again = engine.prefill([held_doc, new_doc, query], seam=SEAM)
    assert (again.stats.hits, again.stats.misses) == (2, 0)
    np.testing.assert_allclose(again.logits, reference.logits, rtol=0, atol=1e-6)


def test_host_memory_pinned_and_pageable_serve_the_same_entries(make, monkeypatch):
    """host_memory="pinned" keeps a demoted entry as one buffer in page-locked host memory (the gather program
    writes it there, or the demotion thread copies the gather's device output there); "pageable" as a numpy
    array. All promote to the same logits, and an unknown kind is refused."""
    segs = _docs(make.vocab, 15) + [[7, 8, 9]]
    logits = {}
    for kind, copy in (("pinned", "program"), ("pinned", "thread"), ("pageable", "program")):
        monkeypatch.setattr(tr.Mover, "DEMOTE_COPY", copy)
        engine = make(host_cache_bytes=1 << 20, host_memory=kind)
        assert engine.stats["tiers"]["demote_copy"] == copy
        warm = engine.prefill(segs, seam=SEAM)
        _evict_device(engine)
        held = engine.tiers.host.values()
        assert len(held) == 4
        for pieces in held:
            main = pieces.staged.main
            if kind == "pinned":
                assert main.sharding.memory_kind == "pinned_host"
            else:
                assert isinstance(main, np.ndarray)
        back = engine.prefill(segs, seam=SEAM)
        assert back.stats.hits == 4 and engine.stats["tiers"]["promotions"]["host"] == 4
        np.testing.assert_allclose(back.logits, warm.logits, rtol=0, atol=1e-6)
        logits[kind, copy] = back.logits
    np.testing.assert_array_equal(logits["pinned", "program"], logits["pageable", "program"])
    np.testing.assert_array_equal(logits["pinned", "thread"], logits["pageable", "program"])
    with pytest.raises(ValueError, match="host_memory"):
        make(host_cache_bytes=1 << 20, host_memory="managed")


def test_a_backend_without_pinned_outputs_falls_back_to_pageable_memory(make, caplog, monkeypatch):
    """Where the gather program cannot write to pinned host memory, the host tier keeps its entries in numpy
    arrays instead (with a warning), and serves them exactly."""
    import jax

    real = jax.jit

    def no_host_outputs(fn, **options):
        if getattr(fn, "__name__", "") == "_gather_fn" and options.get("out_shardings") is not None:
            raise RuntimeError("this backend has no outputs in host memory")
        return real(fn, **options)

    engine = make(host_cache_bytes=1 << 20)
    engine.mover._gather.clear()  # compiled anew below, where writing to pinned memory fails
    monkeypatch.setattr(jax, "jit", no_host_outputs)
    segs = _docs(make.vocab, 16) + [[7, 8, 9]]
    warm = engine.prefill(segs, seam=SEAM)
    with caplog.at_level("WARNING", logger="hypic_jax.cache.tiers"):
        _evict_device(engine)
    assert "pageable memory" in caplog.text and engine.mover.host_sharding is None
    assert all(isinstance(p.staged.main, np.ndarray) for p in engine.tiers.host.values())
    back = engine.prefill(segs, seam=SEAM)
    assert back.stats.hits == 4
    np.testing.assert_allclose(back.logits, warm.logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fault", ["ENOSPC", "EROFS"])
def test_a_full_or_read_only_disk_turns_the_tier_off_and_requests_go_on(make, monkeypatch, caplog, fault):
    """A disk that fills or turns read-only: the first failed write turns the disk tier off (a warning, the stats'
    `off` and `turned_off`, hypic:tier_off in /metrics), later entries are not tried against it, every request is
    answered; once the fault is gone and the tier's off time has passed, entries reach the disk again."""
    import errno

    from prometheus_client import CollectorRegistry, generate_latest

    from hypic_jax.cache.tiers import disk as disk_module
    from hypic_jax.serve.metrics import Metrics

    folder = make.root / f"fault_{fault}"
    engine = make(disk_cache_dir=folder, disk_write_through=True)
    registry = CollectorRegistry()
    Metrics(engine, registry)
    code = getattr(errno, fault)

    def failing(array):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_module, "raw_bytes", failing)
    segs = _docs(make.vocab, 21) + [[4, 5]]
    with caplog.at_level("WARNING"):
        first = engine.prefill(segs, seam=SEAM)
    disk = engine.stats["tiers"]["disk"]
    assert (disk["write_errors"], disk["turned_off"], disk["off"], disk["entries"]) == (1, 1, True, 0)
    assert disk["skipped"] == 3 and _files(folder) == []  # the other three entries never met the fault
    assert any("disk tier is off" in r.getMessage() for r in caplog.records)
    text = generate_latest(registry).decode()
    assert 'hypic:tier_off{tier="disk"} 1.0' in text and 'hypic:tier_turned_off_total{tier="disk"} 1.0' in text
    # device memory where the backend reports it (the CPU may not: then the family is there, empty)
    assert "# TYPE hypic:device_memory_bytes gauge" in text
    again = engine.prefill(segs, seam=SEAM)  # served from the device as ever
    assert again.stats.hits == 4
    np.testing.assert_allclose(again.logits, first.logits, rtol=0, atol=1e-6)

    monkeypatch.undo()
    engine.tiers.disk._off_until = 0.0  # its off time has passed
    assert engine.persist() == 4 and len(_files(folder)) == 4
    disk = engine.stats["tiers"]["disk"]
    assert (disk["off"], disk["turned_off"]) == (False, 1)
    assert 'hypic:tier_off{tier="disk"} 0.0' in generate_latest(registry).decode()


def test_host_memory_that_cannot_be_had_turns_the_host_tier_off(make, monkeypatch):
    """A demotion whose host buffers cannot be allocated drops its entry and turns the host tier off (no stack
    trace per entry); requests are answered and recompute what was dropped, exactly."""
    engine = make(host_cache_bytes=1 << 22)
    segs = _docs(make.vocab, 22) + [[6, 7]]
    first = engine.prefill(segs, seam=SEAM)

    def no_memory(*args, **kwargs):
        raise MemoryError("host buffers")

    monkeypatch.setattr(engine.hierarchy, "_stored_pieces", no_memory)
    _evict_device(engine)
    host = engine.stats["tiers"]["host"]
    assert (host["off"], host["turned_off"], host["entries"]) == (True, 1, 0)
    assert engine.stats["tiers"]["demote_errors"] == 4
    again = engine.prefill(segs, seam=SEAM)
    assert (again.stats.hits, again.stats.misses) == (0, 4)
    np.testing.assert_allclose(again.logits, first.logits, rtol=0, atol=1e-6)
