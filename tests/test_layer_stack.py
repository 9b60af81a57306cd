"""Layers stacked by their repeating pattern and run as one scan (`hypic_jax.models.stack`).

`LayerPlan.find` on patterns with and without a head, a tail or any repeat; a plan's (part, member) addressing
round-trips; the grouped matmul reads a scanned layer's experts out of the whole bank exactly as from the layer's
own experts. On tiny checkpoints of every architecture whose layers repeat (Qwen3.5-MoE: 2 x [GDN, GDN,
attention]; Kimi: a dense first layer, then 2 x [MLA, KDA], then KDA; Ring: 2 x [linear, linear, full], with a
decay that differs per layer), the engine with the layers scanned returns the same logits as with every layer
unrolled (prefix cache, full recompute, addition and transition_rope_recompute; hits and misses; entries demoted
to the host tier and promoted back), and its decode programs (the batched rows' insert and step) scan the layers'
stacked caches to the same logits and tokens, as does the model's own one-row decode step over a prefill's
stacked caches; and `hypic_jax.Engine` prefills and generates with a model whose layers are stacked.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypic_jax.engine import Engine, stack_layers
from hypic_jax.engine.programs import ProgramKey
from hypic_jax.engine.sampling import TOP_LOGPROBS, SamplingRows
from hypic_jax.models import layers as model_layers
from hypic_jax.models import base, stack as layer_stack
from hypic_jax.models.base import ModelCache
from hypic_jax.models.stack import ExpertBank, ExpertChunks, LayerPlan, LayerStack
from helpers import LONG, RING_CONFIG, VOCAB, primitives_outside_kernels, reference_model, rel_err, save_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

L, F = "linear", "full"


@pytest.mark.parametrize("signatures, expected", [
    ([L, L, L, F] * 10, (0, 4, 10)),
    (["dense"] + [L, F] * 2 + [L], (1, 2, 2)),
    ([L, L, F] * 3 + [L], (0, 3, 3)),
    ([L, F, "moe"], (3, 0, 0)),  # nothing repeats: every layer unrolled
    ([L], (1, 0, 0)),
    ([L] * 6, (0, 1, 6)),
])
def test_find_plan(signatures, expected):
    plan = LayerPlan.find(signatures)
    assert (plan.head, plan.period, plan.repeats) == expected
    assert plan.layers == len(signatures)


@pytest.mark.parametrize("seed", range(6))
def test_plan_addressing_round_trips(seed):
    rng = np.random.default_rng(seed)
    head, period, repeats, tail = (int(x) for x in rng.integers(0, 4, 4))
    period, repeats = (period, repeats) if period and repeats else (0, 0)
    plan = LayerPlan(head + period * repeats + tail, head=head, period=period, repeats=repeats)
    seen = set()
    for layer in range(plan.layers):
        part, member = plan.part(layer)
        assert plan.layer(part, member) == layer
        assert 0 <= member < plan.members(part)
        seen.add((part, member))
    assert sum(plan.members(p) for p in range(plan.parts)) == plan.layers == len(seen)


def _toy_layers(rng, widths):
    """Per layer (params, cache) of a toy recurrence whose structure follows `widths` (one per layer)."""
    layers = [dict(w=jnp.asarray(rng.normal(size=(8, w)), jnp.float32), u=jnp.asarray(rng.normal(size=(w, 8)),
                                                                                      jnp.float32)) for w in widths]
    caches = [jnp.asarray(rng.normal(size=(w,)), jnp.float32) for w in widths]
    return layers, caches


def _toy_step(i, layer, params, cache, pool, x):
    """A layer with a cache, a pool and a traced layer index: (new carry, (new cache, None without one; output: the
    pool row at the layer's base, or the layer's index without pools))."""
    h = jnp.tanh(x @ params["w"] + (0.0 if cache is None else cache)) * (1.0 + 0.1 * layer)
    out = layer * jnp.ones(()) if pool is None else pool.tree[pool.base + 1]
    return x + h @ params["u"], (None if cache is None else cache + h, out)


def test_one_layer_loop_forms():
    """`run` over stacked layers (head, two repeats of a period of two, tail) equals the plain loop; it gives the
    caches back in the form given (stacked for stacked and for none, a tuple for a tuple), the outputs stacked by
    the plan, and each scanned layer reads its pool at its own base row."""
    rng = np.random.default_rng(0)
    widths = [3, 4, 5, 4, 5, 6]
    layers, caches = _toy_layers(rng, widths)
    plan = LayerStack.plan_for(layers)
    assert (plan.head, plan.period, plan.repeats) == (1, 2, 2)
    stacked = LayerStack.build(layers, plan)
    x = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    want_x, want, outs = layer_stack.run(_toy_step, x, layers, caches=tuple(caches))
    assert isinstance(want, tuple) and len(want) == len(widths)
    assert [int(o) for o in outs] == list(range(len(widths)))
    for given in (tuple(caches), LayerStack.build(caches, plan)):
        got_x, got, got_outs = jax.jit(lambda x, c: layer_stack.run(_toy_step, x, stacked, caches=c))(x, given)
        assert type(got) is type(given) and isinstance(got_outs, LayerStack)
        np.testing.assert_allclose(got_x, want_x, rtol=1e-6)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        assert [int(o) for o in got_outs] == list(range(len(widths)))
    _, none, _ = layer_stack.run(_toy_step, x, stacked)
    assert isinstance(none, LayerStack) and all(c is None for c in none)
    assert layer_stack.run(_toy_step, x, layers)[1] == (None,) * len(widths)
    # pools: three rows per layer, row 1 of layer i holding i
    pools = layer_stack.pool_stack([("slot", jax.ShapeDtypeStruct((), jnp.float32))] * len(widths), plan, slots=3,
                                   rows=0)
    parts = [jnp.zeros_like(part).at[1::3].set(jnp.asarray([plan.layer(p, m) for m in range(plan.members(p))],
                                                             jnp.float32)) for p, part in enumerate(pools.parts)]
    _, _, read = jax.jit(lambda x, pools: layer_stack.run(_toy_step, x, stacked, pools=pools))(x, pools.replace(parts))
    assert [int(o) for o in read] == list(range(len(widths)))
    # the per-layer helpers keep each form
    assert isinstance(layer_stack.stacked_like(stacked, caches), LayerStack)
    assert isinstance(layer_stack.stacked_like(layers, caches), tuple)
    doubled = layer_stack.map_layers(lambda i, c: c * (i + 1), LayerStack.build(caches, plan))
    for i, (a, b) in enumerate(zip(doubled, caches)):
        np.testing.assert_allclose(a, b * (plan.layer(plan.part(i)[0]) + 1))


def test_expert_bank_in_the_grouped_matmul():
    """A scanned layer's experts as rows of the bank (`ExpertBank`), through the Pallas kernel (interpret mode)
    and through ragged_dot, equal the layer's own experts; so does a bank stored in chunks, whose chunk the kernel
    chooses from a traced index (`grouped_matmul.ChunkedWeights`)."""
    rng = np.random.default_rng(0)
    repeats, experts, hidden, width, tokens, top = 3, 8, 32, 16, 12, 2
    gate_up = jnp.asarray(rng.normal(size=(repeats, experts, hidden, 2 * width)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(repeats, experts, width, hidden)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(experts, top, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, top)), jnp.float32)
    # the bank chunked by repeats (the last chunk shorter), as `LayerStack.build` stores banks past int32 offsets
    chunked = [ExpertChunks([w[:2], w[2:]], 2) for w in (gate_up, down)]

    @functools.partial(jax.jit, static_argnames="impl")
    def traced(layer, banks, impl):  # a traced repeat index: the kernel reads the chunk, ragged_dot's copy switches
        return model_layers.grouped_swiglu_experts(x, weights, ids, *(ExpertBank(b, layer) for b in banks), impl=impl)

    # the kernel chooses the chunk itself: no conditional in the program (on a GPU one waits for the host)
    closed = jax.make_jaxpr(functools.partial(traced.__wrapped__, impl="pallas"))(jnp.int32(1), chunked)
    outside = primitives_outside_kernels(closed.jaxpr)
    assert "pallas_call" in outside and "cond" not in outside

    for layer in range(repeats):
        want = model_layers.grouped_swiglu_experts(x, weights, ids, gate_up[layer], down[layer], impl="ragged")
        for impl in ("pallas", "ragged"):
            got = model_layers.grouped_swiglu_experts(x, weights, ids, ExpertBank(gate_up, jnp.int32(layer)),
                                                      ExpertBank(down, jnp.int32(layer)), impl=impl)
            assert rel_err(got, want, norm="max") < 1e-5, (layer, impl)
            got = model_layers.grouped_swiglu_experts(x, weights, ids, *(ExpertBank(b, layer) for b in chunked),
                                                      impl=impl)
            assert rel_err(got, want, norm="max") < 1e-5, ("chunked, static", layer, impl)
            got = traced(jnp.int32(layer), chunked, impl)
            assert rel_err(got, want, norm="max") < 1e-5, ("chunked, traced", layer, impl)
    # a bank over one array past the limit is copied out rather than indexed past int32 offsets
    seen = []
    layer_stack.with_experts(lambda w, first: seen.append((w.shape, first)), ExpertBank(gate_up, 1), max_elements=10)
    assert seen == [(gate_up.shape[1:], 0)]


def _instructions(text: str) -> tuple[dict[str, str], list[tuple[str, str, str | None]]]:
    """A compiled program's HLO text: (instruction name -> its array shape "[d0,d1,...]", and per instruction
    (opcode, shape, name of its second operand))."""
    shapes, ops = {}, []
    for line in text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = \w+(\[[\d,]*\])\S* ([\w\-]+)\(([^)]*)\)", line)
        if found:
            name, shape, op, operands = found.groups()
            shapes[name] = shape
            names = re.findall(r"%([\w.\-]+)", operands)
            ops.append((op, shape, names[1] if len(names) > 1 else None))
    return shapes, ops


# six layers, so the layer loop repeats a block: (linear, linear, full) twice for Qwen and Ring, Kimi's KDA / MLA
# alternation after a first KDA layer with a dense MLP
_DEEP = {
    "qwen_moe": dict(num_hidden_layers=6, layer_types=["linear_attention", "linear_attention", "full_attention"] * 2),
    "kimi": dict(num_hidden_layers=6, layer_types=["linear_attention"] + ["full_attention", "linear_attention"] * 2
                 + ["linear_attention"], mlp_layer_types=["dense"] + ["sparse"] * 5),
    "ring": dict(num_hidden_layers=6, first_k_dense_replace=0),
}


def _checkpoint(arch: str, folder):
    """(model, vocabulary size) of a six-layer tiny checkpoint of `arch` (`_DEEP`), loaded in float32."""
    import hypic_jax

    folder = save_checkpoint(reference_model(arch, **_DEEP[arch]), folder)
    return hypic_jax.load(folder, dtype="float32"), RING_CONFIG["vocab_size"] if arch == "ring" else VOCAB


def _expert_chunks(stack: LayerStack) -> list[ExpertChunks]:
    return [leaf for part in stack.parts for leaf in jax.tree.leaves(part, is_leaf=lambda x: isinstance(x, ExpertChunks))
            if isinstance(leaf, ExpertChunks)]


def _expert_size(model) -> int:
    """Elements of the largest layer's routed experts leaf."""
    return max(leaf.size for path, leaf in jax.tree_util.tree_flatten_with_path(model.params["layers"])[0]
               if getattr(path[-1], "key", None) in layer_stack.EXPERT_LEAVES and leaf.ndim == 3)


