"""hypic-jax: position-independent caching for hybrid-attention LLMs, in JAX.

`hypic_jax.Engine` serves a model (`Engine.from_pretrained(path)`, or the model embedded in the package with no
path) from typed options (`hypic_jax.EngineOptions`); `hypic_jax.load` reads a checkpoint into a `Model`.

The package is built in layers, each importing only those below it (tests/test_imports.py checks this):

    kernels      the Pallas GPU kernels, one module per kernel family, each beside its pure-JAX reference
    core         the transfer-operator core: the linear-attention recurrence of every family, segment summaries
                 (T, S) and their composition, causal conv with a tail, RoPE, attention
    stitch       a request's layout as fixed-capacity arrays, and the forward pieces that stitch cached spans in
    models       one module per architecture, its layer stack, and the `Model` a checkpoint loads into
    checkpoint   Hugging Face folders (`checkpoint.hf`) and orbax checkpoints to a `Model`; the embedded model
    cache        the segment cache's index, the device pools and the tiers below them
    parallel     segment parallelism over a device mesh, tensor parallelism, several hosts
    engine       `Engine`: its options, request checks, compiled programs, sampler and scheduler
    train        the generated corpus, the trainer and the export of the embedded model
    serve        the OpenAI-compatible server; `cli` and `demo` on top
"""

__version__ = "0.1.0"

from hypic_jax.checkpoint import load  # noqa: F401

_ENGINE_NAMES = ("Engine", "EngineOptions", "LimitOptions", "PoolOptions", "TierOptions", "ParallelOptions",
                 "KernelOptions", "RequestOptions", "SchedulerOptions", "CompileOptions")


def __getattr__(name):
    """`hypic_jax.Engine` and its options without importing the engine (and every model) at package import time."""
    if name in _ENGINE_NAMES:
        from hypic_jax import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hypic_jax' has no attribute {name!r}")
