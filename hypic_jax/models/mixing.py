"""How a layer's token mixers reach the other tokens: one layer body per architecture, two contexts.

An architecture writes each layer kind once (`qwen3_5.block`, `kimi_linear.block`, `ring_linear.block`): norms,
projections, gates, output projections and the MLP. The forwards differ only in where the tokens before the fresh
ones live, and the body asks a mixing context for exactly that:

* `CausalMixing`: a batch of sequences [B, L, ...] that continue per-layer caches (or start at position 0). The
  plain forward, `prefill`, the batched decode step and training use it; a layer emits its new cache.
* `LayoutMixing`: the fresh tokens of one position-independent request (a `stitch.layout.LayoutArrays`, seen as a
  batch of one, [1, F, ...]) over the cached entries in the pools. The span programs use it; a layer emits the rows
  to write into its pools and, when asked, the decode cache of the whole request.

Both offer the same operations, called by the body in this order:

* `conv(x, taps)`: the depthwise causal short conv in front of a linear core;
* `linear(inputs, rotate=None)`: a linear-attention core over batched `LinearInputs` (q, k may keep fewer, grouped
  key heads); `rotate(summary, offset)` moves a cached summary to its new position,
  for families whose keys carry RoPE;
* `keys(fresh, rotate=None)`: a full-attention layer's per-token key tree (a `base.KVCache`, MLA latents, ...) of
  every token the fresh queries may see, the fresh ones included; `rotate(tree, offset)` moves cached keys by
  their pieces' offsets;
* `attend(q, k, v, scale)`: softmax attention of the fresh queries over those keys;

and the fresh tokens' `positions` (their RoPE phases), `valid` (the MoE's real tokens, None for all) and
`kernels` (`base.KernelOptions`). A layer gets a context of its own; after the body, `emitted()` is what the layer
leaves behind, and the context keeps its intermediates (`inputs`: the last linear core's inputs) for inspection.
The layer loop itself is `stack.run`; `run_causal` and `run_layout` drive it with each context.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import Array

from hypic_jax import stitch
from hypic_jax.core import linear_attn
from hypic_jax.core.conv import causal_conv1d
from hypic_jax.models import base, layers, stack
from hypic_jax.stitch import layout as lay

# Inputs of at most this many tokens run the linear cores' recurrence, one step per token (a decode step, a short
# continuation); longer ones the chunked form.
RECURRENT_MAX_LEN = 8

Block = Callable[..., Array]


def _pool_form(tree):
    """A key tree as the pools hold it: a `KVCache`'s fields as a dict, any other tree as it is."""
    return dict(k=tree.k, v=tree.v) if isinstance(tree, base.KVCache) else tree


def _tree_form(pooled, like):
    """`_pool_form` undone: the pooled tree in the type of `like`."""
    return base.KVCache(k=pooled["k"], v=pooled["v"]) if isinstance(like, base.KVCache) else pooled


def _no_conv(batch: int, dtype) -> Array:
    """The conv tail of a linear layer without a short conv: empty, so every `LinearCache` has both fields."""
    return jnp.zeros((batch, 0, 0), dtype)