@pytest.fixture(scope="module", params=[  # each checkpoint's tests on one worker (`--dist loadgroup`): built once
    pytest.param((arch, chunked), id=arch + ("-chunked" if chunked else ""),
                 marks=pytest.mark.xdist_group(f"layer_stack-{arch}"))
    for arch, chunked in [("qwen_moe", True), ("kimi", False), ("ring", True)]])
def decode_engines(request, tmp_path_factory):
    """(architecture, vocab, engine with the layers scanned, engine with every layer unrolled) with room to decode,
    two batched rows and a host tier, on one tiny checkpoint. `chunked`: the routed experts stored one repeat per
    chunk (`ExpertChunks`, as banks past int32 offsets are). Every test sends both engines the same requests, so
    their caches stay alike."""
    arch, chunked = request.param
    model, vocab = _checkpoint(arch, tmp_path_factory.mktemp(arch))
    options = dict(max_prompt_tokens=128, max_segments=4, token_rungs=(128,), cache_bytes=1 << 19,
                   mean_entry_tokens=32, max_new_tokens=8, max_batch=2, host_cache_bytes=1 << 22,
                   eviction="lru")
    with pytest.MonkeyPatch.context() as patch:
        if chunked:  # the experts are stacked when the engine is made
            patch.setattr(layer_stack, "BANK_MAX_ELEMENTS", _expert_size(model))
        scanned, unrolled = Engine(model, **options), Engine(model, scan_layers=False, **options)
    assert scanned.plan.scanned and not unrolled.plan.scanned
    assert bool(_expert_chunks(scanned.params["layers"])) == chunked
    yield arch, vocab, scanned, unrolled
    scanned.close()
    unrolled.close()


