"""A naive reference of position-independent prefill: what each reuse mode means, written out token by token.

The engine stitches cached segments through transfer operators, pooled entries and fixed-capacity layouts; this
file shares none of that. It runs the model's own layer pieces (projections, norms, MLPs: checked against
transformers elsewhere) in a plain Python loop over the request's spans:

* an entry is what an isolated prefill of its segment (from position 0, zero state) leaves: per linear layer the
  recurrence inputs of the interior tokens [seam, n) and the segment's last W-1 pre-conv rows, per attention layer
  the interior's keys (rotated at their canonical positions) and values;
* a linear layer runs its recurrence token by token (`LinearInputs.recurrent`) through the spans in order: a fresh
  span from the running state, its conv window reaching back into the rows before it (the previous fresh span's,
  a cached entry's stored tail, or zeros); a cached span by replaying its interior's stored inputs from the
  running state, which is S(C | S0) by definition (HYPIC's `addition` adds the zero-start state instead; with RoPE
  inside the linear layer and a RoPE mode the stored keys are first moved to their new positions);
* an attention layer lets every fresh query see every key at or before its own absolute position: fresh keys at
  their positions, cached keys moved from their canonical positions to their absolute ones in the RoPE modes and
  left where they were otherwise.

Only the PIC modes are defined here; full recompute is the model's own forward, and prefix cache and a seam of the
whole segment must equal it (tests check those against `Model.logits`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.core import rope
from hypic_jax.core.conv import causal_conv1d
from hypic_jax.engine.requests import segment_seams

PIC_MODES = ("addition", "transition", "transition_rope", "transition_rope_recompute")


# ------------------------------------------------------------------------------------------------------------------
# Per-architecture layer pieces


class Pieces:
    """The model's layer pieces, one sequence at a time (x [L, H])."""

    def __init__(self, model):
        self.model, self.arch, self.config, self.params = model, model.arch, model.config, model.params

    def layer(self, i):
        return self.params["layers"][i]


class QwenPieces(Pieces):
    def linear(self, i) -> bool:
        return self.config.layer_types[i] == "linear_attention"

    def embed(self, tokens):
        return self.params["embed"][jnp.asarray(tokens)]

    def pre_norm(self, i, x):
        from hypic_jax.models import layers

        return layers.rms_norm(x, self.layer(i)["input_norm"], self.config.rms_norm_eps, offset=1.0)

    def mlp(self, i, x):
        from hypic_jax.models import layers

        q = self.arch
        h = layers.rms_norm(x, self.layer(i)["post_norm"], self.config.rms_norm_eps, offset=1.0)
        return q.feed_forward(h[None], self.layer(i)["mlp"], self.config, self.config.mlp_types[i])[0]

    def final(self, x):
        from hypic_jax.models import layers

        x = layers.rms_norm(x, self.params["final_norm"], self.config.rms_norm_eps, offset=1.0)
        return self.arch.lm_head(self.params, self.config, x)

    # linear layers: (pre-conv rows, what the output needs), conv taps, recurrence inputs, output
    def linear_pre(self, i, h):
        mixed, z, a, b = self.arch.gdn_projections(h, self.layer(i)["mixer"], self.config)
        return mixed, (z, a, b)

    def conv_taps(self, i):
        return self.layer(i)["mixer"]["conv_weight"], "silu"

    def linear_inputs(self, i, conv_out, aux, positions):
        z, a, b = aux
        return self.arch.gdn_inputs(conv_out, a, b, self.layer(i)["mixer"], self.config)

    def linear_out(self, i, core, aux, h):
        return self.arch.gdn_output(core.astype(h.dtype), aux[0], self.layer(i)["mixer"], self.config)

    def move_linear(self, inputs, offset):
        return inputs  # no RoPE inside the linear layers

    # attention layers: q, k (rotated at `positions`), v, and the output
    def attention(self, i, h, positions):
        q, k, v, gate = self.arch.attention_projections(h[None], self.layer(i)["mixer"], self.config,
                                                        jnp.asarray(positions))
        return q[0], k[0], v[0], gate[0], self.config.head_dim ** -0.5

    def move_keys(self, k, offset):
        return rope.rotate_keys(k, offset, rotary_dim=self.config.rotary_dim, base=self.config.rope_theta)

    def attention_out(self, i, attended, aux):
        return self.arch.attention_output(attended, aux, self.layer(i)["mixer"])