@dataclasses.dataclass
class CausalMixing:
    """Sequences [B, L, ...] continuing `cache` (this layer's; None: from position 0, keeping nothing).

    positions: the fresh tokens' positions, [L] or [B, L]. start: the cache's length (a scalar or one per row;
    None without a cache). fresh: the cache is known to be empty, so the tokens attend among themselves (the
    causal kernel) and are only written to it."""

    cache: Any
    positions: Array
    start: Array | None
    fresh: bool = False
    kernels: base.KernelOptions = base.DEFAULT_KERNELS
    valid: Array | None = None
    inputs: linear_attn.LinearInputs | None = None
    _tail: Array | None = None
    _state: Array | None = None
    _keys: Any = None
    key_positions: Array | None = None

    @property
    def single_step(self) -> bool:
        """One token per row continuing a filled cache (a decode step): attention may read the cache directly."""
        return self.cache is not None and not self.fresh and self.positions.shape[-1] == 1

    def conv(self, x: Array, taps: Array, activation: str | None = "silu") -> Array:
        batch, _, width = x.shape
        tails = (jnp.zeros((batch, taps.shape[1] - 1, width), x.dtype) if self.cache is None
                 else self.cache.conv.astype(x.dtype))
        out, self._tail = jax.vmap(
            lambda xs, tail: causal_conv1d(xs, taps, conv_state=tail, activation=activation))(x, tails)
        return out

    def linear(self, inputs: linear_attn.LinearInputs, rotate=None) -> Array:
        del rotate  # the tokens continue the cached state where it ends: nothing moves
        self.inputs = inputs
        length = inputs.v.shape[1]
        kernels = self.kernels

        def one_sequence(inputs, state):  # q, k at their key heads: the cores repeat them where they need to
            if length <= RECURRENT_MAX_LEN:
                return linear_attn.recurrent(**inputs.kwargs(), initial_state=state)
            impl = "pallas" if stitch.linear_kernel_fits(inputs, kernels.linear) else "xla"
            return linear_attn.chunked(**inputs.kwargs(), initial_state=state, chunk_size=kernels.chunk_size,
                                       impl=impl)

        if self.cache is None:
            out, self._state = jax.vmap(lambda i: one_sequence(i, None))(inputs)
        else:
            out, self._state = jax.vmap(one_sequence)(inputs, self.cache.state)
        return out

    def keys(self, fresh, rotate=None):
        del rotate  # keys sit at their absolute positions already
        if self.cache is None:
            self._keys = fresh
            return fresh
        self._keys, key_positions = _write(self.cache, fresh, self.start)
        if self.fresh:
            return fresh
        self.key_positions = key_positions
        return self._keys

    def attend(self, q: Array, k: Array, v: Array, scale: float) -> Array:
        """q [B, L, Hq, D] over k, v [B, T, Hkv, D(v)]: causal among the fresh tokens, or by absolute position over
        the cache's buffers (slots not yet written sit past every query)."""
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        value_dim = v.shape[-1]
        width = max(q.shape[-1], value_dim)  # the fused kernels want one head width: zero channels change nothing
        q, k, v = (jnp.pad(t, [(0, 0)] * 3 + [(0, width - t.shape[-1])]) if t.shape[-1] < width else t
                   for t in (q, k, v))
        q_positions = None if self.key_positions is None else self.positions
        out = layers.dot_product_attention(q, k, v, scale=scale, q_positions=q_positions,
                                           k_positions=self.key_positions)
        return out[..., :value_dim]

    def emitted(self):
        """The layer's new cache: a `LinearCache` (state and conv tail) or its written key buffers."""
        if self._state is not None:
            tail = self._tail
            if tail is None:
                tail = self.cache.conv if self.cache is not None else _no_conv(self._state.shape[0],
                                                                               self.inputs.v.dtype)
            return base.LinearCache(state=self._state, conv=tail)
        return self._keys


def _write(cache, fresh, start):
    """`fresh` [B, L, ...] written into the cache's buffers at `start` (a `KVCache` or its in-stack view through
    `base.update_kv_cache`, any other per-token tree leaf by leaf); returns (the written cache, the buffers' key
    positions [T])."""
    if isinstance(cache, (base.KVCache, base.StackedKV)):
        return base.update_kv_cache(cache, fresh.k, fresh.v, start)
    written = jax.tree.map(lambda buffer, new: base.write_tokens(buffer, new, start), cache, fresh)
    return written, jnp.arange(jax.tree.leaves(cache)[0].shape[1], dtype=jnp.int32)