def test_scanned_layers_equal_unrolled(decode_engines):
    """Scanned span programs equal unrolled ones over every mode, hits, and host-tier demotion and promotion."""
    arch, vocab, scanned, unrolled = decode_engines
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(6, 30, 4)]
    query = rng.integers(3, vocab, 7).tolist()
    requests = [("prefix_cache", [0, 1, 2]), ("transition_rope_recompute", [3, 0, 1]), "demote",
                ("transition_rope_recompute", [0, 1, 3]), ("addition", [2, 3]), ("full_recompute", [1, 3])]
    hits, promoted = 0, scanned.stats["tiers"]["promotions"]["host"]
    for request in requests:
        if request == "demote":  # the device entries go to the host tier and come back through the stacked pools
            for engine in (scanned, unrolled):
                engine.demote_all(sync=False)  # a lookup waits for its entry's demotion
            continue
        mode, order = request
        segs = [docs[i] for i in order] + [query]
        a = scanned.prefill(segs, mode=mode, seam=4)
        b = unrolled.prefill(segs, mode=mode, seam=4)
        assert (a.stats.hits, a.stats.misses) == (b.stats.hits, b.stats.misses)
        hits += a.stats.hits
        assert rel_err(a.logits, b.logits, norm="max") < 1e-5, (mode, order)
    assert hits > 0
    assert scanned.stats["tiers"]["promotions"]["host"] > promoted
    assert scanned.stats["tiers"]["promotions"] == unrolled.stats["tiers"]["promotions"]


