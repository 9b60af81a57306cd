"""A decode step and a stitched PIC request in one program (`Engine.slot_decode_and_prefill`, the `fused` programs of
`LimitOptions.fused_prefill_tokens`): the same ids, log-probabilities, request logits and decode caches as the
step, the prefill and the insert run apart, on the tiny checkpoints of every architecture, and split over two devices;
requests it cannot fuse (a plain prefill, a sampler that truncates, a rung above the option) run apart on the same
engine; the scheduler that admits through it gives every request the tokens it gets without it."""

from __future__ import annotations

import numpy as np
import pytest

from hypic_jax.engine import Engine
from hypic_jax.engine.programs import ProgramKey
from hypic_jax.engine.sampling import SamplingRows

from helpers import arch_params, rel_err, schedule_all

ROWS = 4  # the bucket stepped; rows 0-2 run streams, row 3 takes the request
LIMITS = dict(max_prompt_tokens=256, max_segments=6, token_rungs=(64, 256), max_new_tokens=8, max_batch=ROWS,
              cache_bytes=1 << 24, seam=4)


def _sampling(rows: int, step: int, top_k: int = 0) -> SamplingRows:
    """Greedy and seeded draws mixed: row i at temperature 0 when even, 0.8 when odd."""
    return SamplingRows.build([0.0 if i % 2 == 0 else 0.8 for i in range(rows)], [1.0] * rows, [top_k] * rows,
                              [7 + i for i in range(rows)], [step] * rows)


def _start_streams(engine, prompts):
    """Each prompt prefilled (full recompute) into rows 0, 1, ...; returns (the next tokens, the lengths)."""
    tokens = []
    for row, segs in enumerate(prompts):
        pre = engine.prefill(segs, mode="full_recompute")
        tokens.append(int(engine.slot_insert(row, pre, _sampling(1, 0)).ids[0]))
    lengths = [sum(map(len, segs)) for segs in prompts]
    return tokens + [0] * (ROWS - len(prompts)), lengths + [0] * (ROWS - len(prompts))


def _steps(engine, tokens, lengths, steps: int) -> list:
    out = []
    for step in range(steps):
        sampled = engine.slot_decode(np.asarray(tokens, np.int32), lengths, _sampling(ROWS, 10 + step))
        out.append((sampled.ids, *sampled.logprobs()))
        tokens, lengths = sampled.ids, [n + 1 for n in lengths]
    return out


