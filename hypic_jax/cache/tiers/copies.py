"""The copy machinery between the device pools and the tiers (`Mover`): one entry moves as one byte buffer each
way (`Staged` off the device, `Transfer` on its way back), through compiled gather and scatter programs per bucket
of whole pages, in the stored form the engine chose (`compact_form`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypic_jax.core.summary import Summary
from hypic_jax.cache.tiers.pieces import Pieces, raw_bytes

log = logging.getLogger(__name__)

# where the host tier keeps entries (`Mover`): "pinned" (page-locked, where the device has such memory) or "pageable"
HOST_MEMORY = ("pinned", "pageable")

DROP = np.iinfo(np.int32).max // 2  # a pool row past every pool: padded scatter rows are dropped


def dense_transfer_leaves(tree) -> list[bool]:
    """Per leaf of a pool tree (`jax.tree.leaves` order): whether it is a dense summary's T [..., H, K, K]."""
    flags = []
    for item in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Summary)):
        if isinstance(item, Summary):
            flags += [False] + ([item.form == "dense"] if item.transfer is not None else [])
        else:
            flags.append(False)
    return flags


def compact_form(dtype: str | None, transfer_tol: float | None) -> str:
    """The storage form's name, recorded in every disk file ("exact", "bfloat16", "bfloat16+t<=0.001", ...)."""
    form = dtype or "exact"
    return form if transfer_tol is None else f"{form}+t<={transfer_tol:g}"


@dataclasses.dataclass
class Staged:
    """An entry in the form its promotion sends (`Mover.stage`): one byte buffer of every piece at the static
    offsets of its bucket (token rows padded to the bucket), and the kept heads of the droppable T leaves as rows of
    one array, with the stored leaf and head each row belongs to (padded to a power of two with leaf -1). `main`
    and `heads` are numpy arrays, or jax arrays in pinned host memory (`Mover`'s host_sharding)."""

    bucket: int
    main: Any  # uint8 [Mover.layout(bucket)[1]]
    heads: Any = None  # [hb, *head shape] in the T leaves' stored dtype
    head_leaf: np.ndarray | None = None  # int32 [hb]
    head_id: np.ndarray | None = None  # int32 [hb]
    owner: "Mover | None" = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(self.main.nbytes + (0 if self.heads is None else self.heads.nbytes + 8 * len(self.head_id)))

    def views(self, length: int) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """Host arrays of the pieces of an entry of `length` tokens and its kept heads (`Mover.views`)."""
        return self.owner.views(self, length)


@dataclasses.dataclass
class Transfer:
    """A promotion in flight (`Mover.transfer`): its buffers sent to the device, the rows they go to."""

    bucket: int
    slot: np.ndarray  # int32 scalar
    rows: np.ndarray  # int32 [bucket pages * page], DROP past the entry
    main: Any  # the device copy of `Staged.main`
    heads: tuple | None  # (heads, rows [droppable outputs, hb], head ids), on the device


def _as_bytes(x):
    """A device array's bytes, flat uint8 (bitcast: no conversion)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b, dtype, shape):
    """`_as_bytes`'s inverse for one piece."""
    dtype = jnp.dtype(dtype)
    return jax.lax.bitcast_convert_type(b.reshape(-1, dtype.itemsize), dtype).reshape(shape)


