"""Per-layer cache PyTrees and the generic model wrapper returned by `hypic_jax.load`.

An architecture module (see `hypic_jax.models`) supplies pure functions; `Model` binds one module, its config and
its parameters, and jit-compiles the two public entry points:

* `logits(tokens [B, L]) -> float32 [B, L, vocab]`: plain causal forward from an empty state, no cache.
* `generate(tokens [B, L], max_new_tokens) -> int32 [B, max_new_tokens]`: greedy; one prefill that fills the
  per-layer caches, then one decode step per token inside a `lax.scan` (two compilations per prompt shape).
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import NamedSharding, PartitionSpec

from hypic_jax import options
from hypic_jax.kernels import fp8


# ----------------------------------------------------------------------------------------------------------------
# Kernel choices: how a forward computes, never what. They are arguments of the forward functions, not fields of an
# architecture's config, so switching one keeps every cache key and loads the same checkpoint.

LINEAR_IMPLS = ("auto", "xla", "pallas")
MOE_IMPLS = ("auto", "ragged", "pallas")
FOLD_IMPLS = ("auto", "pallas", "xla", "blocked")
COMPOSE_ALGORITHMS = ("auto", "f32", "tf32", "tf32x3", "bf16x3", "bf16x6", "bf16x9")
SLOT_LAYOUTS = ("auto", "default")


def _power_of_two(what, value):
    if not options.is_integer(value) or value < 1 or value & (value - 1):
        raise ValueError(f"{what} must be a power of two >= 1, got {value!r}")
    return int(value)


_power_of_two.kind = int


@dataclasses.dataclass(frozen=True)
class KernelOptions(options.OptionGroup):
    """Kernel choices: how the programs compute, never what (results agree up to rounding whatever is chosen;
    tests/test_stable_kernels.py and tests/test_layer_stack.py check each against its reference). Hashable: a
    static argument of every compiled forward."""

    linear: str = options.option(
        "auto", "the linear layers' cores: pallas (the Pallas kernels, interpreted off a GPU), xla (the chunk loops), "
        "auto (the kernels on a GPU for bfloat16 values where they fit, else the loops)",
        check=options.choice(*LINEAR_IMPLS), flag="--linear-kernel")
    moe: str = options.option(
        "auto", "the routed experts' grouped matmul: ragged (lax.ragged_dot), pallas, auto (Pallas on a GPU)",
        check=options.choice(*MOE_IMPLS), flag="--moe-kernel")
    fold: str = options.option(
        "auto", "the span programs' fold over a request's pieces: pallas, xla (a loop), blocked (batched products "
        "in blocks), auto (the kernel on a GPU where it fits, else blocked there and the loop elsewhere)",
        check=options.choice(*FOLD_IMPLS), flag="--fold-kernel")
    compose: str = options.option(
        "auto", "dot algorithm of the dense transfer products; auto: bf16x3 (three bfloat16 tensor-core passes at "
        "float32-level accuracy) on a GPU, f32 elsewhere", check=options.choice(*COMPOSE_ALGORITHMS),
        flag="--compose-algorithm")
    chunk_size: int = options.option(64, "chunk length of the chunked linear cores", check=_power_of_two)
    scan_layers: bool = options.option(
        True, "run a model's repeating layers as one lax.scan (one period of the pattern compiles instead of every "
        "layer)", check=options.boolean())
    slot_layouts: str = options.option(
        "auto", "memory layouts of the batched decode cache: auto (the compiler's choice for the largest decode "
        "program, shared by every program that touches the cache) or default (row-major)",
        check=options.choice(*SLOT_LAYOUTS))

    def algorithm(self) -> str | None:
        """The dense products' dot algorithm for the running backend (None: float32 at HIGHEST precision)."""
        if self.compose == "auto":
            return "bf16x3" if jax.default_backend() == "gpu" else None
        return None if self.compose == "f32" else self.compose


DEFAULT_KERNELS = KernelOptions()