@dataclasses.dataclass
class LayoutMixing:
    """The fresh tokens of `layout` (one request, as a batch of one) over the cached entries in this layer's pools
    (`pool`: a `stack.PoolRows`). isolated: a cold prefill (every span from position 0, no mixing across spans).
    summaries: compute each fresh piece's own summary (stitched requests and cold prefills). want_decode: also
    emit the decode cache of the whole request."""

    layout: lay.LayoutArrays
    pool: stack.PoolRows
    isolated: bool
    summaries: bool
    want_decode: bool = False
    kernels: base.KernelOptions = base.DEFAULT_KERNELS
    inputs: linear_attn.LinearInputs | None = None
    _conv: tuple | None = None
    _write: stitch.RowWrites | None = None
    _decode: Any = None
    _at: lay.LayoutArrays | None = None

    @property
    def positions(self) -> Array:
        return self.layout.positions

    @property
    def valid(self) -> Array:
        return self.layout.valid[None]

    single_step = False

    def _rows(self, kind: str) -> lay.LayoutArrays:
        return lay.shift_pool_rows(self.layout, kind, self.pool.base)

    def conv(self, x: Array, taps: Array, activation: str | None = "silu") -> Array:
        out, tail, records = stitch.conv_over_layout(x[0], taps, self.pool.tree["conv"], self._rows("slot"),
                                                     activation=activation)
        self._conv = (tail, records)
        return out[None]

    def linear(self, inputs: linear_attn.LinearInputs, rotate=None) -> Array:
        self.inputs = inputs = jax.tree.map(lambda a: a[0], inputs)
        at, pool, kernels = self._rows("slot"), self.pool.tree, self.kernels
        result = stitch.linear_over_layout(inputs, pool["summary"], at, summaries=self.summaries, rotate=rotate,
                                           algorithm=kernels.algorithm(), impl=kernels.linear,
                                           fold_impl=kernels.fold)
        records = dict(summary=stitch.record_summaries(result, at, isolated=self.isolated, pool=pool["summary"]))
        tail = _no_conv(1, inputs.v.dtype)[0]
        if self._conv is not None:
            tail, records["conv"] = self._conv
        self._write = stitch.row_writes(pool, at.record_slot, records)
        if self.want_decode:
            self._decode = base.LinearCache(state=result.final_state[None], conv=tail[None])
        return result.outputs[None]

    def keys(self, fresh, rotate=None):
        self._at = at = self._rows("token")
        own = _pool_form(jax.tree.map(lambda a: a[0], fresh))
        whole = _tree_form(stitch.gather_keys(own, self.pool.tree, at), fresh)
        if rotate is not None and not self.isolated:  # cached keys sit at their canonical phase
            whole = rotate(whole, jnp.where(at.key_fresh, 0, at.key_offset))
        self._write = stitch.row_writes(self.pool.tree, at.fresh_dest, own)
        whole = jax.tree.map(lambda a: a[None], whole)
        if self.want_decode:
            self._decode = whole
        return whole

    def attend(self, q: Array, k: Array, v: Array, scale: float) -> Array:
        return stitch.masked_attention(q[0], k[0], v[0], self._at, isolated=self.isolated, scale=scale)[None]

    def emitted(self):
        """(the rows to write into this layer's pools, `stitch.RowWrites`; the layer's decode cache or None)."""
        return self._write, self._decode


# ----------------------------------------------------------------------------------------------------------------
# Drivers


def run_causal(block: Block, x: Array, layer_params, caches, *, positions: Array, start: Array | None,
               fresh: bool = False, kernels: base.KernelOptions = base.DEFAULT_KERNELS, keep: bool = True):
    """Every layer of `block(i, layer, params, x, mix) -> x` over x [B, L, D] with `CausalMixing`: (x, the new
    caches in `caches`' form (see `stack.run`); None per layer when `keep` is False)."""
    def step(i, layer, params, cache, pool, x):
        mix = CausalMixing(cache, positions, start, fresh, kernels)
        x = block(i, layer, params, x, mix)
        return x, (mix.emitted() if keep else None, None)

    x, new, _ = stack.run(step, x, layer_params, caches=caches)
    return x, new