@functools.partial(jax.jit, static_argnames=("arch", "config", "kernels"))
def _decode_one(params, token, cache, *, arch, config, kernels):
    """One greedy step of one row: the architecture's forward over a prefill's decode caches (stacked ones are
    scanned as they are)."""
    logits, cache = arch.forward(params, config, token.reshape(1, 1), cache=cache, kernels=kernels)
    return logits[0, -1], cache


def _decode_steps(engine, segs, steps: int) -> list[np.ndarray]:
    """Logits of `steps` greedy one-row decode steps (`_decode_one`, on the engine's parameters and kernels) after
    a full prefill of `segs` by the engine."""
    pre = engine.prefill(segs, mode="full_recompute")
    step = functools.partial(_decode_one, arch=engine.arch, config=engine.config, kernels=engine.kernels)
    cache = ModelCache(pre.decode, np.asarray(sum(map(len, segs)), np.int32))
    logits, out = pre.logits, []
    for _ in range(steps):
        logits, cache = step(engine.params, np.asarray(np.argmax(logits), np.int32), cache)
        out.append(np.asarray(logits))
    return out


def test_scanned_decode_equals_unrolled(decode_engines):
    """The decode caches of a scanned engine are stacked by its plan (and read like the tuple of layers); a decode
    step over them and greedy generation give the unrolled engine's logits and tokens."""
    _, vocab, scanned, unrolled = decode_engines
    rng = np.random.default_rng(2)
    segs = [rng.integers(3, vocab, n).tolist() for n in (21, 9)]
    stacked = scanned.prefill(segs, mode="full_recompute").decode
    assert isinstance(stacked, LayerStack) and stacked.plan == scanned.plan
    assert isinstance(unrolled.prefill(segs, mode="full_recompute").decode, tuple)
    for step, (a, b) in enumerate(zip(_decode_steps(scanned, segs, 4), _decode_steps(unrolled, segs, 4))):
        assert rel_err(a, b, norm="max") < 1e-5, step
    a, b = (e.generate(segs, max_new_tokens=6, mode="full_recompute") for e in (scanned, unrolled))
    assert a.tokens == b.tokens


