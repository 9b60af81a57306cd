"""The shape-stable span programs' linear cores through the Pallas kernels (`stitch.linear_over_layout(impl=
"pallas")`, `pallas.gdn.gdn_varlen` with per-segment initial states), in the Pallas interpreter on the CPU, against
the XLA chunk loops: the same outputs, states, summaries and recorded entries on random layouts, and no compilation
per layout.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax.stitch import layout as lay
from hypic_jax.core import linear_attn
from hypic_jax import stitch
from hypic_jax.core.linear_attn import Summary
from hypic_jax.kernels import gdn
from helpers import (LAYOUT_CAP, LAYOUT_HEADS, LAYOUT_SLOTS, LONG, layout_core, layout_inputs, layout_pool,
                     random_layout, rel_err)

TOL = 1e-4  # relative (largest entry), float32 inputs and "ieee" kernel dots
HK, H, K, V = LAYOUT_HEADS
CAP, SLOTS = LAYOUT_CAP, LAYOUT_SLOTS


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_layout_core_kernels_match_the_xla_loops(per_key):
    """Outputs of real tokens, the final state, every fresh piece's end state and own (T, S), and the records, on
    random layouts of each program kind; every layout of one kind and capacity runs one compiled program."""
    rng = np.random.default_rng(3 + per_key)
    pool = layout_pool(rng)
    for kind in ("cold", "plain", "pic"):
        isolated, summaries = kind == "cold", kind != "plain"
        compiled = None
        for trial in range(3):
            spans, arrays = random_layout(rng, kind)
            inputs = layout_inputs(rng, per_key)
            run = functools.partial(layout_core, inputs, pool, arrays, summaries=summaries, isolated=isolated)
            before = layout_core._cache_size()
            xla, kernel = run(impl="xla"), run(impl="pallas")
            if compiled is None:
                compiled = layout_core._cache_size()
            else:  # a new layout of the same capacity compiles nothing
                assert layout_core._cache_size() == compiled == before, (kind, trial)
            valid = np.asarray(arrays.valid)
            fresh = np.asarray(arrays.piece_kind) == lay.PIECE_FRESH
            what = (kind, trial, [(s.kind, s.length, s.record_from) for s in spans])
            assert rel_err(kernel[0][valid], xla[0][valid], norm="max") < TOL, what
            assert rel_err(kernel[1], xla[1], norm="max") < TOL, what
            assert rel_err(kernel[2][fresh], xla[2][fresh], norm="max") < TOL, what
            if summaries:
                assert rel_err(kernel[3].state[fresh], xla[3].state[fresh], norm="max") < TOL, what
                assert rel_err(kernel[3].transfer[fresh], xla[3].transfer[fresh], norm="max") < TOL, what
            used = np.asarray(arrays.record_slot) != lay.DROP
            for a, b in zip(jax.tree.leaves(kernel[4]), jax.tree.leaves(xla[4])):
                assert rel_err(np.asarray(a)[used], np.asarray(b)[used], norm="max") < TOL, what
            assert not np.any(np.asarray(kernel[0])[~valid]), "padded tokens' outputs are zeros"


def test_varlen_initial_states_and_continues():
    """`gdn_varlen` with per-segment initial states, segments that carry on from the one before, empty segments
    and offsets that end short of L (the tail belongs to no segment), against `linear_attn.chunked` per run."""
    rng = np.random.default_rng(0)
    length = 100
    cu = np.array([0, 10, 10, 47, 60, 90], np.int32)
    n = len(cu) - 1
    q = jnp.asarray(rng.standard_normal((length, HK, K)), jnp.float32)
    k = linear_attn.l2_normalize(jnp.asarray(rng.standard_normal((length, HK, K)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((length, H, V)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 0.3, (length, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (length, H)), jnp.float32)
    init = jnp.asarray(rng.standard_normal((n, H, K, V)), jnp.float32)
    rep = lambda x: jnp.repeat(x, H // HK, 1)  # noqa: E731

    @functools.partial(jax.jit, static_argnums=6)  # one program: op by op, every op compiles for every length
    def reference(q, k, v, g, beta, init, continues):
        outs, ends, state = [], [], None
        for i in range(n):
            a, b = cu[i], cu[i + 1]
            start = (state if state is not None else jnp.zeros((H, K, V))) if continues[i] else init[i]
            if a == b:
                ends.append(init[i])
                continue
            out, state = linear_attn.chunked(rep(q[a:b]), rep(k[a:b]), v[a:b], g=g[a:b], beta=beta[a:b],
                                             initial_state=start, scale=0.5, chunk_size=16)
            outs.append(out)
            ends.append(state)
        return jnp.concatenate(outs), jnp.stack(ends)

    # segments that continue run as one program; without continues each segment is a program of its own
    # (`segment_grid`), or all of them one program
    for continues, grid in (((False, False, True, False, True), True), (None, True), (None, False)):
        config = gdn.GDNConfig(chunk=16, block_v=16, transfer_group=0, segment_grid=grid)
        o, states = gdn.gdn_varlen(q, k, v, jnp.asarray(cu), g=g, beta=beta, scale=0.5, emit_summary=False,
                                   config=config, initial_state=init,
                                   continues=None if continues is None else jnp.asarray(continues), interpret=True)
        want, ends = reference(q, k, v, g, beta, init, continues or (False,) * n)
        assert want.shape == (cu[-1], H, V)
        assert rel_err(o[: cu[-1]], want, norm="max") < 1e-5  # the tail's outputs are undefined
        assert rel_err(states, ends, norm="max") < 1e-5
    with pytest.raises(ValueError, match="emit_summary"):
        gdn.gdn_varlen(q, k, v, jnp.asarray(cu), g=g, beta=beta, initial_state=init, interpret=True)


def _tiny_model():
    from hypic_jax.models import qwen3_5
    from hypic_jax.models.base import Model

    config = qwen3_5.Config(
        vocab_size=128, hidden_size=64, layer_types=("linear_attention", "linear_attention", "full_attention"),
        mlp_types=("dense",) * 3, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rotary_dim=8, linear_num_key_heads=HK, linear_num_value_heads=H, linear_key_head_dim=K,
        linear_value_head_dim=V)
    params = qwen3_5.init_params(config, jax.random.key(0), jnp.float32)
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape, a.dtype)
                          if a.ndim > 1 else a, params)
    return Model(qwen3_5, config, params)


@LONG
def test_stable_engine_kernels_match_the_xla_programs():
    """An Engine whose span programs run the GDN cores through the Pallas kernels (interpreted), and one whose
    programs fold the pieces with the blocked fold, against one running the XLA loops, on the same random
    requests of every program kind (full recompute and prefix cache: the plain program; a PIC miss: the cold
    program, then the pic program; hits): the same logits, the same pools (recorded T, S, conv tails and K/V)
    after every request, and no compilation after warmup in any."""
    from hypic_jax.engine import Engine, KernelOptions, backend_compiles

    model = _tiny_model()
    make = functools.partial(Engine, model, max_prompt_tokens=128, max_segments=4, token_rungs=(128,),
                             max_new_tokens=0, max_batch=1, cache_bytes=1 << 22, mean_entry_tokens=32,
                             eviction="lru")
    engines = {impl: make(kernels=KernelOptions(linear=impl)) for impl in ("xla", "pallas")}
    engines["blocked"] = make(kernels=KernelOptions(linear="xla", fold="blocked"))
    assert engines["pallas"].kernels.linear == "pallas" and engines["blocked"].kernels.fold == "blocked"
    for engine in engines.values():
        engine.warmup(progress=False)
    rng = np.random.default_rng(5)
    corpus = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(3, 30, 6)]
    before = backend_compiles()
    hits = 0
    for step in range(4):
        docs = [corpus[i] for i in rng.choice(len(corpus), int(rng.integers(1, 5)), replace=False)]
        segs = docs + [rng.integers(3, 128, int(rng.integers(1, 9))).tolist()]
        for mode, seam in [("full_recompute", 0), ("prefix_cache", 0), ("transition_rope_recompute", 3),
                           ("addition", 0)]:
            got = {impl: e.prefill(segs, mode=mode, seam=seam) for impl, e in engines.items()}
            what = (step, mode, [len(s) for s in segs])
            for other in ("pallas", "blocked"):
                assert rel_err(got[other].logits, got["xla"].logits, norm="max") < TOL, what + (other,)
                assert got[other].stats.cold_tokens == got["xla"].stats.cold_tokens, what + (other,)
            hits += got["xla"].stats.hits
            want = jax.tree.leaves(engines["xla"].pools.arrays)
            for other in ("pallas", "blocked"):
                for a, b in zip(want, jax.tree.leaves(engines[other].pools.arrays)):
                    assert rel_err(b, a, norm="max") < TOL, what + (other,)
    assert hits > 0, "no request read a cached entry"
    assert backend_compiles() == before, "a request compiled after warmup"
    assert all(e.stats["programs"]["serving_compiles"] == 0 for e in engines.values())
    for engine in engines.values():
        engine.close()


def test_a_kernel_that_fails_to_compile_falls_back_to_the_xla_loops(monkeypatch):
    """When the engine picks the kernels by itself (kernels.linear and kernels.fold "auto") and a span program
    fails to lower with them, it is compiled with XLA instead (a warning says so): the blocked fold over the
    pieces, the chunk loops for the linear cores; an explicit "pallas" raises. Off a GPU "auto" never picks the
    kernels, so "auto" is made to pick them here as it does on a GPU (`stitch.linear_kernel_fits`)."""
    from hypic_jax.engine import Engine, KernelOptions
    from hypic_jax.engine.programs import ProgramKey

    model = _tiny_model()

    def broken(*args, **kwargs):
        raise NotImplementedError("no lowering for this kernel here")

    fits = stitch.linear_kernel_fits
    monkeypatch.setattr(stitch, "linear_kernel_fits", lambda inputs, impl="auto": fits(
        inputs, "pallas" if impl == "auto" else impl))
    monkeypatch.setattr(stitch, "_linear_over_layout_kernels", broken)
    make = functools.partial(Engine, model, max_prompt_tokens=64, max_segments=2, token_rungs=(64,),
                             max_new_tokens=0, max_batch=1, cache_bytes=1 << 20, mean_entry_tokens=16,
                             eviction="lru")
    engine = make()  # the engine's own choice: "auto", which picks the (broken) kernels
    assert engine.kernels.linear == "auto" and engine.kernels.fold == "auto"
    engine.programs.get(ProgramKey("plain", 64, engine.max_keys))
    assert engine.kernels.linear == "xla" and engine.kernels.fold == "blocked"  # both automatic choices fell back
    assert np.all(np.isfinite(engine.prefill([[5, 6, 7], [8, 9]], mode="full_recompute").logits))
    engine.close()
    explicit = make(kernels=KernelOptions(linear="pallas"))
    with pytest.raises(NotImplementedError):
        explicit.programs.get(ProgramKey("plain", 64, explicit.max_keys))
    assert explicit.kernels.linear == "pallas"
    explicit.close()


@pytest.mark.parametrize("form", ["dense", "diagonal", "scalar", "identity"])
def test_piece_fold_kernel_matches_the_loop(form):
    """The fold over pieces in one Pallas launch (`pallas.piece_fold`, interpreted) and the blocked fold without a
    data-bound loop (`stitch._blocked_fold`, blocks of 1 to all pieces) equal the XLA loop of `stitch._fold_pieces`
    and the plain reference: random piece kinds, slots, resets, piece counts below the capacity, dropped
    transfers, with and without fresh summaries; pieces past the count get zero states."""
    from hypic_jax.kernels import piece_fold

    rng = np.random.default_rng(["dense", "diagonal", "scalar", "identity"].index(form))
    pieces, rows, heads, key_dim, value_dim = 7, 5, 2, 16, 32
    tails = {"dense": (key_dim, key_dim), "diagonal": (key_dim,), "scalar": (), "identity": None}

    def transfer(n):
        if tails[form] is None:
            return None
        if form == "dense":
            return jnp.asarray(rng.normal(size=(n, heads) + tails[form]) / np.sqrt(key_dim), jnp.float32)
        return jnp.asarray(-rng.uniform(0, 1, size=(n, heads) + tails[form]), jnp.float32)  # log decays

    def state(n):
        return jnp.asarray(rng.normal(size=(n, heads, key_dim, value_dim)), jnp.float32)

    pool = Summary(form, state(rows), transfer(rows))
    for trial in range(4):
        count = int(rng.integers(1, pieces + 1))
        kind = np.where(rng.uniform(size=pieces) < 0.5, lay.PIECE_CACHED, lay.PIECE_FRESH)
        kind[count:] = lay.PIECE_PAD
        reset = rng.uniform(size=pieces) < 0.3
        reset[0] = True
        layout = types.SimpleNamespace(
            piece_kind=jnp.asarray(kind, jnp.int32), piece_slot=jnp.asarray(rng.integers(0, rows, pieces), jnp.int32),
            piece_reset=jnp.asarray(reset), num_pieces=jnp.int32(count), drop_transfer=jnp.asarray(trial == 2),
            piece_offset=jnp.zeros(pieces, jnp.int32))
        fresh = None if trial == 3 else Summary(form, state(pieces), transfer(pieces))
        fold = functools.partial(stitch._fold_pieces, pool, layout, form, fresh, None, None,
                                 (heads, key_dim, value_dim))
        want_final, want_incoming = fold("xla")
        got_final, got_incoming = fold("pallas")
        ref_final, ref_incoming = piece_fold.piece_fold_reference(
            form, kind, np.asarray(layout.piece_slot), reset, count, trial == 2, pool.transfer, pool.state,
            None if fresh is None else fresh.transfer, None if fresh is None else fresh.state)
        what = (form, trial, count, kind.tolist(), reset.tolist())
        assert rel_err(got_final, want_final, norm="max") < TOL, what
        assert rel_err(ref_final, want_final, norm="max") < TOL, what
        assert rel_err(got_incoming[:count], want_incoming[:count], norm="max") < TOL, what
        assert rel_err(ref_incoming, want_incoming, norm="max") < TOL, what
        assert not np.any(np.asarray(got_incoming)[count:]), what
        for block in (None, 1, 2, 3, pieces):
            got_final, got_incoming = fold("blocked", block=block)
            assert rel_err(got_final, want_final, norm="max") < TOL, what + (block,)
            assert rel_err(got_incoming, ref_incoming, norm="max") < TOL, what + (block,)
            assert np.all(np.isfinite(np.asarray(got_incoming))), what + (block,)


@pytest.mark.parametrize("form", ["dense", "diagonal", "scalar", "identity"])
def test_chunk_fold_kernel_matches_the_loop(form):
    """The fold with fresh pieces as chunk steps (`pallas.piece_fold.chunk_fold`, interpreted) equals its plain
    loop and, independently, the token-by-token recurrence's outputs where a piece's state is known: random piece
    kinds, fresh pieces of one to three chunks, resets, dropped transfers, counts below the capacity, with and
    without a delta rule (w); the chunks past the last piece's get zero outputs."""
    from hypic_jax.kernels import piece_fold

    rng = np.random.default_rng(10 + ["dense", "diagonal", "scalar", "identity"].index(form))
    pieces, rows, heads, key_dim, value_dim, c = 6, 4, 2, 16, 32, 8
    tails = {"dense": (key_dim, key_dim), "diagonal": (key_dim,), "scalar": (), "identity": None}
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    if form == "dense":
        pool_t = normal(rows, heads, key_dim, key_dim) / np.sqrt(key_dim)
    elif form == "identity":
        pool_t = None
    else:
        pool_t = jnp.asarray(-rng.uniform(0, 1, size=(rows, heads) + tails[form]), jnp.float32)
    pool_s = normal(rows, heads, key_dim, value_dim)
    for trial in range(4):
        count = int(rng.integers(1, pieces + 1))
        kind = np.where(rng.uniform(size=pieces) < 0.5, lay.PIECE_CACHED, lay.PIECE_FRESH)
        kind[count:] = lay.PIECE_PAD
        per_piece = np.where(kind == lay.PIECE_FRESH, rng.integers(1, 4, pieces), 0)
        piece_chunks = np.concatenate([[0], np.cumsum(per_piece)]).astype(np.int32)
        chunks = int(piece_chunks[-1]) + 2  # two padded chunks past the last piece's
        reset = rng.uniform(size=pieces) < 0.3
        reset[0] = True
        slot = rng.integers(0, rows, pieces)
        drop = trial == 2
        w = None if trial == 3 else normal(chunks, heads, c, key_dim) / 4
        operands = dict(u=normal(chunks, heads, c, value_dim), k_to_end=normal(chunks, heads, c, key_dim) / 4,
                        decay=jnp.asarray(rng.uniform(0.5, 1.0, (chunks, heads, key_dim)), jnp.float32),
                        q_decayed=normal(chunks, heads, c, key_dim), scores=normal(chunks, heads, c, c))
        args = (form, kind, slot, reset, count, drop, piece_chunks, pool_t, pool_s, w)
        want_final, want_out = piece_fold.chunk_fold_reference(*args, **operands)
        got_final, got_out = piece_fold.chunk_fold(
            form, jnp.asarray(kind), jnp.asarray(slot), jnp.asarray(reset), jnp.int32(count), jnp.asarray(drop),
            jnp.asarray(piece_chunks), pool_t, pool_s, w, **operands, algorithm=None, block_w=16, interpret=True)
        what = (form, trial, count, kind.tolist(), per_piece.tolist(), reset.tolist())
        assert rel_err(got_final, want_final, norm="max") < TOL, what
        assert rel_err(got_out, want_out, norm="max") < TOL, what
        assert not np.any(np.asarray(got_out)[piece_chunks[count]:]), what
        if trial == 1:  # the keys given transposed, as the chunk-local kernel writes them: the same fold
            transposed = dict(operands, k_to_end_t=jnp.swapaxes(operands["k_to_end"], -1, -2), k_to_end=None)
            t_final, t_out = piece_fold.chunk_fold(
                form, jnp.asarray(kind), jnp.asarray(slot), jnp.asarray(reset), jnp.int32(count), jnp.asarray(drop),
                jnp.asarray(piece_chunks), pool_t, pool_s, w, **transposed, algorithm=None, block_w=16,
                interpret=True)
            np.testing.assert_array_equal(np.asarray(t_final), np.asarray(got_final))
            np.testing.assert_array_equal(np.asarray(t_out), np.asarray(got_out))
        # an independent check of the loop: a fresh piece right after a reset starts from zero, so its first
        # chunk's outputs are its scores times U alone
        first = [p for p in range(count) if kind[p] == lay.PIECE_FRESH and reset[p]]
        for p in first:
            i = piece_chunks[p]
            alone = np.einsum("hcj,hjv->hcv", np.asarray(operands["scores"][i], np.float64),
                              np.asarray(operands["u"][i], np.float64))
            assert rel_err(got_out[i], alone, norm="max") < TOL, what + (p,)


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_stitched_layout_without_records_folds_chunks(per_key):
    """A stitched layout that records nothing (a PIC request) runs its linear core through the chunk fold when the
    fold is a kernel: the same outputs of real tokens and final state as the XLA loops, with and without cached
    transfers, with a rotation of the cached rows (RoPE'd linear layers read them gathered), queries of several
    chunks; no summaries and no piece end states come back, and no layout of the capacity compiles anew."""
    cap = lay.Capacity(tokens=96, pieces=10, keys=192, records=0, chunk=16, conv=3)
    rng = np.random.default_rng(7 + per_key)
    pool = layout_pool(rng)

    def rotate(summary, offset):  # any map of a cached row by its offset: both paths must apply it alike
        scale = jnp.cos(0.1 * offset.astype(jnp.float32))
        return Summary(summary.form, summary.state * scale, summary.transfer)

    config = gdn.GDNConfig(chunk=16, block_v=16, solve="doubling" if per_key else "tile", transfer_group=0)

    @functools.partial(jax.jit, static_argnames=("fold_impl", "rotated", "impl"))
    def core(inputs, arrays, *, fold_impl, rotated, impl="xla"):
        result = stitch.linear_over_layout(inputs, pool, arrays, summaries=True, fold_impl=fold_impl, impl=impl,
                                           rotate=rotate if rotated else None, kernel_config=config)
        assert (result.piece_summaries is None) == (fold_impl == "pallas")
        return result.outputs, result.final_state

    compiled = None
    for trial in range(4):
        spans, fresh = [], 0
        for _ in range(int(rng.integers(1, 4))):
            seam = int(rng.integers(0, 6))
            if seam:
                spans.append(lay.Span(lay.FRESH, seam))
            n = int(rng.integers(1, 30))
            spans.append(lay.Span(lay.CACHED, n, canonical_start=seam, slot=int(rng.integers(1, SLOTS)),
                                  kv_rows=np.zeros(n, np.int32)))
            fresh += seam
        query = int(rng.integers(17, 45))  # two or three chunks of 16
        spans.append(lay.Span(lay.FRESH, query))
        arrays = lay.build(spans, cap, isolated=False, tokens=np.zeros(fresh + query, np.int32), summaries=True,
                           transfer=trial != 1)
        inputs = layout_inputs(rng, per_key)
        rotated = trial >= 2
        want = core(inputs, arrays, fold_impl="xla", rotated=rotated)
        got = core(inputs, arrays, fold_impl="pallas", rotated=rotated)
        valid = np.asarray(arrays.valid)
        what = (trial, [(s.kind, s.length) for s in spans])
        assert rel_err(got[0][valid], want[0][valid], norm="max") < TOL, what
        assert rel_err(got[1], want[1], norm="max") < TOL, what
        assert not np.any(np.asarray(got[0])[~valid]), what
        if trial in (0, 3):  # the chunk-local work through the kernel of `pallas.gdn` as well
            kernel = core(inputs, arrays, fold_impl="pallas", rotated=rotated, impl="pallas")
            assert rel_err(kernel[0][valid], want[0][valid], norm="max") < TOL, what + ("kernel locals",)
            assert rel_err(kernel[1], want[1], norm="max") < TOL, what + ("kernel locals",)
        if trial == 1:
            compiled = core._cache_size()
        elif trial == 3:
            assert core._cache_size() == compiled + 3, "each rotated variant compiles once, new layouts never"
