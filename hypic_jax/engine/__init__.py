"""The engine: `Engine` (position-independent caching behind `prefill`, `generate` and `diagnose`, served from a
fixed ladder of compiled programs) and its typed options.

    options     EngineOptions and its groups (limits, pools, tiers, parallel, kernels, requests, scheduler, compile)
    requests    a request's inputs, checked: segments, mode and seam, sampling parameters
    programs    the compiled programs: the ladder, compiling, the store, the guard while serving
    sampling    the one device sampler
    scheduler   the continuous-batching loop that `generate` and the server share
    store       compiled programs stored whole, for a restarted process
    results     what prefill and generate return
    planner     a request's plan (`Plan`): its spans, fresh tokens, entries to store, hits and misses
    engine      `Engine`: prefill, generation, decode rows, lifecycle (its cache: `hypic_jax.cache.hierarchy`)
"""

from hypic_jax.engine.engine import Engine, load_tokenizer, stack_layers, use_compile_cache
from hypic_jax.engine.options import (MODES, PIC_MODES, CompileOptions, EngineOptions, KernelOptions, LimitOptions,
                                      ParallelOptions, PoolOptions, RequestOptions, SchedulerOptions, TierOptions)
from hypic_jax.engine.programs import CompileWhileServing, DeviceMemoryError, backend_compiles
from hypic_jax.engine.requests import SamplingParams, seam_tokens, segment_seams
from hypic_jax.engine.results import GenerateResult, PrefillPiece, PrefillResult, PrefillStats

__all__ = ["Engine", "EngineOptions", "LimitOptions", "PoolOptions", "TierOptions", "ParallelOptions",
           "KernelOptions", "RequestOptions", "SchedulerOptions", "CompileOptions", "MODES", "PIC_MODES",
           "PrefillPiece", "PrefillResult", "PrefillStats", "GenerateResult", "SamplingParams", "backend_compiles",
           "CompileWhileServing", "DeviceMemoryError", "seam_tokens", "segment_seams", "load_tokenizer", "stack_layers",
           "use_compile_cache"]