def run_layout(block: Block, x: Array, layer_params, layout: lay.LayoutArrays, pools, *, isolated: bool,
               summaries: bool, want_decode: bool = False, want_hidden: bool = False,
               kernels: base.KernelOptions = base.DEFAULT_KERNELS):
    """Every layer of `block` over the fresh tokens' embeddings x [F, D] with `LayoutMixing`, reading `pools` (a
    `stack.PoolStack` or per layer its pool). Returns (x [F, D]; per pool part the rows to write into it,
    `stitch.RowWrites`; the decode caches, in `stack.run`'s output form, or None; every layer's output [layers,
    F, D] when `want_hidden`, else None)."""
    def step(i, layer, params, cache, pool, x):
        mix = LayoutMixing(layout, pool, isolated, summaries, want_decode, kernels)
        x = block(i, layer, params, x, mix)
        write, decode = mix.emitted()
        return x, (None, (write, (decode, x[0]) if want_hidden else decode))

    x, _, outputs = stack.run(step, x[None], layer_params, pools=pools)
    writes = stack.pool_writes(stack.map_outputs(lambda o: o[0], outputs))
    decode = stack.map_outputs(lambda o: o[1], outputs)
    hidden = None
    if want_hidden:  # every layer's output of the fresh tokens, for `Engine.diagnose`
        decode, hidden = stack.split_pairs(decode)
    return x[0], writes, decode if want_decode else None, hidden


def fused_forward_arrays(arch, params, config, tokens: Array, cache: base.ModelCache, layout: lay.LayoutArrays, pools,
                         *, kernels: base.KernelOptions = base.DEFAULT_KERNELS):
    """One decode step of the rows of `cache` (tokens [B], one per row at its own length) and the stitched forward
    of one position-independent request (`layout`, over the cached entries in `pools`), in one layer loop.

    Why one loop: in a decode step of a mixture-of-experts model most bytes read are the experts' weights, and an
    admitted request's stitched forward reads them again for its few fresh tokens (seams and query). Here each
    layer runs its token mixing twice, once per context (`CausalMixing` for the rows, `LayoutMixing` for the
    request: they read different caches), then its MLP once over both token lists (`arch.mlp_block`), so the weights
    of every per-token product are read once for both. Rows and the request never mix: the MLP is per token.

    `arch` provides `mixer_block`, `mlp_block` and `final_logits`. Returns (float32 logits [B, vocab] of the rows,
    the rows' new caches in `cache.layers`' form, float32 logits [vocab] of the request's last fresh token, the
    request's decode caches in `run_layout`'s form)."""
    rows = tokens.shape[0]
    positions = base.token_positions(cache.length, 1)

    def step(i, layer, lp, row_cache, pool, carry):
        x_rows, x_fresh = carry
        mix_rows = CausalMixing(row_cache, positions, cache.length, False, kernels)
        mix_fresh = LayoutMixing(layout, pool, isolated=False, summaries=True, want_decode=True, kernels=kernels)
        x_rows = arch.mixer_block(i, layer, lp, x_rows, mix_rows, config=config)
        x_fresh = arch.mixer_block(i, layer, lp, x_fresh, mix_fresh, config=config)
        both = jnp.concatenate([x_rows.reshape(1, rows, -1), x_fresh], axis=1)
        valid = jnp.concatenate([jnp.ones((1, rows), bool), mix_fresh.valid], axis=1)
        both = arch.mlp_block(i, lp, both, valid, kernels, config=config)
        return (both[0, :rows, None], both[:, rows:]), (mix_rows.emitted(), mix_fresh.emitted()[1])

    x = (params["embed"][tokens][:, None], params["embed"][layout.tokens][None])
    (x_rows, x_fresh), new, outputs = stack.run(step, x, params["layers"], caches=cache.layers, pools=pools)
    return (arch.final_logits(params, config, x_rows[:, -1]), new,
            arch.final_logits(params, config, x_fresh[0, layout.last]), outputs)