def _batched_steps(engine, prompts, steps: int) -> list[tuple]:
    """Greedy rows: each prompt's prefill inserted into its row, then `steps` steps of every row; per call the
    sampled ids and log-probabilities."""
    out = []
    for row, segs in enumerate(prompts):
        pre = engine.prefill(segs, mode="full_recompute")
        sampled = engine.slot_insert(row, pre, SamplingRows.build([0.0], [1.0], [0], [0], [0], [TOP_LOGPROBS]))
        out.append((sampled.ids, *sampled.logprobs()))
    tokens = np.concatenate([ids for ids, *_ in out])
    lengths = np.asarray([sum(map(len, segs)) for segs in prompts])
    rows = len(prompts)
    for step in range(steps):
        sampled = engine.slot_decode(tokens, lengths, SamplingRows.build([0.0] * rows, [1.0] * rows, [0] * rows,
                                                                         [0] * rows, [step + 1] * rows,
                                                                         [TOP_LOGPROBS] * rows))
        out.append((sampled.ids, *sampled.logprobs()))
        tokens, lengths = sampled.ids, lengths + 1
    return out


def test_scanned_batched_rows_equal_unrolled(decode_engines):
    """The batched decode cache of a scanned engine holds the stacked caches with the rows on their batch axis: inserting
    prefills into rows and stepping every row gives the unrolled engine's ids and log-probabilities, and each
    row's own one-row decode (the rows' routed experts run as one list of tokens: `layers.grouped_swiglu_experts`)."""
    _, vocab, scanned, unrolled = decode_engines
    rng = np.random.default_rng(3)
    prompts = [[rng.integers(3, vocab, n).tolist() for n in lengths] for lengths in ((21, 9), (30, 4))]
    batched = _batched_steps(scanned, prompts, 3)
    for step, (a, b) in enumerate(zip(batched, _batched_steps(unrolled, prompts, 3))):
        np.testing.assert_array_equal(a[0], b[0], err_msg=f"step {step}")
        for x, y in zip(a[1:], b[1:]):
            assert rel_err(x, y, norm="max") < 1e-5, step
    rows = len(prompts)
    for row, segs in enumerate(prompts):
        single = [scanned.prefill(segs, mode="full_recompute").logits] + _decode_steps(scanned, segs, 3)
        for k, logits in enumerate(single):
            ids, chosen = (batched[row][0][0], batched[row][1][0]) if k == 0 else (
                batched[rows + k - 1][0][row], batched[rows + k - 1][1][row])
            assert ids == np.argmax(logits), (row, k)
            expected = jax.nn.log_softmax(np.asarray(logits, np.float32).reshape(-1))[ids]
            np.testing.assert_allclose(chosen, expected, rtol=1e-4, atol=1e-4, err_msg=f"row {row}, step {k}")


def _cache_loops(engine, kind: str, tokens: int, shape: tuple[int, ...]) -> int:
    """While loops of a compiled program whose state holds a float32 array of `shape`."""
    text = engine.programs.get(ProgramKey(kind, tokens, engine.max_keys)).as_text()
    array = "f32[" + ",".join(map(str, shape)) + "]"
    return sum(array in line.split(" while(")[0] for line in text.splitlines() if " while(" in line)


