"""The segment summary (T_C, S(C|0)) and its algebra: the definitions that the transfer-operator core
(`hypic_jax.core.linear_attn`) and the Pallas kernels (`hypic_jax.kernels`) share.

A segment C of a linear-attention recurrence maps the state before it to the state after it affinely,
S -> T_C S + S(C|0). `Summary` holds that pair with T_C in its cheapest exact form; `compose` joins two summaries
(associative, not commutative), `advance` applies one to a state, `promote` rewrites one in a wider form. The
dense products take a named dot algorithm (`ALGORITHMS`, `matmul`): "f32" is float32 FMA, the others run on the
tensor cores (see `hypic_jax.kernels.compose` for what each costs in accuracy).

Pure JAX; this module imports nothing else of the package, so that the core and the kernels can both import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax

__all__ = [
    "PRECISION",
    "einsum",
    "ALGORITHMS",
    "precision_of",
    "matmul",
    "FORMS",
    "transfer_form",
    "Summary",
    "promote",
    "dense_transfer",
    "dense_product",
    "apply_transfer",
    "advance",
    "compose",
    "stack_summaries",
]

# Products of states and transfers are the quantity a cache reuses many times: keep them at full float32 precision
# on every backend (XLA's GPU default would otherwise allow TF32 for float32 dots).
PRECISION = jax.lax.Precision.HIGHEST

FORMS = ("identity", "scalar", "diagonal", "dense")
_FORM_RANK = {form: rank for rank, form in enumerate(FORMS)}


def einsum(spec: str, *operands: Array) -> Array:
    """`jnp.einsum` at `PRECISION` (full float32)."""
    return jnp.einsum(spec, *operands, precision=PRECISION)


# ----------------------------------------------------------------------------------------------------------------
# Dot algorithms of the dense products.

ALGORITHMS = ("f32", "tf32", "tf32x3", "bf16x3", "bf16x6", "bf16x9")


def precision_of(algorithm: str):
    """The `precision` argument of `lax.dot_general` for an algorithm name."""
    preset = lax.DotAlgorithmPreset
    table = {
        "f32": lax.Precision.HIGHEST,
        "tf32": preset.TF32_TF32_F32,
        "tf32x3": preset.TF32_TF32_F32_X3,
        "bf16x3": preset.BF16_BF16_F32_X3,
        "bf16x6": preset.BF16_BF16_F32_X6,
        "bf16x9": preset.BF16_BF16_F32_X9,
    }
    if algorithm not in table:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return table[algorithm]


def matmul(a: Array, b: Array, algorithm: str = "bf16x3") -> Array:
    """Batched a @ b over the leading axes, float32 result, with the named dot algorithm."""
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch))
    prec = precision_of(algorithm)
    kwargs = {} if isinstance(prec, lax.DotAlgorithmPreset) else {"preferred_element_type": jnp.float32}
    return lax.dot_general(a, b, dims, precision=prec, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Summaries.


def transfer_form(*, g: Any = None, gk: Any = None, beta: Any = None) -> str:
    """The cheapest exact form of T_C for a family with these gates."""
    if beta is not None:
        return "dense"
    if gk is not None:
        return "diagonal"
    if g is not None:
        return "scalar"
    return "identity"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Summary:
    """A segment's affine state map S -> T S + state, with T in its cheapest exact form.

    Attributes:
      form: "identity" | "scalar" | "diagonal" | "dense" (static: it is part of the PyTree structure).
      state: S(C|0) [..., H, K, V], the state the segment leaves behind from a zero start.
      transfer: identity -> None; scalar -> log of the per-head factor [..., H]; diagonal -> log of the diagonal
        [..., H, K]; dense -> the matrix T_C [..., H, K, K]. Leading axes (segments, layers, batch) are allowed.
    """

    form: str
    state: Array
    transfer: Array | None = None

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {self.form!r}")
        if (self.form == "identity") != (self.transfer is None):
            raise ValueError(f"form {self.form!r} {'takes no' if self.form == 'identity' else 'needs a'} transfer")

    def tree_flatten(self):
        return (self.state, self.transfer), self.form

    @classmethod
    def tree_unflatten(cls, form, children):
        state, transfer = children
        obj = object.__new__(cls)  # skip validation: under transformations leaves may be placeholders
        object.__setattr__(obj, "form", form)
        object.__setattr__(obj, "state", state)
        object.__setattr__(obj, "transfer", transfer)
        return obj

    @property
    def shape(self) -> tuple[int, ...]:
        """The state's shape [..., H, K, V]."""
        return tuple(self.state.shape)

    @property
    def nbytes(self) -> int:
        return int(self.state.nbytes) + (0 if self.transfer is None else int(self.transfer.nbytes))


