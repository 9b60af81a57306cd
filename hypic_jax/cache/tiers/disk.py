"""The disk tier (`DiskStore`) and its file format: one file per entry, found again by a restarted process.

Files: `<dir>/<key[:2]>/<key>.seg`, written to a temporary file in the same folder, fsynced and renamed into place,
so a crash never leaves a partial entry under an entry's name. Layout:

    8 bytes   magic b"HYPICSEG"
    4 bytes   format version (little-endian uint32)
    4 bytes   header length H (little-endian uint32)
    H bytes   header, UTF-8 JSON: fingerprint, form (`compact_form`), key, kind, seam, tokens, arrays (dtype
              and shape of each piece), kept (the dense T heads stored, where some were left out), payload_bytes,
              digests (per piece, BLAKE2b-256 of each DIGEST_SLICE bytes of it, hex)
    32 bytes  BLAKE2b-256 of the version, length and header bytes
    payload   the pieces' bytes in order (C order)

Opening a folder scans the headers (the index is rebuilt from them, no separate index file): a file with a bad
magic, header checksum, size or name is corrupt (deleted, counted); one of another format version or model
fingerprint is foreign (left alone, counted, never read as a hit). A hit re-reads the whole file and checks the
header, the token ids and the payload checksum before anything is served; a failure deletes the file, counts it
and the request recomputes the entry. Inclusive: a promoted entry's file stays, and demoting an entry whose file
exists writes nothing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import time
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hypic_jax.cache.tiers.cost import Policy
from hypic_jax.cache.tiers.pieces import Pieces, payload_digests, raw_bytes
from hypic_jax.cache.tiers.store import _Meta, _Store

log = logging.getLogger(__name__)

MAGIC = b"HYPICSEG"
FORMAT_VERSION = 2
SUFFIX = ".seg"
# errors of the medium rather than of one file: the tier turns off (`_Store.turn_off`) instead of failing each write
MEDIUM_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO)


class DiskStore(_Store):
    """One file per entry under `folder` (module docstring); `layout` is the engine's `pool_layout`."""

    tier = "disk"

    def __init__(self, folder, capacity_bytes: int | None, policy: Policy, *, fingerprint: str, leaves,
                 form: str = "exact", droppable=None):
        super().__init__(capacity_bytes, policy)
        self.folder = Path(folder).expanduser().resolve()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file, or under one: say which argument, not only errno's words
            raise ValueError(f"disk_cache_dir: cannot use {str(self.folder)!r} as a folder: {error}") from error
        self.fingerprint = fingerprint
        self.form = form
        self._leaves = list(leaves)  # `Mover.leaves`
        self._writing: set[str] = set()  # keys whose files are being written
        self._droppable = tuple(droppable) if droppable is not None else (False,) * len(self._leaves)
        self.scan()

    # Format ---------------------------------------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def _signature(self, length: int, kept: dict[int, list[int]]) -> list[list]:
        """The pieces' [dtype, shape] an entry of `length` tokens must have; a leaf in `kept` holds those heads."""
        out = []
        for j, (kind, shape, dtype) in enumerate(self._leaves):
            if j in kept:
                shape = (len(kept[j]), *shape[1:])
            out.append([dtype.str if dtype.kind != "V" else dtype.name,
                        list(shape if kind == "slot" else (length, *shape))])
        return out

    def _kept(self, header: dict) -> dict[int, list[int]] | None:
        """The header's kept heads per leaf, None when they are not a valid subset for this store's leaves."""
        kept = {int(j): [int(h) for h in heads] for j, heads in header.get("kept", {}).items()}
        for j, heads in kept.items():
            if not (0 <= j < len(self._leaves) and self._droppable[j]):
                return None
            if any(b <= a for a, b in zip(heads, heads[1:])) or (heads and not 0 <= heads[0] <= heads[-1] <
                                                                  self._leaves[j][1][0]):
                return None
        return kept

    def _encode(self, pieces: Pieces) -> tuple[bytes, list[np.ndarray]]:
        arrays = [np.ascontiguousarray(a) for a in pieces.arrays]
        digests = payload_digests([memoryview(raw_bytes(a)) for a in arrays])
        header = json.dumps(dict(
            fingerprint=self.fingerprint, form=self.form, key=pieces.key, kind=pieces.kind, seam=int(pieces.seam),
            tokens=[int(t) for t in pieces.tokens],
            arrays=[[a.dtype.str if a.dtype.kind != "V" else a.dtype.name, list(a.shape)] for a in arrays],
            kept={str(j): [int(h) for h in heads] for j, heads in sorted(pieces.kept.items())},
            payload_bytes=int(sum(a.nbytes for a in arrays)), digests=digests),
            separators=(",", ":")).encode()
        head = struct.pack("<II", FORMAT_VERSION, len(header)) + header
        return MAGIC + head + hashlib.blake2b(head, digest_size=32).digest(), arrays

    @staticmethod
    def _read_header(f, size: int) -> tuple[str, dict | None, int]:
        """("ok" | "corrupt" | "foreign", header, payload offset) from an open file of `size` bytes."""
        start = f.read(16)
        if len(start) < 16 or start[:8] != MAGIC:
            return "corrupt", None, 0
        version, length = struct.unpack("<II", start[8:16])
        if version != FORMAT_VERSION:
            return "foreign", None, 0
        if 16 + length + 32 > size:
            return "corrupt", None, 0
        header = f.read(length)
        checksum = f.read(32)
        if hashlib.blake2b(start[8:16] + header, digest_size=32).digest() != checksum:
            return "corrupt", None, 0
        try:
            meta = json.loads(header)
        except ValueError:
            return "corrupt", None, 0
        return "ok", meta, 16 + length + 32

    def _check(self, path: Path, f, size: int) -> tuple[str, dict | None, int]:
        state, header, offset = self._read_header(f, size)
        if state != "ok":
            return state, None, 0
        if header.get("fingerprint") != self.fingerprint or header.get("form") != self.form:
            return "foreign", None, 0  # another model, or another storage form of this one: never served
        try:
            length = len(header["tokens"]) - int(header["seam"])
            kept = self._kept(header)
            ok = (kept is not None and header["key"] == path.name[: -len(SUFFIX)]
                  and header["arrays"] == self._signature(length, kept)
                  and offset + int(header["payload_bytes"]) == size)
        except (KeyError, TypeError, ValueError):
            ok = False
        return ("ok", header, offset) if ok else ("corrupt", None, 0)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("disk cache: %s file %s removed", why, path)
        self.stats.corrupt += 1
        path.unlink(missing_ok=True)

    # Index ----------------------------------------------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from the folder's headers (payload checksums are checked when a file is read)."""
        with self.lock:
            self.index.clear()
            self.stats.bytes = 0
            found = []
            for path in self.folder.glob(f"*/*{SUFFIX}"):
                try:
                    size = path.stat().st_size
                    with open(path, "rb") as f:
                        state, header, _ = self._check(path, f, size)
                except OSError:
                    continue
                if state == "corrupt":
                    self._discard(path, "corrupt or truncated")
                elif state == "foreign":
                    self.stats.foreign += 1
                else:
                    found.append((path.stat().st_mtime, header["key"], len(header["tokens"]) - header["seam"],
                                  size, path))
            for _, key, tokens, size, path in sorted(found):  # oldest first: LRU order across a restart
                self._add(key, _Meta(tokens, size, 1, path=path))
            self._clean_temporaries()

    def _clean_temporaries(self, age_s: float = 3600.0) -> None:
        """Temporary files of writes that never finished (a crash); a recent one may be another process's."""
        now = time.time()
        for path in self.folder.glob("*/.tmp-*"):
            try:
                if now - path.stat().st_mtime > age_s:
                    path.unlink()
            except OSError:
                pass

    # Reads and writes -----------------------------------------------------------------------------------------------
    def take(self, key: str, tokens: tuple[int, ...]) -> Pieces | None:
        """The entry under `key` if its file is intact and holds `tokens` (the file stays)."""
        with self.lock:
            meta = self.index.get(key)
            if meta is None:
                return None
            path = meta.path
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    state, header, offset = self._check(path, f, size)
                    if state != "ok":
                        self._pop(key)
                        if state == "corrupt":
                            self._discard(path, "corrupt or truncated")
                        else:
                            self.stats.foreign += 1
                        return None
                    if tuple(header["tokens"]) != tokens:
                        return None  # a digest collision: never serve it
                    payload = f.read(size - offset)
            except OSError:
                self._pop(key)
                return None
            layout, at = [], 0  # (dtype, shape, offset) of each piece in the payload
            for dtype_name, shape in header["arrays"]:
                dtype = np.dtype(jnp.dtype(dtype_name))
                layout.append((dtype, shape, at))
                at += int(np.prod(shape)) * dtype.itemsize
            view = memoryview(payload)
            if (len(payload) != header["payload_bytes"] or at != len(payload) or payload_digests(
                    [view[o: o + int(np.prod(sh)) * dt.itemsize] for dt, sh, o in layout]) != header.get("digests")):
                self._pop(key)
                self._discard(path, "corrupt")
                return None
            arrays = [np.frombuffer(payload, dt, int(np.prod(sh)), o).reshape(sh) for dt, sh, o in layout]
            meta.uses += 1
            meta.priority = self.policy.rank(self.tier, meta.tokens, meta.nbytes, meta.uses)
            self.index[key] = self.index.pop(key)  # most recently used
            self.stats.hits += 1
            kept = {j: np.asarray(heads, np.int16) for j, heads in self._kept(header).items()}
            return Pieces(key=key, tokens=tokens, kind=header["kind"], seam=int(header["seam"]), arrays=arrays,
                          uses=meta.uses, kept=kept)

    def put(self, pieces: Pieces) -> bool:
        """Write `pieces` (atomically) unless its file exists; False when the write failed. The file is encoded and
        written outside the store's lock, so lookups of other entries do not wait for the drive."""
        with self.lock:
            if pieces.key in self.index or pieces.key in self._writing:
                return True
            if self.off:
                self.stats.skipped += 1
                return False
            self._writing.add(pieces.key)
        path = self.path_of(pieces.key)
        tmp = path.parent / f".tmp-{pieces.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            head, arrays = self._encode(pieces)
            size = len(head) + sum(a.nbytes for a in arrays)
            with self.lock:
                for _, meta in self._victims(size):
                    meta.path.unlink(missing_ok=True)
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(head)
                for a in arrays:
                    f.write(raw_bytes(a))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as error:
            log.warning("disk cache: writing %s failed: %s", path, error)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # a read-only folder keeps nothing to remove
            with self.lock:
                self.stats.write_errors += 1
                self._writing.discard(pieces.key)
                if error.errno in MEDIUM_ERRORS:
                    self.turn_off(f"writing to {self.folder} failed: {os.strerror(error.errno)}")
            return False
        with self.lock:
            self._writing.discard(pieces.key)
            self._add(pieces.key, _Meta(pieces.length, size, pieces.uses, path=path))
            self.stats.puts += 1
        return True

    def clear(self) -> None:
        """Delete this model's files (foreign files stay)."""
        with self.lock:
            for meta in self.index.values():
                meta.path.unlink(missing_ok=True)
            self.index.clear()
            self.stats.bytes = self.stats.entries = 0


def read_header(path) -> dict | None:
    """The header of the entry file at `path` (module docstring) when its magic, format version and header checksum
    hold, else None. The payload is not read: what a crash left whole under an entry's name, as a tool sees it."""
    try:
        with open(path, "rb") as f:
            state, header, _ = DiskStore._read_header(f, os.fstat(f.fileno()).st_size)
    except OSError:
        return None
    return header if state == "ok" else None


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