# ----------------------------------------------------------------------------------------------------------------
# Caches. Leaves carry a leading batch axis; `length` (tokens already absorbed) is one int32 for the whole batch, or
# one per row ([B]: a batched decode step, every row at its own position).


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Full-attention keys/values at absolute positions 0..max_len-1 (post-RoPE). k, v: [B, max_len, H_kv, D]."""

    k: Array
    v: Array

    def member_view(self, member: Array) -> "StackedKV | None":
        """This cache as a stack of several layers' caches ([members, B, max_len, H_kv, D], as a scan over
        layers carries them), seen as the cache of layer `member` (`layer_stack.run_cached`); None for a stack of
        one row, whose member is cheaper to copy out and back: XLA folds the row's single-token scatter into an
        update slice, and the member's slice that attention reads then costs a copy of the whole stack."""
        return StackedKV(self.k, self.v, member) if self.k.shape[1] > 1 else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StackedKV:
    """One layer's `KVCache` inside the stack of its pattern position ([members, B, max_len, H_kv, D]), read and
    written in place. A scanned decode step would otherwise copy the layer's whole cache out of the stack, write
    its new token into the copy and copy it back: three passes over every cached key and value where attention
    needs one read. `update_kv_cache` scatters the new tokens into the stack at (member, row, position) and `k` /
    `v` are the member's slices, which XLA fuses into the attention reading them."""

    k_stack: Array
    v_stack: Array
    member: Array

    @property
    def k(self) -> Array:
        return jax.lax.dynamic_index_in_dim(self.k_stack, self.member, 0, keepdims=False)

    @property
    def v(self) -> Array:
        return jax.lax.dynamic_index_in_dim(self.v_stack, self.member, 0, keepdims=False)

    def stacked(self) -> KVCache:
        """The whole stack again (what the scan carries on)."""
        return KVCache(self.k_stack, self.v_stack)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LinearCache:
    """A linear-attention layer's running state [B, H, K, V] (float32) and conv tail [B, W-1, D_conv]
    (the last W-1 pre-conv inputs; an architecture with several short convs concatenates them along D_conv)."""

    state: Array
    conv: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
    """Caches of all layers (a tuple, one entry per layer, any PyTree; for a model whose layers are a scanned
    `layer_stack.LayerStack`, a `LayerStack` of them by the same plan, which reads like the tuple) and the number
    of tokens already in them."""

    layers: tuple
    length: Array  # int32 scalar, or [B] (each row's own)


def token_positions(start: Array | int, length: int) -> Array:
    """Absolute positions of `length` tokens from `start`: [L] for a scalar start, [B, L] for one start per row."""
    start = jnp.asarray(start, jnp.int32)
    return start[..., None] + jnp.arange(length, dtype=jnp.int32)


def cache_positions(cache: ModelCache | None, length: int) -> Array:
    """Absolute positions of the next `length` tokens: [L], or [B, L] when the cache's length is per row."""
    return token_positions(0 if cache is None else cache.length, length)


def write_tokens(buffer: Array, values: Array, start: Array, member: Array | None = None) -> Array:
    """values [B, L, ...] into buffer [B, T, ...] (or into member `member` of a stack [members, B, T, ...]) at
    token offset `start`: a scalar (every row at once: one `dynamic_update_slice`, or a scatter into a stack) or
    one offset per row [B] (a scatter of each row's L tokens, so a batched decode step writes B tokens in place
    instead of rewriting whole buffers). The caller keeps start + L <= T: an update slice clamps a write past the
    end, and the scatter drops it."""
    values = values.astype(buffer.dtype)
    start = jnp.asarray(start, jnp.int32)
    if start.ndim == 0 and member is None:
        index = (jnp.zeros((), jnp.int32), start) + (jnp.zeros((), jnp.int32),) * (values.ndim - 2)
        return jax.lax.dynamic_update_slice(buffer, values, index)
    # a scatter also for one start into a stack: an update slice there is fused into the member's slice that
    # attention reads, which then reads the stack from before its in-place update, and XLA copies the whole stack
    # to allow it (twice per layer and step in the CPU HLO); a scatter is never fused into its readers
    rows, length = values.shape[:2]
    positions = jnp.broadcast_to(token_positions(start, length), (rows, length))  # [B, L]
    row_ids = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], positions.shape)
    lead = () if member is None else (jnp.asarray(member, jnp.int32),)
    return buffer.at[lead + (row_ids, positions)].set(values, mode="drop", unique_indices=True)