def _key_dim(summary: Summary) -> int:
    return summary.state.shape[-2]


def promote(summary: Summary, form: str) -> Summary:
    """Rewrite `summary` in a more general form (identity < scalar < diagonal < dense); exact."""
    if _FORM_RANK[form] < _FORM_RANK[summary.form]:
        raise ValueError(f"cannot promote a {summary.form!r} summary to the narrower form {form!r}")
    if form == summary.form:
        return summary
    if form == "dense":
        return Summary("dense", summary.state, dense_transfer(summary))
    lead_heads = summary.state.shape[:-2]  # [..., H]
    if summary.form == "identity":
        log = jnp.zeros(lead_heads, summary.state.dtype)
    else:
        log = summary.transfer
    if form == "scalar":
        return Summary("scalar", summary.state, log)
    if log.ndim == len(lead_heads):  # scalar -> diagonal
        log = jnp.broadcast_to(log[..., None], lead_heads + (_key_dim(summary),))
    return Summary("diagonal", summary.state, log)


def dense_transfer(summary: Summary) -> Array:
    """T_C as a dense [..., H, K, K] matrix (for inspection, tests and mixing with dense families)."""
    key_dim = _key_dim(summary)
    lead_heads = summary.state.shape[:-2]
    eye = jnp.eye(key_dim, dtype=summary.state.dtype)
    if summary.form == "dense":
        return summary.transfer
    if summary.form == "identity":
        return jnp.broadcast_to(eye, lead_heads + (key_dim, key_dim))
    if summary.form == "scalar":
        return jnp.exp(summary.transfer)[..., None, None] * eye
    return jnp.exp(summary.transfer)[..., :, None] * eye


def dense_product(a: Array, b: Array, algorithm: str | None) -> Array:
    """a @ b over the trailing two axes, broadcasting the leading ones: HIGHEST precision for None / "f32", else
    `matmul` with that tensor-core algorithm ("bf16x3", ...) for the dense products of composition, the bulk of a
    PIC request's state work."""
    if algorithm in (None, "f32"):
        return einsum("...kj,...jn->...kn", a, b)
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])  # dot_general needs equal batch axes
    return matmul(jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:]), algorithm)


def apply_transfer(summary: Summary, x: Array, algorithm: str | None = None) -> Array:
    """T x for x [..., H, K, N] (a state, or another transfer)."""
    if summary.form == "identity":
        return x
    if summary.form == "scalar":
        return jnp.exp(summary.transfer)[..., None, None] * x
    if summary.form == "diagonal":
        return jnp.exp(summary.transfer)[..., :, None] * x
    return dense_product(summary.transfer, x, algorithm)


def advance(summary: Summary, state: Array) -> Array:
    """The state after the segment, from `state` before it: T state + S(C|0)."""
    if state.shape[-3:] != summary.state.shape[-3:]:
        raise ValueError(f"state must be [..., H, K, V] = {summary.state.shape[-3:]}, got shape {state.shape}")
    return apply_transfer(summary, state.astype(summary.state.dtype)) + summary.state


def compose(first: Summary, second: Summary, *, algorithm: str | None = None) -> Summary:
    """The summary of `first` followed by `second`: (T2 T1, T2 S1 + S2). Associative, not commutative.

    algorithm: dot algorithm of the dense products (None / "f32": HIGHEST; "bf16x3": three bfloat16 tensor-core
    passes, ~1e-6 relative per product; bench/linear_kernels.py times the algorithms, see bench/RESULTS.md)."""
    form = FORMS[max(_FORM_RANK[first.form], _FORM_RANK[second.form])]
    first, second = promote(first, form), promote(second, form)
    state = apply_transfer(second, first.state, algorithm) + second.state
    if form == "identity":
        return Summary("identity", state, None)
    if form in ("scalar", "diagonal"):
        return Summary(form, state, first.transfer + second.transfer)
    return Summary("dense", state, dense_product(second.transfer, first.transfer, algorithm))


def stack_summaries(summaries: list[Summary] | tuple[Summary, ...]) -> Summary:
    """Stack summaries along a new leading axis, promoting them to their widest form."""
    if not summaries:
        raise ValueError("summaries must be a non-empty list")
    form = FORMS[max(_FORM_RANK[s.form] for s in summaries)]
    promoted = [promote(s, form) for s in summaries]
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *promoted)