# Qwen3.5 dense shares every function of the fused path but the MLP's with the MoE checkpoint
@pytest.mark.parametrize("arch", arch_params("fused", ("qwen_moe", "ring", "kimi")))
def test_fused_step_equals_the_programs_apart(arch, tiny_checkpoints):
    model, vocab, _ = tiny_checkpoints(arch)
    rng = np.random.default_rng(5)
    streams = [[rng.integers(3, vocab, n).tolist() for n in lengths] for lengths in ((21, 9), (30,), (12, 5, 7))]
    docs = [rng.integers(3, vocab, n).tolist() for n in (26, 11, 40)]
    fresh_doc = rng.integers(3, vocab, 17).tolist()
    query = rng.integers(3, vocab, 6).tolist()
    requests = [  # (segments, mode, fused?)
        (docs + [query], "transition_rope_recompute", True),  # every document cached: hits only
        ([docs[1], fresh_doc, docs[0], query], "transition_rope_recompute", True),  # a miss, prefilled cold first
        (docs + [query], "transition", True),
        (docs + [query], "full_recompute", False),  # a plain program: apart
    ]
    if arch != "qwen_moe":  # another mode and a plain program take the same paths on every architecture
        requests = requests[:2]
    fused = Engine(model, fused_prefill_tokens=64, **LIMITS)
    apart = Engine(model, **LIMITS)
    ran = []  # per call of the fused engine: whether its fused program ran
    run_fused = fused._run_fused
    fused._run_fused = lambda *a, **k: ran.append(run_fused(*a, **k)) or ran[-1]
    assert fused.fused_rungs == (64,) and apart.fused_rungs == ()
    for engine in (fused, apart):
        engine.prefill(docs + [query])  # the documents' entries
    for segments, mode, fusable in requests:
        results = []
        for engine in (fused, apart):
            tokens, lengths = _start_streams(engine, streams)
            before = engine.programs.stats.programs
            step, first, result = engine.slot_decode_and_prefill(
                np.asarray(tokens, np.int32), lengths, _sampling(ROWS, 1), segments, ROWS - 1, _sampling(1, 0),
                mode=mode)
            assert result.decode is None and result.stats.mode == mode
            after = _steps(engine, step.ids, [n + 1 for n in lengths[:-1]] + [len(result.tokens)], 3)
            results.append(((step.ids, *step.logprobs()), (first.ids, *first.logprobs()), result, after,
                            engine.programs.stats.programs - before))
        (step_f, first_f, res_f, after_f, _), (step_a, first_a, res_a, after_a, _) = results
        assert [r is not None for r in ran] == ([True] if fusable else []), mode
        ran.clear()
        np.testing.assert_array_equal(step_f[0], step_a[0], err_msg=mode)
        np.testing.assert_array_equal(first_f[0], first_a[0], err_msg=mode)
        for x, y in zip(step_f[1:] + first_f[1:], step_a[1:] + first_a[1:]):
            assert rel_err(x, y, norm="max") < 1e-5, mode
        assert rel_err(res_f.logits, res_a.logits, norm="max") < 1e-5, mode
        assert res_f.stats.recomputed_tokens == res_a.stats.recomputed_tokens, mode
        for k, (x, y) in enumerate(zip(after_f, after_a)):  # the rows' caches and the request's, stepped on
            np.testing.assert_array_equal(x[0], y[0], err_msg=f"{mode} step {k}")
            assert rel_err(x[1], y[1], norm="max") < 1e-5, (mode, k)
    assert ProgramKey("fused", 64, fused.max_keys, ROWS) in fused.programs
    assert not any(k.kind == "fused" for k in apart.programs._compiled)

    if arch != "qwen_moe":  # what runs apart is the architecture's own programs, checked above: one suffices
        fused.close()
        apart.close()
        return
    # a sampler that truncates, and a request over the fused rungs, run apart on the fused engine
    compiled = {k for k in fused.programs._compiled if k.kind == "fused"}
    long_docs = [rng.integers(3, vocab, n).tolist() for n in (60, 50)]
    fused.prefill(long_docs + [query])
    for segments, seam, top_k in ((docs + [query], 4, 5), (long_docs + [query], 40, 0)):
        tokens, lengths = _start_streams(fused, streams)
        step, first, result = fused.slot_decode_and_prefill(
            np.asarray(tokens, np.int32), lengths, _sampling(ROWS, 1, top_k), segments, ROWS - 1,
            _sampling(1, 0, top_k), mode="transition_rope_recompute", seam=seam)
        assert len(step.ids) == ROWS and len(first.ids) == 1 and result.decode is None
        assert [r is not None for r in ran] == [False], (seam, top_k)
        ran.clear()
    assert {k for k in fused.programs._compiled if k.kind == "fused"} == compiled
    with pytest.raises(ValueError, match="not a batch bucket"):
        fused.slot_decode_and_prefill(np.zeros(3, np.int32), [1] * 3, _sampling(3, 0), docs + [query], 0,
                                      _sampling(1, 0))
    with pytest.raises(ValueError, match="row must lie"):
        fused.slot_decode_and_prefill(np.zeros(ROWS, np.int32), [1] * ROWS, _sampling(ROWS, 0), docs + [query],
                                      ROWS, _sampling(1, 0))
    fused.close()
    apart.close()