def test_decode_programs_scan(decode_engines):
    """The compiled decode programs of the scanned engine (the batched step of every bucket: one row, as a lone
    request decodes, and both) loop over one period of layers, their state holding the stacked caches of their
    rows (the unrolled ones have no such loop)."""
    arch, _, scanned, unrolled = decode_engines
    caches = scanned.decode_shapes().layers
    body = caches.parts[scanned.plan.head]  # the first pattern position's caches [repeats, 1, ...]
    leaf = max(jax.tree.leaves(body), key=lambda a: a.size).shape
    kinds = [("batch", 1, leaf), ("batch", 2, (leaf[0], 2) + leaf[2:])]  # rows on the batch axis
    for kind, tokens, shape in kinds:
        assert _cache_loops(scanned, kind, tokens, shape) == 1, (kind, tokens)
        assert _cache_loops(unrolled, kind, tokens, shape) == 0, (kind, tokens)
    # the keys and values stay in their stacks: none is copied whole, and in the step of every row none has a
    # whole layer's cache written back into it, only the new tokens (`base.StackedKV`; one row's layer is copied
    # out and back, a few MB)
    slots = scanned.slot_shapes()
    stacked_kv = [leaf for p, part in enumerate(slots.parts) if scanned.plan.members(p) > 1
                  and isinstance(part, base.KVCache) for leaf in (part.k, part.v)]
    assert stacked_kv or arch == "kimi", arch  # Kimi's attention caches are MLA latents, copied per layer
    for rows in (2, 1):
        shapes, writes = _instructions(scanned.programs.get(ProgramKey("batch", rows, scanned.max_keys)).as_text())
        for leaf in stacked_kv:
            stack = (leaf.shape[0], rows) + leaf.shape[2:]
            member = "[" + ",".join(map(str, (1,) + stack[1:])) + "]"
            stack = "[" + ",".join(map(str, stack)) + "]"
            assert not [op for op, shape, _ in writes if op == "copy" and shape == stack], (arch, rows)
            assert rows == 1 or not [op for op, shape, update in writes if op == "dynamic-update-slice"
                                     and shape == stack and shapes.get(update) == member], (arch, rows)


def test_batched_decode_programs_have_no_conditionals(decode_engines):
    """The programs of a batched decode step, and the insert, have no conditional of their own: on a GPU the host
    waits at a conditional for the device to reach it (its predicate is read back), so a step that had one could
    not be issued ahead of the one before (`Scheduler(overlap=True)`). Sampling chooses its truncating, ranking
    program on the host instead (`SamplingRows.full`). The one conditional left is a chunked expert bank's on the
    CPU, inside the layer loop: there the experts go through `ragged_dot`, which takes the layer's experts chosen
    by `lax.switch`; a GPU's kernel reads the chunk itself (`grouped_matmul.ChunkedWeights`)."""
    arch, _, scanned, unrolled = decode_engines
    chunked = bool(_expert_chunks(scanned.params["layers"]))
    for engine in (scanned, unrolled):
        for kind, rows in (("batch", 1), ("batch", 2), ("batch_full", 2), ("insert", 1), ("insert_full", 1)):
            text = engine.programs.get(ProgramKey(kind, rows, engine.max_keys)).as_text()
            conditionals = [line for line in text.splitlines() if " conditional(" in line]
            allowed = [line for line in conditionals if chunked and engine.plan.scanned and "/while/" in line]
            assert conditionals == allowed, (arch, kind, rows, engine.plan.scanned)