class KimiPieces(Pieces):
    def linear(self, i) -> bool:
        return self.config.layer_types[i] == "linear_attention"

    def embed(self, tokens):
        return self.params["embed"][jnp.asarray(tokens)]

    def pre_norm(self, i, x):
        from hypic_jax.models import layers

        return layers.rms_norm_plain(x, self.layer(i)["attn_norm"], self.config.rms_norm_eps)

    def mlp(self, i, x):
        from hypic_jax.models import layers

        k = self.arch
        h = layers.rms_norm_plain(x, self.layer(i)["mlp_norm"], self.config.rms_norm_eps)
        lp = self.layer(i)["mlp"]
        return k._swiglu(lp, h) if self.config.mlp_types[i] == k.DENSE else k.moe(lp, self.config, h[None])[0]

    def final(self, x):
        from hypic_jax.models import layers

        x = layers.rms_norm_plain(x, self.params["final_norm"], self.config.rms_norm_eps)
        return self.arch.lm_head(self.params, self.config, x)

    def linear_pre(self, i, h):
        qkv, g_raw, b = self.arch.kda_projections(self.layer(i)["attn"], self.config, h)
        return qkv, (g_raw, b)

    def conv_taps(self, i):
        return self.arch.kda_conv_taps(self.layer(i)["attn"], self.config), "silu"

    def linear_inputs(self, i, conv_out, aux, positions):
        c = self.config
        q, k, v = (t.reshape(t.shape[0], c.linear_num_heads, c.linear_head_dim) for t in jnp.split(conv_out, 3, -1))
        return self.arch.kda_inputs(self.layer(i)["attn"], q, k, v, *aux)

    def linear_out(self, i, core, aux, h):
        return self.arch.kda_output(self.layer(i)["attn"], self.config, h, core)

    def move_linear(self, inputs, offset):
        return inputs

    def attention(self, i, h, positions):
        p, c = self.layer(i)["attn"], self.config
        q = self.arch._mla_queries(p, c, h[None])[0]
        keys, values = self.arch.mla_expand(p, c, self.arch.mla_latents(p, c, h))
        return q, keys, values, None, c.qk_head_dim ** -0.5

    def move_keys(self, k, offset):
        return k  # NoPE: keys carry no position

    def attention_out(self, i, attended, aux):
        p = self.layer(i)["attn"]
        return self.arch._linear(attended.reshape(attended.shape[0], -1), p["o_proj"], p.get("o_proj_bias"))