def test_the_scheduler_admits_in_fused_steps_with_the_same_tokens():
    """The scheduler of an engine with fused programs admits a request with streams running in one program with
    their step (`Scheduler.fused_steps`); every request gets the tokens, log-probabilities and finish reasons of an
    engine without them, with and without overlapped steps (with overlap a fused step chains onto the step in
    flight; requests that truncate or rank, or that come when nothing runs, are admitted apart)."""
    from hypic_jax.demo import tiny_model
    from hypic_jax.engine import SamplingParams
    from hypic_jax.engine.scheduler import Scheduler

    model = tiny_model()
    limits = dict(max_prompt_tokens=64, token_rungs=(64,), max_new_tokens=6, max_batch=4, seam=2,
                  cache_bytes=1 << 24)
    rng = np.random.default_rng(12)
    specs = []
    for i in range(10):
        segments = [rng.integers(3, 200, int(n)).tolist() for n in rng.integers(2, 14, rng.integers(2, 4))]
        truncates = i % 5 == 4
        params = SamplingParams(max_tokens=int(rng.integers(2, 7)), temperature=float(rng.choice([0.0, 0.8])),
                                top_k=5 if truncates else 0, seed=int(rng.integers(1 << 30)),
                                logprobs=2 if truncates else None)
        specs.append((segments, params))

    def run(engine, overlap: bool):
        scheduler = Scheduler(engine, overlap=overlap)
        events = schedule_all(scheduler, specs, mode="transition_rope_recompute", seam=2)
        out = []
        for es in events:
            assert es[-1]["type"] == "done", es[-1]
            logprobs = [lp for e in es if e["type"] == "delta" and e["logprobs"] for lp in e["logprobs"]]
            out.append((es[-1]["tokens"], es[-1]["finish_reason"], logprobs))
        return out, scheduler

    apart = Engine(model, **limits)  # programs compiled as the requests need them (no warmup: fewer compiles)
    fused = Engine(model, fused_prefill_tokens=64, **limits)
    want, plain = run(apart, False)
    assert plain.fused_steps == 0
    for overlap in (False, True):
        got, scheduler = run(fused, overlap)
        assert scheduler.fused_steps > 0, (overlap, scheduler.steps)
        assert (scheduler.fused_chained_steps > 0) == overlap, (overlap, scheduler.fused_chained_steps)
        for k, ((a_tokens, a_reason, a_lp), (b_tokens, b_reason, b_lp)) in enumerate(zip(got, want)):
            assert a_tokens == b_tokens and a_reason == b_reason, (overlap, k)
            for (ta, ca, _), (tb, cb, _) in zip(a_lp, b_lp):
                assert ta == tb and abs(ca - cb) < 1e-5, (overlap, k)
    for engine in (apart, fused):
        engine.close()


_SPLIT = r"""
import sys
sys.path.insert(0, sys.argv[2])
import numpy as np, jax
from helpers import load_tiny, rel_err
from hypic_jax.engine import Engine
from hypic_jax.engine.sampling import SamplingRows

model, vocab, _ = load_tiny("qwen_moe", sys.argv[1])
base = dict(max_prompt_tokens=128, max_segments=4, token_rungs=(128,), max_new_tokens=4, cache_bytes=1 << 22,
            seam=4, max_batch=2)
rng = np.random.default_rng(0)
docs = [rng.integers(3, vocab, n).tolist() for n in (30, 12)]
query, stream = rng.integers(3, vocab, 5).tolist(), [rng.integers(3, vocab, 20).tolist()]
one = SamplingRows.build([0.0], [1.0], [0], [0], [0])
two = SamplingRows.build([0.0, 0.8], [1.0, 1.0], [0, 0], [0, 1], [1, 1])
out, ran = [], []
for engine in (Engine(model, **base), Engine(model, **base, tensor_parallel=2, fused_prefill_tokens=128)):
    engine.prefill(docs + [query])
    token = int(engine.slot_insert(0, engine.prefill(stream, mode="full_recompute"), one).ids[0])
    if engine.fused_rungs:
        run_fused = engine._run_fused
        engine._run_fused = lambda *a, **k: ran.append(run_fused(*a, **k)) or ran[-1]
    step, first, result = engine.slot_decode_and_prefill(np.asarray([token, 0], np.int32), [20, 0], two,
                                                         docs + [query], 1, one)
    after = engine.slot_decode(np.asarray([int(step.ids[0]), int(first.ids[0])], np.int32),
                               [21, len(result.tokens)], two)
    out.append((step.ids, first.ids, np.asarray(result.logits), after.ids, step.logprobs()[0], after.logprobs()[0]))
assert len(ran) == 1 and ran[0] is not None
(a, b) = out
assert (a[0] == b[0]).all() and (a[1] == b[1]).all() and (a[3] == b[3]).all(), (a, b)
assert rel_err(b[2], a[2]) < 1e-5 and np.allclose(a[4], b[4], atol=1e-4) and np.allclose(a[5], b[5], atol=1e-4)
print("ok")
"""


def test_a_fused_step_split_over_devices_equals_one_device(tiny_checkpoints):
    """With `tensor_parallel=2` (fake CPU devices, a subprocess) the fused program of the MoE checkpoint steps its
    rows and admits its request as the one-device engine's programs apart do."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers import fake_devices_env

    done = subprocess.run([sys.executable, "-c", _SPLIT, str(tiny_checkpoints("qwen_moe")[2]),
                           str(Path(__file__).parent)], env=fake_devices_env(8), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