@LONG
def test_engine_runs_stacked_layers(tmp_path):
    """`hypic_jax.Engine` and `Model` read a `LayerStack` like the list of layers (static slices; experts as
    banks): an engine on a stacked model prefills and generates like one with every layer unrolled, and uses the
    model's stack (no copy) and its plan."""
    model, vocab = _checkpoint("qwen_moe", tmp_path / "qwen")
    stacked = stack_layers(model)
    assert isinstance(stacked.params["layers"], LayerStack) and stacked.params["layers"].plan.repeats == 2
    rng = np.random.default_rng(1)
    segs = [rng.integers(3, vocab, n).tolist() for n in (30, 20, 5)]
    options = dict(max_prompt_tokens=128, max_segments=4, token_rungs=(128,), max_new_tokens=8, max_batch=1,
                   cache_bytes=1 << 22)
    unrolled_engine, stacked_engine = Engine(model, scan_layers=False, **options), Engine(stacked, **options)
    assert not unrolled_engine.plan.scanned
    want = unrolled_engine.prefill(segs, mode="full_recompute").logits
    got = stacked_engine.prefill(segs, mode="full_recompute").logits
    assert rel_err(got, want, norm="max") < 1e-5
    tokens = np.asarray([segs[0][:12]], np.int32)
    np.testing.assert_allclose(np.asarray(stacked.logits(tokens)), np.asarray(model.logits(tokens)), atol=1e-5)
    # decoding: the prefill's caches come out stacked, and each step scans them
    want = unrolled_engine.generate(segs, max_new_tokens=5).tokens  # the engine's default mode: PIC spans
    assert stacked_engine.generate(segs, max_new_tokens=5).tokens == want
    # the engine on the stacked model uses its stack (no copy) and its plan
    assert stacked_engine.params["layers"] is stacked.params["layers"]
    assert stacked_engine.plan == stacked.params["layers"].plan and stacked_engine.plan.scanned
    unrolled_engine.close()
    stacked_engine.close()


def _decode_keys(engine) -> list[ProgramKey]:
    """The ladder's programs but the cold and stitched ones: every program that takes or makes the decode cache,
    and the full prefill `_batched_steps` runs (the others never touch the cache, and the test never runs them)."""
    return [k for k in engine.programs.keys_for(engine.max_prompt_tokens) if k.kind not in ("cold", "pic")]


@LONG
def test_decode_cache_layouts_do_not_change_results(monkeypatch):
    """slot_layouts="auto" (the compiler picks the batched decode cache's layouts; the CPU keeps row-major) and a
    cache forced into non-default layouts (the two minor axes of every leaf of rank >= 3 swapped, in every program
    that takes it and in its allocation) decode the same ids and log-probabilities as the default layouts, and
    compile nothing once the ladder's decode programs are (`_decode_keys`). An unknown choice is refused."""
    from jax.experimental.layout import Format, Layout

    from hypic_jax.demo import tiny_model
    from hypic_jax.engine.programs import Programs, backend_compiles

    model = tiny_model()
    rng = np.random.default_rng(5)
    prompts = [[rng.integers(3, 200, n).tolist() for n in lengths] for lengths in ((17, 5), (12, 3))]
    # compile_cache="none": the engine's program store keys a program by the kernel options (slot_layouts), not by
    # the formats `slot_formats` returns, so the swapped run would load the default run's programs from it
    options = dict(max_prompt_tokens=64, token_rungs=(64,), max_new_tokens=8, max_batch=2, cache_bytes=1 << 22,
                   compile_cache="none")

    def swapped(self):
        shapes = self.engine.slot_shapes()
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

        def form(s):
            order = tuple(range(s.ndim)) if s.ndim < 3 else tuple(range(s.ndim - 2)) + (s.ndim - 1, s.ndim - 2)
            return Format(Layout(major_to_minor=order), device)

        return jax.tree.map(form, shapes)

    runs = {}
    for name in ("default", "auto", "swapped"):
        with monkeypatch.context() as patch:
            if name == "swapped":
                patch.setattr(Programs, "slot_formats", swapped)
            engine = Engine(model, slot_layouts="auto" if name == "auto" else "default", **options)
            engine.programs.compile(_decode_keys(engine), progress=False)
            before = backend_compiles()
            runs[name] = _batched_steps(engine, prompts, 3)
            assert backend_compiles() == before, name
            if name == "swapped":
                leaf = next(a for a in jax.tree.leaves(engine._slots) if a.ndim >= 3)
                assert leaf.format.layout.major_to_minor[-2:] == (leaf.ndim - 1, leaf.ndim - 2)
            engine.close()
    for name in ("auto", "swapped"):
        for step, (a, b) in enumerate(zip(runs[name], runs["default"])):
            np.testing.assert_array_equal(a[0], b[0], err_msg=f"{name}, step {step}")
            for x, y in zip(a[1:], b[1:]):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=f"{name}, step {step}")
    with pytest.raises(ValueError, match="slot_layouts"):
        Engine(model, slot_layouts="fast", **options)