def update_kv_cache(cache: KVCache | StackedKV, k: Array, v: Array, start: Array) -> tuple[KVCache | StackedKV, Array]:
    """Write k, v [B, L, H, D] at positions start..start+L-1 (`start` a scalar, or [B] per row: `write_tokens`);
    returns the new cache (of the same kind: a `StackedKV` is written in its stack) and key positions [max_len].

    Slots not yet written sit at positions >= start + L, so the causal mask on absolute positions hides them.
    The caller keeps start + L <= max_len (size the cache for prompt + new tokens).
    """
    if isinstance(cache, StackedKV):
        new = StackedKV(write_tokens(cache.k_stack, k, start, cache.member),
                        write_tokens(cache.v_stack, v, start, cache.member), cache.member)
        return new, jnp.arange(cache.k_stack.shape[2], dtype=jnp.int32)
    new = KVCache(k=write_tokens(cache.k, k, start), v=write_tokens(cache.v, v, start))
    return new, jnp.arange(cache.k.shape[1], dtype=jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# Sharding


def named_shardings(specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """PartitionSpec tree -> NamedSharding tree on `mesh` (axes "data" and "model")."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def shard_params(params: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """Place parameters on `mesh` following the architecture's `param_specs`."""
    return jax.device_put(params, named_shardings(specs, mesh))


# ----------------------------------------------------------------------------------------------------------------
# The model object


def resolve_dtype(dtype: Any) -> jnp.dtype:
    return jnp.dtype(dtype)


def _params_dtype(params: Any) -> jnp.dtype:
    """The activation dtype of a parameter tree: its most common floating dtype (a few gates may stay float32)."""
    counts: dict = {}
    for leaf in jax.tree.leaves(params, is_leaf=fp8.is_fp8):  # an FP8 weight counts as the dtype it dequantizes to
        counts[jnp.dtype(leaf.dtype)] = counts.get(jnp.dtype(leaf.dtype), 0) + leaf.size
    return max(counts, key=counts.get)


@functools.partial(jax.jit, static_argnames=("arch", "config", "kernels"))
def _logits(params, tokens, *, arch, config, kernels):
    return arch.forward(params, config, tokens, kernels=kernels)[0]


@functools.partial(jax.jit, static_argnames=("arch", "config", "max_new_tokens", "kernels"))
def _generate(params, tokens, *, arch, config, max_new_tokens, kernels):
    """Greedy decoding: prefill fills the caches, then a scan of single-token steps."""
    batch, length = tokens.shape
    if max_new_tokens <= 0:
        return jnp.zeros((batch, 0), jnp.int32)
    if hasattr(arch, "prefill"):  # optional fast path: causal kernel, LM head on the last position only
        last, cache = arch.prefill(params, config, tokens, length + max_new_tokens, kernels=kernels)
    else:
        cache = arch.init_cache(config, batch, length + max_new_tokens, _params_dtype(params))
        logits, cache = arch.forward(params, config, tokens, cache=cache, kernels=kernels)
        last = logits[:, -1]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)

    def step(carry, _):
        token, cache = carry
        logits, cache = arch.forward(params, config, token[:, None], cache=cache, kernels=kernels)
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return (nxt, cache), nxt

    _, rest = jax.lax.scan(step, (first, cache), None, length=max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


@dataclasses.dataclass
class Model:
    """An architecture module + config + parameters, with jit-compiled `logits` and `generate`.

    The compiled functions take the module and config as static arguments, so models of the same architecture and
    config share compilations. `max_context`: the longest sequence the checkpoint was made for (config.json's
    max_position_embeddings; None when unknown). `source`: where the weights came from (a folder and dtype), part
    of the cache fingerprint.
    """

    arch: ModuleType
    config: Any
    params: Any
    max_context: int | None = None
    source: str | None = None

    @property
    def dtype(self) -> jnp.dtype:
        return _params_dtype(self.params)

    def logits(self, tokens: Array, kernels: KernelOptions = DEFAULT_KERNELS) -> Array:
        """float32 logits [B, L, vocab] of a plain causal forward over int32 tokens [B, L]."""
        return _logits(self.params, jnp.asarray(tokens, jnp.int32), arch=self.arch, config=self.config,
                       kernels=kernels)

    def generate(self, tokens: Array, max_new_tokens: int, kernels: KernelOptions = DEFAULT_KERNELS) -> Array:
        """Greedy continuation of tokens [B, L]: returns the new tokens, int32 [B, max_new_tokens]."""
        return _generate(
            self.params, jnp.asarray(tokens, jnp.int32), arch=self.arch, config=self.config,
            max_new_tokens=int(max_new_tokens), kernels=kernels,
        )

    def replace(self, **changes) -> "Model":
        """This model with some fields changed (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def init_cache(self, batch: int, max_len: int) -> ModelCache:
        return self.arch.init_cache(self.config, batch, max_len, self.dtype)

    def forward(self, tokens: Array, cache: ModelCache | None = None,
                kernels: KernelOptions = DEFAULT_KERNELS) -> tuple[Array, ModelCache | None]:
        """Un-jitted forward with an optional cache (jit it yourself for repeated calls)."""
        return self.arch.forward(self.params, self.config, jnp.asarray(tokens, jnp.int32), cache=cache,
                                 kernels=kernels)