class Mover:
    """Compiled copies of one entry between the device pools and the host, in one buffer each way.

    An entry has one piece per pooled leaf and layer (hundreds at the 35B-A3B shape); copying each on its own costs
    a fixed overhead per array that dominates the copy at these sizes. So the gather program writes every piece's
    bytes into one uint8 buffer at static offsets (`Staged`), the tier keeps that buffer as the entry (`views`
    reads its pieces back out), and a promotion sends it back as one transfer (`transfer`) that a scatter program
    cuts up on the device. Token rows are padded to a bucket of whole pages (1, 2, 4, ... pages, up to the longest
    entry), so the programs are one gather and one scatter per bucket, compiled by `compile` (the engine's warmup).

    Compact forms (`bench/cache_tiers.py --forms` measures their bytes and deviation):
    - compact: a dtype name ("bfloat16") in which every float32 piece (the linear layers' T and S, float32 K/V and
      conv tails) leaves the device and is stored off it (the gather rounds them; the scatter widens them back to
      the pools' dtype); None keeps every piece as the pools hold it.
    - transfer_tol: a dense T's heads whose largest |entry| is at most this are not stored and come back as zeros.
      T_h multiplies the state entering the segment, so dropping it changes that head's state by at most
      K * transfer_tol * max|S_in|; a gated head's T shrinks with its accumulated decay (||T_h||_2 <= prod alpha_t
      for Gated DeltaNet), which underflows to exactly 0 over a few hundred tokens for fast-forgetting heads, so
      0 drops only exact zeros. None stores every head. The kept heads travel as rows of their own array (padded
      to a power of two of heads, one small program per size) and the scatter writes zeros for the rest on the
      device: the link carries only what is stored."""

    DEMOTE_COPY = "program"  # or "thread": see __init__

    def __init__(self, pools, max_tokens: int, compact: str | None = None, transfer_tol: float | None = None,
                 host_memory: str = "pinned"):
        stack = pools.arrays  # a models.stack.PoolStack: per part of the layer plan, its layers' rows in blocks
        self.specs, self.plan = stack.specs, stack.plan
        self.page = pools.page
        if host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory must be one of {HOST_MEMORY}, got {host_memory!r}")
        self.device = device = next(iter(jax.tree.leaves(stack.parts)[0].devices()))  # the pools'
        self.device_sharding = jax.sharding.SingleDeviceSharding(device)
        # where demoted entries live: page-locked host memory, which the device reads and writes by DMA at the
        # link's rate and without the caller waiting (pageable memory goes through a staging copy), where the
        # device has it; else numpy arrays
        kinds = {m.kind for m in device.addressable_memories()}
        self.host_sharding = (jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                              if host_memory == "pinned" and "pinned_host" in kinds else None)
        # who copies a demoted entry to pinned host memory: the gather program itself, its output placed there
        # ("program"), or the demotion thread after the gather wrote it to device memory ("thread"), so that the
        # request's path issues a device-only program (`bench/cache_tiers.py --demote-copy` times both)
        self.demote_copy = self.DEMOTE_COPY
        self.compact = compact
        if transfer_tol is not None and not (np.isfinite(transfer_tol) and transfer_tol >= 0):
            raise ValueError(f"transfer_tol must be None or a finite number >= 0, got {transfer_tol!r}")
        self.transfer_tol = transfer_tol
        # the device programs move per part and leaf all the part's layers at once ([members, ...] per slot,
        # [rows, members, ...] per token); off the device an entry is per layer and leaf, in layer order, so
        # its stored form does not depend on how the layers are grouped
        part_stored: list[list[str]] = []
        part_drop: list[list[bool]] = []
        output_part: list[int] = []
        for p, (spec, tree) in enumerate(zip(stack.specs, stack.parts)):
            names = []
            for leaf in jax.tree.leaves(tree):
                dtype = np.dtype(leaf.dtype)
                if compact and dtype == np.float32:
                    dtype = np.dtype(jnp.dtype(compact))
                names.append(dtype.name)
                output_part.append(p)
            part_stored.append(names)
            part_drop.append([flag and spec.kind == "slot" and transfer_tol is not None
                              for flag in dense_transfer_leaves(tree)])
        self._stored = tuple(name for names in part_stored for name in names)
        self._drop = tuple(flag for flags in part_drop for flag in flags)  # per device output
        self._output_part = tuple(output_part)
        first = np.cumsum([0] + [len(names) for names in part_stored])
        self.leaves: list[tuple[str, tuple[int, ...], np.dtype]] = []  # (kind, per-entry/per-token shape, stored as)
        self._order: list[tuple[int, int]] = []  # per stored leaf: (device output, member)
        for layer in range(stack.plan.layers):
            part, member = stack.plan.part(layer)
            spec = stack.specs[part]
            for j, leaf in enumerate(jax.tree.leaves(stack.parts[part])):
                self.leaves.append((spec.kind, tuple(leaf.shape[1:]), np.dtype(part_stored[part][j])))
                self._order.append((int(first[part]) + j, member))
        self.droppable = tuple(self._drop[i] for i, _ in self._order)  # per stored leaf
        self._output_kinds = {i: kind for (i, _), (kind, _, _) in zip(self._order, self.leaves)}
        # per stored leaf: its row in its part's pools is slot + this
        self._row_base = tuple(int(self.specs[self._output_part[i]].lead) * member for i, member in self._order)
        self._drop_outputs = tuple(i for i, flag in enumerate(self._drop) if flag)
        heads = {(self.leaves[j][1][1:], self.leaves[j][2]) for j, flag in enumerate(self.droppable) if flag}
        if len(heads) > 1:
            raise ValueError(f"transfer_tol needs the dense transfers of every layer in one shape and dtype, got "
                             f"{sorted(heads, key=str)}")
        self.head_shape, self.head_dtype = next(iter(heads)) if heads else ((), None)
        top = max(1, min(-(-max_tokens // pools.page), pools.pages - 1))
        self.buckets = self._powers(top)
        total_heads = sum(self.leaves[j][1][0] for j, flag in enumerate(self.droppable) if flag)
        self.head_buckets = self._powers(total_heads) if total_heads else ()
        self._layouts: dict[int, tuple[list[tuple[int, int]], int]] = {}
        self._gather: dict[int, Any] = {}
        self._scatter: dict[int, Any] = {}
        self._heads: dict[int, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _powers(top: int) -> tuple[int, ...]:
        out, b = [], 1
        while b < top:
            out.append(b)
            b *= 2
        return tuple(out + [top])

    def bucket(self, tokens: int) -> int:
        pages = max(1, -(-tokens // self.page))
        for b in self.buckets:
            if b >= pages:
                return b
        raise ValueError(f"an entry of {tokens} tokens is longer than the largest bucket of {self.buckets[-1]} pages")

    def head_bucket(self, heads: int) -> int:
        return next(b for b in self.head_buckets if b >= heads)

    def layout(self, bucket: int) -> tuple[list[tuple[int, int]], int]:
        """Per stored leaf (offset, bytes) in a `Staged.main` buffer of `bucket` pages (0 bytes for a droppable
        leaf, whose heads travel apart), and the buffer's size."""
        with self._lock:
            found = self._layouts.get(bucket)
        if found is not None:
            return found
        out, at = [], 0
        for (kind, shape, dtype), drop in zip(self.leaves, self.droppable):
            n = 0 if drop else int(np.prod(shape)) * dtype.itemsize * (1 if kind == "slot" else bucket * self.page)
            out.append((at, n))
            at += n
        with self._lock:
            self._layouts[bucket] = (out, at)
        return out, at

    def adopt(self, donor: "Mover") -> None:
        """Use `donor`'s compiled programs (an engine of the same pool shapes and stored forms)."""
        if (donor.leaves, donor.droppable, donor.specs) != (self.leaves, self.droppable, self.specs):
            raise ValueError("the donor's pools or stored forms differ")
        if donor.demote_copy == self.demote_copy and donor.host_sharding == self.host_sharding:
            self._gather.update(donor._gather)  # their outputs' placement differs otherwise
        self._scatter.update(donor._scatter)
        self._heads.update(donor._heads)

    # Device programs --------------------------------------------------------------------------------------------
    @staticmethod
    def _rows(spec, slot, rows):
        """Rows of every layer of a part: [members] for a slot, [len(rows), members] for token rows."""
        base = spec.lead * jnp.arange(spec.members, dtype=jnp.int32)
        return slot + base if spec.kind == "slot" else rows[:, None] + base[None, :]

    def _gather_fn(self, arrays, slot, rows):
        """The entry as one byte buffer (`layout`), the droppable outputs' pieces as they are and their heads'
        largest |entry| [members, H] (measured before rounding)."""
        outputs, head_max = [], []
        for spec, tree in zip(self.specs, arrays.parts):
            index = Mover._rows(spec, slot, rows)
            for leaf in jax.tree.leaves(tree):
                piece = leaf[index]
                if self._drop[len(outputs)]:
                    head_max.append(jnp.max(jnp.abs(piece), axis=(-2, -1)).astype(jnp.float32))
                outputs.append(piece.astype(jnp.dtype(self._stored[len(outputs)])))
        parts = [_as_bytes(outputs[i][member] if self._output_kinds[i] == "slot" else outputs[i][:, member])
                 for (i, member), drop in zip(self._order, self.droppable) if not drop]
        main = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)
        return main, [outputs[i] for i in self._drop_outputs], head_max

    def _scatter_fn(self, arrays, slot, rows, main, *, bucket):
        """`main` cut into the pieces at `layout(bucket)`'s offsets, written to the entry's rows (padded rows are
        DROP, past the pool: dropped); droppable leaves are written as zeros (`_heads_fn` adds the kept heads)."""
        offsets, _ = self.layout(bucket)
        pieces: dict[int, list] = {}
        for (i, member), (kind, shape, dtype), (at, n), drop in zip(self._order, self.leaves, offsets,
                                                                     self.droppable):
            full = shape if kind == "slot" else (bucket * self.page,) + shape
            piece = jnp.zeros(full, dtype) if drop else _from_bytes(main[at: at + n], dtype, full)
            pieces.setdefault(i, []).append((member, piece))
        new, out = [], 0
        for spec, tree in zip(self.specs, arrays.parts):
            index = Mover._rows(spec, slot, rows)
            leaves, treedef = jax.tree.flatten(tree)
            written = []
            for leaf in leaves:
                members = [p for _, p in sorted(pieces[out], key=lambda mp: mp[0])]
                stacked = jnp.stack(members, axis=0 if spec.kind == "slot" else 1)
                written.append(leaf.at[index].set(stacked.astype(leaf.dtype), mode="drop"))
                out += 1
            new.append(jax.tree.unflatten(treedef, written))
        return arrays.replace(new)

    def _heads_fn(self, arrays, heads, head_rows, head_ids):
        """The kept heads written into the droppable outputs: row r of `heads` goes to pool row head_rows[k, r]
        (DROP where it belongs to another output) of droppable output k, head head_ids[r]."""
        new, out, k = [], 0, 0
        for tree in arrays.parts:
            leaves, treedef = jax.tree.flatten(tree)
            written = []
            for leaf in leaves:
                if self._drop[out]:
                    leaf = leaf.at[head_rows[k], head_ids].set(heads.astype(leaf.dtype), mode="drop")
                    k += 1
                written.append(leaf)
                out += 1
            new.append(jax.tree.unflatten(treedef, written))
        return arrays.replace(new)

    def _program(self, which: str, bucket: int, arrays):
        table = {"gather": self._gather, "scatter": self._scatter, "heads": self._heads}[which]
        with self._lock:
            program = table.get(bucket)
            if program is not None:
                return program
        import functools

        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        if which == "gather":  # its outputs land in host memory when pinned (the program's own copy out)
            rows = jax.ShapeDtypeStruct((bucket * self.page,), jnp.int32)
            try:
                out = self.host_sharding if self.demote_copy == "program" else None
                program = jax.jit(self._gather_fn, out_shardings=out).lower(shapes, slot, rows).compile()
            except Exception as error:  # noqa: BLE001  (a backend without host outputs: numpy on the host instead)
                if self.host_sharding is None:
                    raise
                log.warning("the host tier cannot keep entries in pinned host memory here (%s: %s); it keeps them "
                            "in pageable memory", type(error).__name__, str(error)[:300])
                with self._lock:  # programs that wrote to pinned memory are not used again
                    self.host_sharding = None
                    self._gather.clear()
                program = jax.jit(self._gather_fn).lower(shapes, slot, rows).compile()
        elif which == "scatter":
            rows = jax.ShapeDtypeStruct((bucket * self.page,), jnp.int32)
            main = jax.ShapeDtypeStruct((self.layout(bucket)[1],), jnp.uint8)
            program = jax.jit(functools.partial(self._scatter_fn, bucket=bucket), donate_argnums=0).lower(
                shapes, slot, rows, main).compile()
        else:  # bucket: rows of kept heads
            heads = jax.ShapeDtypeStruct((bucket, *self.head_shape), self.head_dtype)
            head_rows = jax.ShapeDtypeStruct((len(self._drop_outputs), bucket), jnp.int32)
            ids = jax.ShapeDtypeStruct((bucket,), jnp.int32)
            program = jax.jit(self._heads_fn, donate_argnums=0).lower(shapes, heads, head_rows, ids).compile()
        with self._lock:
            table[bucket] = program
        return program

    def compile(self, arrays) -> int:
        for bucket in self.buckets:
            self._program("gather", bucket, arrays)
            self._program("scatter", bucket, arrays)
        for bucket in self.head_buckets:
            self._program("heads", bucket, arrays)
        return 2 * len(self.buckets) + len(self.head_buckets)

    @property
    def compiled(self) -> int:
        return len(self._gather) + len(self._scatter) + len(self._heads)

    # Demotion: pools -> host ------------------------------------------------------------------------------------
    def gather_start(self, arrays, slot: int, rows):
        """Issue the entry's copy out of the pools into device arrays of its own and return at once (the transfer
        to the host is `gather_finish`'s: on a GPU, starting it here would block the caller for the whole copy): the
        pools' rows may be overwritten by any program issued after this one."""
        rows = np.asarray(rows, np.int32)
        bucket = self.bucket(len(rows))
        padded = np.zeros(bucket * self.page, np.int32)  # padded reads hit row 0, which no entry owns
        padded[: len(rows)] = rows
        return self._program("gather", bucket, arrays)(arrays, np.asarray(slot, np.int32), padded), len(rows)

    def gather_finish(self, started) -> Staged:
        """`gather`'s result from `gather_start`'s handle (waits for the transfer)."""
        (main, dense, head_max), length = started
        if self.host_sharding is None:
            main = np.asarray(jax.device_get(main))
        else:  # in pinned host memory once the program is done, or copied there now
            if main.sharding.memory_kind != self.host_sharding.memory_kind:
                main = jax.device_put(main, self.host_sharding)
            main.block_until_ready()
        staged = Staged(bucket=self.bucket(length), main=main, owner=self)
        if self._drop_outputs:
            dense, head_max = jax.device_get((dense, head_max))
            dense = dict(zip(self._drop_outputs, dense))
            maxima = dict(zip(self._drop_outputs, head_max))
            rows, leaf_of, ids = [], [], []
            for j, (i, member) in enumerate(self._order):
                if self.droppable[j]:
                    heads = np.flatnonzero(np.asarray(maxima[i][member]) > self.transfer_tol)
                    rows.append(np.asarray(dense[i][member])[heads])
                    leaf_of += [j] * len(heads)
                    ids += heads.tolist()
            self._stage_heads(staged, np.concatenate(rows), leaf_of, ids)
        return staged

    def _stage_heads(self, staged: Staged, rows: np.ndarray, leaf_of, ids) -> None:
        n = len(leaf_of)
        if not n:
            return
        hb = self.head_bucket(n)
        heads = np.zeros((hb, *self.head_shape), self.head_dtype)
        heads[:n] = rows
        staged.heads = heads if self.host_sharding is None else jax.device_put(heads, self.host_sharding)
        staged.head_leaf = np.full(hb, -1, np.int32)
        staged.head_leaf[:n] = leaf_of
        staged.head_id = np.zeros(hb, np.int32)
        staged.head_id[:n] = ids

    def views(self, staged: Staged, length: int) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """The pieces of a staged entry of `length` tokens as views of its buffers, and its kept heads."""
        offsets, size = self.layout(staged.bucket)
        if staged.main.shape != (size,) or staged.main.dtype != np.uint8:
            raise ValueError(f"a staged entry of bucket {staged.bucket} needs {size} bytes, got {staged.main.shape}")
        main = np.asarray(staged.main)  # a host copy where the buffer is a jax array in pinned memory
        all_heads = None if staged.heads is None else np.asarray(staged.heads)
        arrays, kept = [], {}
        leaf_of = staged.head_leaf if staged.heads is not None else np.zeros(0, np.int32)
        for j, ((kind, shape, dtype), (at, n)) in enumerate(zip(self.leaves, offsets)):
            if self.droppable[j]:
                take = np.flatnonzero(leaf_of == j)
                lo, hi = (int(take[0]), int(take[-1]) + 1) if len(take) else (0, 0)
                arrays.append(all_heads[lo:hi] if len(take) else np.zeros((0, *shape[1:]), dtype))
                kept[j] = (staged.head_id[lo:hi] if len(take) else np.zeros(0)).astype(np.int16)
                continue
            full = shape if kind == "slot" else (staged.bucket * self.page,) + shape
            piece = np.frombuffer(main, dtype, int(np.prod(full)), at).reshape(full)
            arrays.append(piece if kind == "slot" else piece[:length])
        return arrays, kept

    def moved(self, staged: Staged, where=None) -> Staged:
        """`staged` with its buffers on another device (`where`, a jax device: the peer tier) or, with None, in the
        host tier's memory (pinned where the device has it, else numpy). The copies are issued, not awaited."""
        if where is not None:
            target = jax.sharding.SingleDeviceSharding(where)
            move = lambda a: jax.device_put(a, target)  # noqa: E731
        elif self.host_sharding is not None:
            move = lambda a: jax.device_put(a, self.host_sharding)  # noqa: E731
        else:
            move = lambda a: np.asarray(jax.device_get(a))  # noqa: E731
        return dataclasses.replace(staged, main=move(staged.main),
                                   heads=None if staged.heads is None else move(staged.heads))

    # Promotion: host -> pools -----------------------------------------------------------------------------------
    def stage(self, pieces: Pieces) -> Staged:
        """`pieces` in the form a promotion sends (the demotion's own buffers when it has them)."""
        if pieces.staged is not None:
            return pieces.staged
        bucket = self.bucket(pieces.length)
        offsets, size = self.layout(bucket)
        main = np.zeros(size, np.uint8)
        rows, leaf_of, ids = [], [], []
        for j, (piece, (kind, shape, dtype), (at, n)) in enumerate(zip(pieces.arrays, self.leaves, offsets)):
            want = shape if kind == "slot" else (pieces.length,) + shape
            if self.droppable[j]:
                heads = (np.asarray(pieces.kept[j], np.int64) if j in pieces.kept
                         else np.arange(shape[0]))
                if piece.dtype != dtype or piece.shape != (len(heads), *shape[1:]):
                    raise ValueError(f"piece {j}: {piece.dtype}{list(piece.shape)} is not this engine's stored form")
                rows.append(piece)
                leaf_of += [j] * len(heads)
                ids += heads.tolist()
                continue
            if piece.dtype != dtype or piece.shape != want:
                raise ValueError(f"piece {j}: {piece.dtype}{list(piece.shape)}, this engine stores "
                                 f"{dtype}{list(want)}")
            raw = raw_bytes(np.ascontiguousarray(piece))
            main[at: at + raw.nbytes] = raw
        staged = Staged(bucket=bucket, main=main, owner=self)
        if rows:
            self._stage_heads(staged, np.concatenate(rows), leaf_of, ids)
        return staged

    def transfer(self, staged: Staged, slot: int, rows) -> Transfer:
        """Start sending a staged entry to the device, bound for `slot` and `rows` (asynchronous: returns before
        the copy is done; `scatter_programs` writes it into the pools)."""
        rows = np.asarray(rows, np.int32)
        if self.bucket(len(rows)) != staged.bucket:
            raise ValueError(f"an entry of {len(rows)} rows does not fit a staged entry of bucket {staged.bucket}")
        padded = np.full(staged.bucket * self.page, DROP, np.int32)
        padded[: len(rows)] = rows
        slot = np.asarray(slot, np.int32)
        host = [staged.main]
        if staged.heads is not None:
            head_rows = np.full((len(self._drop_outputs), len(staged.heads)), DROP, np.int32)
            column = {i: k for k, i in enumerate(self._drop_outputs)}
            for r, j in enumerate(staged.head_leaf.tolist()):
                if j >= 0:
                    head_rows[column[self._order[j][0]], r] = int(slot) + self._row_base[j]
            host += [staged.heads, head_rows, staged.head_id]
        device = jax.device_put(host, self.device_sharding)  # one call: every buffer's copy is issued at once
        return Transfer(bucket=staged.bucket, slot=slot, rows=padded, main=device[0],
                        heads=tuple(device[1:]) if staged.heads is not None else None)

    def scatter_programs(self, arrays, transfer: Transfer) -> list[tuple[Any, tuple]]:
        """(program, arguments after the pools) per program that writes `transfer` into the pools, in order; each
        donates the pools (`Engine._write_pools`)."""
        out = [(self._program("scatter", transfer.bucket, arrays), (transfer.slot, transfer.rows, transfer.main))]
        if transfer.heads is not None:
            out.append((self._program("heads", len(transfer.heads[0]), arrays), transfer.heads))
        return out