class RingPieces(Pieces):
    def linear(self, i) -> bool:
        return not self.config.is_full_attention(i)

    def embed(self, tokens):
        return self.params["embed"][jnp.asarray(tokens)]

    def pre_norm(self, i, x):
        from hypic_jax.models import layers

        return layers.rms_norm(x, self.layer(i)["input_norm"], self.config.rms_norm_eps)

    def mlp(self, i, x):
        from hypic_jax.models import layers

        r = self.arch
        h = layers.rms_norm(x, self.layer(i)["post_norm"], self.config.rms_norm_eps)
        lp = self.layer(i)["mlp"]
        return r.moe(lp, h, self.config) if self.config.is_moe(i) else r.swiglu_mlp(lp, h)

    def final(self, x):
        from hypic_jax.models import layers

        return self.arch.unembed(self.params, layers.rms_norm(x, self.params["norm"], self.config.rms_norm_eps))

    def linear_pre(self, i, h):
        return None, h  # no conv: the recurrence inputs come straight from the normed hidden states

    def conv_taps(self, i):
        return None, None

    def linear_inputs(self, i, conv_out, h, positions):
        inputs = self.arch.linear_inputs(self.layer(i)["attn"], h[None], jnp.asarray(positions), i, self.config)
        return jax.tree.map(lambda a: a[0], inputs)

    def linear_out(self, i, core, h, h_again):
        return self.arch.linear_output(self.layer(i)["attn"], h[None], core[None], self.config)[0]

    def move_linear(self, inputs, offset):
        rotary = self.config.rotary_dim(self.config.linear_head_dim)
        k = rope.rotate_keys(inputs.k, offset, rotary_dim=rotary, base=self.config.rope_theta)
        return dataclasses.replace(inputs, k=k)

    def attention(self, i, h, positions):
        q, k, v = self.arch.attention_projections(self.layer(i)["attn"], h[None], jnp.asarray(positions),
                                                  self.config)
        return q[0], k[0], v[0], None, self.config.attention_head_dim ** -0.5

    def move_keys(self, k, offset):
        rotary = self.config.rotary_dim(self.config.attention_head_dim)
        return rope.rotate_keys(k, offset, rotary_dim=rotary, base=self.config.rope_theta)

    def attention_out(self, i, attended, aux):
        return attended.reshape(attended.shape[0], -1) @ self.layer(i)["attn"]["dense"]


def pieces_of(model) -> Pieces:
    name = model.arch.__name__.rsplit(".", 1)[-1]
    if name in ("qwen3_5", "qwen3_next"):
        return QwenPieces(model)
    if name == "kimi_linear":
        return KimiPieces(model)
    if name == "ring_linear":
        return RingPieces(model)
    raise ValueError(f"no reference pieces for {name}")


# ------------------------------------------------------------------------------------------------------------------
# The reference


