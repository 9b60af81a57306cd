"""What the benchmarks share, so that each measures the same model shapes and requests the same way: random models
at named shapes (no checkpoint needed), RAG-shaped requests, warm-call timing, logit differences, compiling an
engine's programs up front, and JSON reports.

Scripts in bench/ import it as `common` (`python bench/NAME.py` puts bench/ first on the module path); the
investigations, run from the repository root as `python -m bench.investigations.NAME`, import it as `bench.common`.
It imports nothing else from bench/, so either way loads the same code.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from hypic_jax.models import qwen3_5

# ----------------------------------------------------------------------------------------------------------------
# Models at named shapes.


def full_config(layers: int = 40) -> qwen3_5.Config:
    """The Qwen/Qwen3.5-35B-A3B shape (transformers' Qwen3_5MoeTextConfig defaults) at `layers` layers, every 4th
    one full attention."""
    return qwen3_5.Config(
        vocab_size=248320,
        hidden_size=2048,
        layer_types=qwen3_5.default_layer_types(layers),
        mlp_types=("moe",) * layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        rotary_dim=64,
        rope_theta=10_000_000.0,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    )


def small_config() -> qwen3_5.Config:
    """A toy of the same architecture (4 layers of hidden 128, 8 experts) for CPU runs of the benchmarks."""
    return qwen3_5.Config(
        vocab_size=1024,
        hidden_size=128,
        layer_types=qwen3_5.default_layer_types(4),
        mlp_types=("moe",) * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rotary_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )


def random_model(config: qwen3_5.Config, dtype, *, scan: bool = True, fp8: bool = False):
    """`config` with random weights (seed 0), its layers stacked once (`stack_layers(..., consume=True)`), so that
    every engine built on it shares one copy of the weights: an engine given an unstacked model stacks a copy of its
    own, and at the 35B-A3B shape two copies and the pools do not fit on one card (bench/RESULTS.md,
    "segment_parallel.py"). fp8: the projections and experts as block-wise FP8 weights (`models.random_params`)."""
    from hypic_jax import models
    from hypic_jax.engine import stack_layers
    from hypic_jax.models.base import Model

    params = models.random_params(qwen3_5, config, jax.random.key(0), dtype, fp8=fp8)
    return stack_layers(Model(qwen3_5, config, params), scan=scan, consume=True)


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def active_weights_per_token(config: qwen3_5.Config) -> int:
    """Weights one token multiplies (routed experts: only the top-k), excluding embedding lookup and LM head."""
    h = config.hidden_size
    total = 0
    for layer_type, mlp_type in zip(config.layer_types, config.mlp_types):
        if layer_type == qwen3_5.LINEAR:
            total += h * (config.conv_dim + config.linear_value_dim + 2 * config.linear_num_value_heads)
            total += config.linear_value_dim * h
        else:
            d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
            total += h * (2 * hq * d + 2 * hkv * d) + hq * d * h
        if mlp_type == "dense":
            total += 3 * h * config.intermediate_size
        else:
            total += h * config.num_experts + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
            total += 3 * h * config.shared_expert_intermediate_size + h
    return total


# ----------------------------------------------------------------------------------------------------------------
# Requests.


def rag_requests(vocab: int, *, corpus: int, requests: int, docs: int, min_len: int, max_len: int, seed: int,
                 fixed_len: int | None = None) -> list[list[list[int]]]:
    """`requests` RAG requests over a corpus of `corpus` random documents (log-uniform lengths in [min_len,
    max_len), or all `fixed_len`): each picks `docs` distinct documents, popular ones more often (Zipf 1.1), and
    ends with a 32 to 96-token query."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_len), corpus)).astype(int)
    if fixed_len:
        lengths = np.full(corpus, fixed_len)
    documents = [rng.integers(3, vocab, n).tolist() for n in lengths]
    weights = 1.0 / np.arange(1, corpus + 1) ** 1.1
    weights /= weights.sum()
    out = []
    for _ in range(requests):
        picked = rng.choice(corpus, size=min(docs, corpus), replace=False, p=weights)
        out.append([documents[i] for i in picked] + [rng.integers(3, vocab, int(rng.integers(32, 97))).tolist()])
    return out


def split_prompt(rng, tokens: list[int], docs: int, query: int) -> list[list[int]]:
    """The prompt as `docs` documents of random lengths (each at least a quarter of the mean) and a query of
    `query` tokens."""
    body, tail = tokens[:-query], tokens[-query:]
    floor = len(body) // (4 * docs)
    lengths = floor + rng.multinomial(len(body) - floor * docs, np.full(docs, 1.0 / docs))
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    return [body[a:b] for a, b in zip(bounds[:-1], bounds[1:])] + [tail]


# ----------------------------------------------------------------------------------------------------------------
# Measuring.


def log(*args) -> None:
    print(*args, flush=True)


def median_seconds(fn, repeats: int):
    """(median seconds of `repeats` warm calls, the last result); one untimed call first."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


def max_rel(a, b) -> float:
    """|a - b|max / |b|max in float64: the largest difference relative to the largest value."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def compile_programs(engine, tokens: int, kinds) -> tuple[int, float, dict[str, float]]:
    """Compiles the engine's programs of `kinds` up to `tokens` (`programs.keys_for`) before any request and marks
    the engine serving (a later compilation is then counted as one during serving). Returns the number of programs,
    the wall seconds and the compile seconds of each program by "kind@tokens"."""
    keys = [k for k in engine.programs.keys_for(tokens) if k.kind in kinds]
    start = time.perf_counter()
    engine.programs.compile(keys, progress=False)
    engine.programs.serving = True
    detail = {f"{k['kind']}@{k['tokens']}": k["compile_s"] for k in engine.programs.report()}
    return len(keys), time.perf_counter() - start, detail


def write_json(path: str | Path | None, report) -> None:
    """`report` to `path` as indented JSON; nothing without a path (the scripts' `--json` is optional)."""
    if path:
        Path(path).write_text(json.dumps(report, indent=1))
