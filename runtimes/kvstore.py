"""Managed KV: each layer's K and V in fixed-size blocks, in RAM or in a file, within a resident budget.

A layered runtime (runtimes/onnx_layered.py) runs one layer graph at a time, and each graph wants
that layer's whole past as two contiguous arrays (1, n_head_kv, P, head_dim). So the store keeps
every layer's KV in blocks of `block_tokens` positions, in one of two tiers:

* ``ram``  - one anonymous memory map for all RAM layers (pages are committed as positions are
  written, so unused blocks cost nothing);
* ``file`` - one temporary file, read with preadv straight into the staging buffer and written with
  pwrite. Its pages live in the kernel's page cache (written back and evicted under memory pressure),
  never in this process, so the resident memory does not grow with the offloaded KV.

  A shared memory map was tried first: reading a layer through it maps its pages into the process,
  so each read and write must be followed by madvise(MADV_DONTNEED) to keep them out of the resident
  set. That did bound the RSS, but every read then faulted each page back in, and the faults and
  TLB flushes, done by the prefetch thread while ONNX Runtime computed, halved decode speed on
  SmolLM2 (14 -> 7 tok/s at 10 % resident, 2-core VM); preadv costs one copy and no faults.

Before a layer runs, its blocks are copied into one of two staging buffers; a background thread
fills the other buffer with the next layer's blocks while the current layer computes (double
buffering). The budget covers both staging buffers plus the layers kept in RAM; every other layer
lives in the file tier. With no budget, every layer is in RAM.

Rolling back (truncate) needs nothing here: the runtime keeps the length, and rows past it are
overwritten by the next write.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from edgespec.errors import EdgespecError

DEFAULT_BLOCK_TOKENS = 64
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "preadv") else 1024  # buffers per preadv call


@dataclass(frozen=True)
class KVGeometry:
    """What sizes a KV cache: layers, KV heads, head size, element type."""

    n_layer: int
    n_head_kv: int
    head_dim: int
    dtype: str = "float32"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def layer_bytes(self, n_tokens: int) -> int:
        """K and V of one layer for n_tokens positions."""
        return 2 * self.n_head_kv * self.head_dim * self.itemsize * n_tokens


def plan_layers(geometry: KVGeometry, n_ctx: int, group_size: int, budget: int | None,
                block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """How many layers fit in RAM under `budget` (bytes) beside the two staging buffers.

    Everything is sized for a full context (n_ctx rounded up to whole blocks), so resident memory
    stays within the budget however long the sequence grows. Raises when the budget cannot hold
    even the staging buffers, since a layer graph needs its whole past at once.
    """
    if budget is None:
        return geometry.n_layer
    cap = -(-n_ctx // block_tokens) * block_tokens
    per_layer = geometry.layer_bytes(cap)
    staging = 2 * group_size * per_layer
    if budget >= geometry.n_layer * per_layer + staging:
        return geometry.n_layer
    if budget < staging:
        raise EdgespecError(
            f"a resident KV budget of {budget / 2**20:.1f} MiB is below the minimum of {staging / 2**20:.1f} MiB "
            f"(two staging buffers of {group_size} layer(s) at {n_ctx} tokens); raise the budget, lower the "
            "context, or export smaller layer groups")
    return int((budget - staging) // per_layer)


class KVStore:
    """Per-layer KV blocks in a RAM tier and a file tier, read through two staging buffers.

    `groups` lists the layers each fetch returns (one layer graph's layers). Not thread-safe for
    callers: one thread drives it; the store's own prefetch thread only fills staging buffers.
    """

    def __init__(self, geometry: KVGeometry, n_ctx: int, groups: Sequence[Sequence[int]], *,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS, resident_budget_bytes: int | None = None,
                 offload_dir: str | os.PathLike | None = None, prefetch: bool = True):
        if block_tokens < 1 or n_ctx < 1:
            raise EdgespecError("block_tokens and n_ctx must be >= 1")
        self.geometry = geometry
        self.n_ctx = n_ctx
        self.block_tokens = block_tokens
        self.groups = [tuple(g) for g in groups]
        self.group_size = max(len(g) for g in self.groups)
        self.budget = resident_budget_bytes
        g, B = geometry, block_tokens
        self.n_blocks = -(-n_ctx // B)
        self._dtype = np.dtype(g.dtype)
        self._block_shape = (2, g.n_head_kv, B, g.head_dim)  # K and V of B positions
        self._block_bytes = int(np.prod(self._block_shape)) * self._dtype.itemsize
        n_ram = plan_layers(geometry, n_ctx, self.group_size, resident_budget_bytes, block_tokens)
        self.ram_layers = tuple(range(n_ram))  # the first layers stay in RAM; the rest go to the file
        self.file_layers = tuple(range(n_ram, g.n_layer))
        # Anonymous maps, not numpy's allocator: their pages are fresh (never touched by an earlier
        # allocation), so resident memory grows exactly as positions are written. Block-major across
        # layers, so all RAM layers grow at one frontier (at most one part-used huge page in all).
        self._maps: list[mmap.mmap] = []
        self._blocks: list[np.ndarray] = [None] * g.n_layer  # type: ignore[list-item]
        if self.ram_layers:
            ram = self._fresh((self.n_blocks, n_ram, *self._block_shape))
            for j, layer in enumerate(self.ram_layers):
                self._blocks[layer] = ram[:, j]
        self._file = None
        if self.file_layers:
            self._open_file(Path(offload_dir) if offload_dir else Path(tempfile.gettempdir()))
        # Two staging buffers, each with room for one group at n_ctx. A fetch of n positions lays out
        # K and V of each layer back to back for that n, so a buffer is used from its start only.
        self._row = g.n_head_kv * g.head_dim  # elements per position per K (or V)
        self._staging = [self._fresh((2 * self.group_size * self._row * self.n_blocks * B,)) for _ in range(2)]
        self._next_slot = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch") if prefetch else None
        self._lock = threading.Lock()  # the stats are written by both threads
        self.n_filled = 0  # highest position count written (for resident/offloaded bytes)
        self.stats = {"fetch_s": 0.0, "fetch_wait_s": 0.0, "write_s": 0.0, "bytes_fetched": 0,
                      "bytes_fetched_file": 0, "bytes_written": 0, "bytes_written_file": 0, "fetches": 0}

    def _fresh(self, shape: tuple[int, ...]) -> np.ndarray:
        """A zero array on an anonymous map of its own (pages committed on first write)."""
        nbytes = int(np.prod(shape)) * self._dtype.itemsize
        private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # plain anonymous memory
        m = mmap.mmap(-1, max(nbytes, 1), **private)
        self._maps.append(m)
        return np.frombuffer(m, self._dtype, count=int(np.prod(shape))).reshape(shape)

    # -- the file tier --------------------------------------------------------------------------

    def _open_file(self, directory: Path) -> None:
        if not hasattr(os, "pread"):
            raise EdgespecError("the file tier of the KV store needs os.pread / os.pwrite (POSIX); "
                                "use no resident budget on this platform")
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="edgespec-kv-", suffix=".bin", dir=directory)
        self.file_path = Path(name)
        try:
            os.ftruncate(fd, len(self.file_layers) * self.n_blocks * self._block_bytes)  # sparse until written
        except OSError as exc:
            os.close(fd)
            self.file_path.unlink(missing_ok=True)
            raise EdgespecError(f"could not create the KV offload file in {directory} ({exc.strerror}); "
                                "give another offload directory with free space") from None
        self._file = fd
        try:  # POSIX: the open descriptor keeps the data; no file is left behind if the process dies
            self.file_path.unlink()
        except OSError:
            pass
        # where preadv puts the unused tail of a part-filled block (at most one head's K or V of a block)
        self._scratch = np.empty(self.block_tokens * self.geometry.head_dim, self._dtype)

    def _is_file(self, layer: int) -> bool:
        return self._file is not None and layer >= len(self.ram_layers)

    def _offset(self, layer: int, block: int, kv: int, head: int, row: int) -> int:
        """Byte offset in the file of (layer, block, K or V, head, row): blocks are (2, H, B, D) each."""
        g = self.geometry
        index = (((layer - len(self.ram_layers)) * self.n_blocks + block) * 2 + kv) * g.n_head_kv + head
        return (index * self.block_tokens + row) * g.head_dim * self._dtype.itemsize

    # -- writing the new rows -------------------------------------------------------------------

    def write(self, layer: int, start: int, key: np.ndarray, value: np.ndarray) -> None:
        """Store the rows of positions start .. start+T-1; key and value shaped (1, n_head_kv, T, head_dim)."""
        t0 = time.perf_counter()
        n = key.shape[2]
        if start + n > self.n_ctx:
            raise EdgespecError(f"KV positions {start}..{start + n - 1} are past the context of {self.n_ctx}")
        B, blocks = self.block_tokens, self._blocks[layer]
        file = self._is_file(layer)
        if file:  # pwrite needs contiguous rows
            key, value = np.ascontiguousarray(key, self._dtype), np.ascontiguousarray(value, self._dtype)
        pos = start
        while pos < start + n:
            b, r = divmod(pos, B)
            m = min(B - r, start + n - pos)
            i = pos - start
            if file:  # each head's rows of a block are contiguous in the file
                for kv, src in ((0, key), (1, value)):
                    for h in range(self.geometry.n_head_kv):
                        os.pwrite(self._file, src[0, h, i:i + m], self._offset(layer, b, kv, h, r))
            else:
                blocks[b, 0, :, r:r + m] = key[0, :, i:i + m]
                blocks[b, 1, :, r:r + m] = value[0, :, i:i + m]
            pos += m
        nbytes = self.geometry.layer_bytes(n)
        with self._lock:
            self.n_filled = max(self.n_filled, start + n)
            self.stats["write_s"] += time.perf_counter() - t0
            self.stats["bytes_written"] += nbytes
            if file:
                self.stats["bytes_written_file"] += nbytes

    # -- reading a group's past -----------------------------------------------------------------

    def fetch(self, group: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The past (first n positions) of each layer in groups[group], as contiguous (K, V) arrays
        shaped (1, n_head_kv, n, head_dim). They stay valid until the second fetch after this one."""
        return self._fill(self._take_slot(), group, n)

    def prefetch(self, group: int, n: int) -> "Future | list":
        """Start fetching in the background; `result(handle)` returns what `fetch` would."""
        slot = self._take_slot()
        if self._pool is None:
            return self._fill(slot, group, n)
        return self._pool.submit(self._fill, slot, group, n)

    def result(self, handle) -> list[tuple[np.ndarray, np.ndarray]]:
        if not isinstance(handle, Future):
            return handle
        t0 = time.perf_counter()
        out = handle.result()
        with self._lock:
            self.stats["fetch_wait_s"] += time.perf_counter() - t0
        return out

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot ^= 1
        return slot

    def _fill(self, slot: int, group: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        t0 = time.perf_counter()
        g = self.geometry
        out, file_bytes = [], 0
        size = self._row * n
        for j, layer in enumerate(self.groups[group]):
            buf = self._staging[slot][2 * j * size:(2 * j + 2) * size]
            k = buf[:size].reshape(1, g.n_head_kv, n, g.head_dim)
            v = buf[size:].reshape(1, g.n_head_kv, n, g.head_dim)
            self._gather(layer, n, k[0], v[0])
            if self._is_file(layer):
                file_bytes += g.layer_bytes(n)
            out.append((k, v))
        with self._lock:
            self.stats["fetch_s"] += time.perf_counter() - t0
            self.stats["fetches"] += 1
            self.stats["bytes_fetched"] += len(out) * g.layer_bytes(n)
            self.stats["bytes_fetched_file"] += file_bytes
        return out

    def _gather(self, layer: int, n: int, k: np.ndarray, v: np.ndarray) -> None:
        """Copy the first n positions of a layer from its blocks (nb, 2, H, B, D) into k and v (H, n, D)."""
        if self._is_file(layer):
            return self._read_file(layer, n, k, v)
        blocks, B = self._blocks[layer], self.block_tokens
        full, rest = divmod(n, B)
        if full:  # whole blocks in one strided copy each for K and V
            for dst, kv in ((k, 0), (v, 1)):
                h, _, d = dst.shape
                s = dst.strides
                # dst seen as (H, blocks, B, D): a view, never a copy, so the copy lands in the buffer
                view = np.lib.stride_tricks.as_strided(dst, (h, full, B, d), (s[0], B * s[1], s[1], s[2]))
                np.copyto(view, blocks[:full, kv].transpose(1, 0, 2, 3))
        if rest:  # the partly filled last block
            k[:, full * B:n] = blocks[full, 0, :, :rest]
            v[:, full * B:n] = blocks[full, 1, :, :rest]

    def _read_file(self, layer: int, n: int, k: np.ndarray, v: np.ndarray) -> None:
        """preadv a file-tier layer's blocks into k and v: the file holds a layer's blocks one after
        another, so one call reads a run of blocks, each head's rows scattered to where they go; the
        unused tail of a part-filled block goes to a scratch buffer."""
        B, H = self.block_tokens, self.geometry.n_head_kv
        nb = -(-n // B)
        flat = (memoryview(k.reshape(-1)), memoryview(v.reshape(-1)))
        scratch = memoryview(self._scratch)
        d = self.geometry.head_dim
        bufs: list = []
        offset = self._offset(layer, 0, 0, 0, 0)
        for b in range(nb):
            rows = min(B, n - b * B)
            for kv in (0, 1):
                for h in range(H):
                    start = (h * n + b * B) * d
                    bufs.append(flat[kv][start:start + rows * d])
                    if rows < B and not (b == nb - 1 and kv == 1 and h == H - 1):
                        bufs.append(scratch[:(B - rows) * d])
            if len(bufs) + 4 * H > _IOV_MAX or b == nb - 1:
                offset = self._preadv(bufs, offset)
                bufs = []

    def _preadv(self, bufs: list, offset: int) -> int:
        """Fill `bufs` from the file at `offset` (all of them: a short read is an error); the offset after."""
        want = sum(b.nbytes for b in bufs)
        if hasattr(os, "preadv"):
            got = os.preadv(self._file, bufs, offset)
        else:  # one call per buffer where the platform has no preadv
            got = 0
            for buf in bufs:
                data = os.pread(self._file, buf.nbytes, offset + got)
                buf.cast("B")[:len(data)] = data
                got += len(data)
        if got != want:
            raise EdgespecError(f"the KV offload file {self.file_path} returned {got} of {want} bytes; "
                                "was it removed or truncated?")
        return offset + want

    # -- accounting -----------------------------------------------------------------------------

    def _used_tokens(self) -> int:
        return -(-self.n_filled // self.block_tokens) * self.block_tokens

    def ram_tier_bytes(self) -> int:
        """KV bytes of the RAM-tier layers' blocks in use."""
        return len(self.ram_layers) * self.geometry.layer_bytes(self._used_tokens())

    def staging_bytes(self) -> int:
        """Bytes of the two staging buffers in use (their pages are touched as the sequence grows)."""
        return 2 * self.group_size * self.geometry.layer_bytes(self._used_tokens())

    def resident_bytes(self) -> int:
        """KV bytes this process holds now: RAM-tier blocks in use and both staging buffers."""
        return self.ram_tier_bytes() + self.staging_bytes()

    def resident_capacity_bytes(self) -> int:
        """The most the resident part can grow to (a full context): within the budget when one is set."""
        g = self.geometry
        cap = self.n_blocks * self.block_tokens
        return len(self.ram_layers) * g.layer_bytes(cap) + 2 * self.group_size * g.layer_bytes(cap)

    def offloaded_bytes(self) -> int:
        """KV bytes in the file tier now (in the page cache or on disk, not in this process)."""
        return len(self.file_layers) * self.geometry.layer_bytes(self._used_tokens())

    def kv_stats(self) -> dict:
        with self._lock:
            stats = dict(self.stats)
        return {"tier": "file" if self.file_layers else "ram", "block_tokens": self.block_tokens,
                "ram_layers": len(self.ram_layers), "file_layers": len(self.file_layers),
                "resident_budget_bytes": self.budget, "resident_bytes": self.resident_bytes(),
                "resident_capacity_bytes": self.resident_capacity_bytes(),
                "offloaded_bytes": self.offloaded_bytes(), **stats}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._blocks = [None] * self.geometry.n_layer
        self._staging = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a caller still holds a fetched view: the map goes when that does
                pass
        self._maps = []
        if self._file is not None:
            os.close(self._file)
            self._file = None
            self.file_path.unlink(missing_ok=True)  # where the platform could not unlink it while open