def _attend(q, keys, values, q_pos, k_pos, scale):
    """Softmax attention of q [L, Hq, D] over keys [P, Hkv, D] (GQA: query head h reads key head h // (Hq/Hkv)),
    a key visible when its position is at most the query's. float32."""
    group = q.shape[1] // keys.shape[1]
    keys, values = jnp.repeat(keys, group, axis=1), jnp.repeat(values, group, axis=1)
    scores = jnp.einsum("lhd,phd->hlp", q.astype(jnp.float32), keys.astype(jnp.float32)) * scale
    visible = jnp.asarray(k_pos)[None, None, :] <= jnp.asarray(q_pos)[None, :, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("hlp,phd->lhd", probs, values.astype(jnp.float32)).astype(q.dtype)


@dataclasses.dataclass
class Entry:
    """What an isolated prefill of a segment leaves for its interior [seam, n): per layer, linear (inputs of the
    interior, the segment's last W-1 pre-conv rows) or attention (keys at canonical positions, values)."""

    seam: int
    length: int
    layers: list


def _conv(pre, taps, activation, tail):
    """The causal conv of a span's pre-conv rows after `tail` (the W-1 rows before them; None: zeros), and the
    last W-1 rows of the two."""
    if taps is None:
        return pre, tail
    return causal_conv1d(pre, taps, conv_state=tail, activation=activation)


def record(pieces: Pieces, tokens, seam: int) -> Entry:
    """The entry of a segment: an isolated, causal prefill of it from position 0 and zero state (traced inside
    `prefill`'s program)."""
    positions = np.arange(len(tokens))
    x = pieces.embed(tokens)
    layers = []
    for i in range(len(pieces.params["layers"])):
        h = pieces.pre_norm(i, x)
        if pieces.linear(i):
            pre, aux = pieces.linear_pre(i, h)
            taps, activation = pieces.conv_taps(i)
            conv_out, tail = _conv(pre, taps, activation, None)
            inputs = pieces.linear_inputs(i, conv_out, aux, positions)
            core, _ = inputs.recurrent()
            out = pieces.linear_out(i, core, aux, h)
            layers.append(("linear", jax.tree.map(lambda a: a[seam:], inputs), tail))
        else:
            q, k, v, aux, scale = pieces.attention(i, h, positions)
            out = pieces.attention_out(i, _attend(q, k, v, positions, positions, scale), aux)
            layers.append(("attention", k[seam:], v[seam:]))
        x = x + out
        x = x + pieces.mlp(i, x)
    return Entry(seam=seam, length=len(tokens), layers=layers)


def prefill(model, segments, mode: str, seam: float = 8) -> np.ndarray:
    """The last position's float32 logits of `segments` (token-id lists, the last the query) in PIC `mode`. The
    whole reference runs as one program (compiled per request: its spans are Python structure), which compiles
    faster than its operations one by one."""
    if mode not in PIC_MODES:
        raise ValueError(f"the reference defines the PIC modes {PIC_MODES}, not {mode!r}")
    segments = [[int(t) for t in s] for s in segments]
    logits = jax.jit(lambda params: _prefill(model.replace(params=params), segments, mode, seam))(model.params)
    return np.asarray(logits, np.float32)


def _prefill(model, segments, mode: str, seam: float):
    pieces = pieces_of(model)
    docs, query = segments[:-1], segments[-1]
    transfer, move = mode != "addition", mode in ("transition_rope", "transition_rope_recompute")
    seams = (segment_seams(seam, [len(d) for d in docs]) if mode == "transition_rope_recompute"
             else [0] * len(docs))
    # the request as spans: (kind, tokens or entry, absolute start)
    spans, start = [], 0
    for doc, w in zip(docs, seams):
        if w:
            spans.append(("fresh", doc[:w], start))
        if w < len(doc):
            spans.append(("cached", record(pieces, doc, w), start + w))
        start += len(doc)
    spans.append(("fresh", query, start))
    fresh = [(tokens, begin) for kind, tokens, begin in spans if kind == "fresh"]
    tokens = [t for toks, _ in fresh for t in toks]
    positions = np.concatenate([np.arange(begin, begin + len(toks)) for toks, begin in fresh])
    x = pieces.embed(tokens)
    for i in range(len(pieces.params["layers"])):
        h = pieces.pre_norm(i, x)
        if pieces.linear(i):
            pre, aux = pieces.linear_pre(i, h)
            taps, activation = pieces.conv_taps(i)
            state, tail, cores, at = None, None, [], 0
            for kind, item, begin in spans:
                if kind == "fresh":
                    n = len(item)
                    rows = jax.tree.map(lambda a: a[at:at + n], aux)
                    conv_out, tail = _conv(None if pre is None else pre[at:at + n], taps, activation, tail)
                    inputs = pieces.linear_inputs(i, conv_out, rows, positions[at:at + n])
                    core, state = inputs.recurrent(initial_state=state)
                    cores.append(core)
                    at += n
                else:
                    _, interior, entry_tail = item.layers[i]
                    if move:
                        interior = pieces.move_linear(interior, begin - item.seam)
                    if transfer:
                        _, state = interior.recurrent(initial_state=state)
                    else:
                        _, alone = interior.recurrent()
                        state = alone if state is None else state + alone
                    tail = entry_tail
            out = pieces.linear_out(i, jnp.concatenate(cores), aux, h)
        else:
            q, k, v, aux, scale = pieces.attention(i, h, positions)
            keys, values, key_positions, at = [], [], [], 0
            for kind, item, begin in spans:
                if kind == "fresh":
                    n = len(item)
                    keys.append(k[at:at + n])
                    values.append(v[at:at + n])
                    at += n
                else:
                    _, ck, cv = item.layers[i]
                    keys.append(pieces.move_keys(ck, begin - item.seam) if move else ck)
                    values.append(cv)
                    n = item.length - item.seam
                key_positions.append(np.arange(begin, begin + n))
            attended = _attend(q, jnp.concatenate(keys), jnp.concatenate(values), positions,
                               np.concatenate(key_positions), scale)
            out = pieces.attention_out(i, attended, aux)
        x = x + out
        x = x + pieces.mlp(i, x)
    return pieces.final(x[-1])


__all__ = ["prefill", "record", "PIC_MODES", "pieces_of"]
