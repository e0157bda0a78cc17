"""The run-time memory guard: watches the real resident set between rounds and, as the process nears
its budget, frees memory that exists, cheapest first, before it refuses work.

The plan makes a setup fit before anything loads; the guard covers what a plan cannot see (a chat
history growing, a server's buffers and caches, other allocations in the process). Each round (each
scheduler step under --parallel, each pass of the cloud verifier) the owner calls `check(state)`,
which samples the resident set (and, under a GPU budget, device memory: through llama.cpp's own query
on any backend it offloads to, else NVML). Above `soft` x budget it climbs the ladder (`LADDER`, the
one place that decides the order), one step at a time, measuring again after each:

1. `saved_state`     shed the prefix cache's KV blobs (the verifier: idle sessions' KV and history)
2. `suffix_history`  shrink the suffix history to a quarter, then drop it
3. `kv_pool`         shrink llama.cpp's KV pools to the tokens they hold (the context re-created
                     smaller, the sequence carried over); they grow back, doubling, as a generation
                     needs, so nothing is refused for it (one sequence per context: not --parallel's
                     shared pool, an MTP head's or a recurrent model's context)
4. `draft_model`     unload the draft model (its weights, KV and buffers go back to the system);
                     auto then drafts model-free (prompt lookup, suffix)
5. `admission`       stop admitting new requests (--parallel: HTTP 429 naming memory; the verifier:
                     no new sessions) until the resident set falls below the soft line again
6. `refuse`          at `hard` x budget, with nothing left to free: MemoryBudgetError

Each step is a `Releaser` the process offers for what it holds (a server without a prefix cache
offers none); each says what it would free now (an estimate it computes from the objects themselves),
and after a step the guard hands freed heap back to the OS (`trim_heap`: glibc keeps freed small
blocks in its arenas otherwise). Halving the draft length, the old first step, is gone: it freed
nothing (llama.cpp sizes its logits and compute buffers at load, for the plan's k; the per-round
copies are a few rows, freed each round).

It also records the peak resident set, the plan's prediction and what it gave up in the stats.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from edgespec.errors import EdgespecError
from edgespec.machine.memory import current_rss, format_bytes, peak_rss

if TYPE_CHECKING:
    from edgespec.state import SpeculativeState
    from edgespec.policy import Choice


MAX_EVENTS = 64


class MemoryBudgetError(EdgespecError):
    """The budget would be crossed and there is nothing left to give up."""


class DeviceMemoryWatcher:
    """This process's memory on llama.cpp's offload devices (Vulkan, CUDA, Metal, ROCm), through llama.cpp's
    own query (ggml_backend_dev_memory), so a --gpu-budget holds on any backend, NVML or not: the drop in
    each device's free memory since `baseline`, its free bytes read before the models were loaded.

    A driver without a memory-budget query (Vulkan without VK_EXT_memory_budget, e.g. Mesa's lavapipe)
    reports its heap size as free, unchanging; then `allocated()` (what llama.cpp allocated on the device:
    its model, KV and compute buffers) stands in, and `source` says so."""

    def __init__(self, baseline: dict[str, tuple[int, int]] | None = None,
                 allocated: Callable[[], int] | None = None) -> None:
        self.baseline = device_memory() if baseline is None else dict(baseline)
        # free == total before anything loaded: the driver reports the heap, not what is in use
        self.tracks_usage = any(free < total for free, total in self.baseline.values())
        self.allocated = allocated
        self.source = "llama.cpp" if self.tracks_usage else "llama.cpp buffers"

    @property
    def available(self) -> bool:
        return bool(self.baseline) and (self.tracks_usage or self.allocated is not None)

    def used_bytes(self) -> int | None:
        if not self.available:
            return None
        if not self.tracks_usage:
            return int(self.allocated())
        now = device_memory()
        return sum(max(0, free - now.get(name, (free, 0))[0]) for name, (free, _) in self.baseline.items())

    def close(self) -> None:
        pass


def device_memory() -> dict[str, tuple[int, int]]:
    """(free, total) bytes of each device llama.cpp offloads to ({} without llama.cpp or such a device)."""
    try:
        from edgespec.runtimes import llamacpp

        return {d["name"]: (d["memory_free_bytes"], d["memory_total_bytes"]) for d in llamacpp.offload_devices()}
    except Exception:  # no llama.cpp, or a binding without the device API: nothing to watch this way
        return {}


class GpuMemoryWatcher:
    """This process's GPU memory through NVML (nvidia-ml-py), initialised once; None-valued without one."""

    source = "nvml"

    def __init__(self) -> None:
        self._nvml = None
        self._handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # no nvidia-ml-py, no driver or no GPU: nothing to watch
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def used_bytes(self) -> int | None:
        if not self.available:
            return None
        import os

        pid, total = os.getpid(), 0
        try:
            for handle in self._handles:
                for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == pid and proc.usedGpuMemory:
                        total += int(proc.usedGpuMemory)
        except Exception:
            return None
        return total

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


# --- the ladder: what the guard gives up, in order ----------------------------------------------

@dataclass(frozen=True)
class Step:
    name: str
    does: str          # what it gives up, for plan, doctor and the events


LADDER: tuple[Step, ...] = (
    Step("saved_state", "shed the prefix cache and saved states"),
    Step("suffix_history", "shrink, then drop, the suffix history"),
    Step("kv_pool", "shrink the KV pools to the tokens held (they grow back as generation needs)"),
    Step("draft_model", "unload the draft model (auto drafts model-free: lookup, suffix)"),
    Step("admission", "stop admitting new requests (--parallel: HTTP 429)"),
    Step("refuse", "refuse work (MemoryBudgetError)"),
)
STEP_NAMES = tuple(step.name for step in LADDER)


class Releaser:
    """One step of the ladder for one thing the process holds. `frees()`: bytes it would free now (an
    estimate from the objects themselves; 0 once spent); `release()`: do it, return what was done."""

    step = ""

    def frees(self) -> int:
        raise NotImplementedError

    def release(self) -> str:
        raise NotImplementedError


class PrefixCacheReleaser(Releaser):
    """Shed every KV blob of a `PrefixCache` and keep it off (later requests prefill in full)."""

    step = "saved_state"

    def __init__(self, cache) -> None:
        self.cache = cache

    def frees(self) -> int:
        return self.cache.nbytes if self.cache.max_bytes else 0

    def release(self) -> str:
        n = len(self.cache)
        self.cache.max_bytes = 0
        self.cache.clear()
        return f"shed the prefix cache ({n} entries), now off"


class SuffixHistoryReleaser(Releaser):
    """Shrink the suffix history to a quarter of its tokens, then drop it (suffix drafting then copies
    from the request's own context only). `history` is a callable: the engine may swap its history."""

    step = "suffix_history"

    def __init__(self, history: Callable[[], object]) -> None:
        self.history = history
        self.shrunk = False

    def frees(self) -> int:
        h = self.history()
        if h is None or h.limit <= 1:
            return 0
        return h.tokens.nbytes - (h.tokens.nbytes // 4 if not self.shrunk else 0)

    def release(self) -> str:
        h = self.history()
        if not self.shrunk:
            self.shrunk = True
            h.shrink(max(1, h.limit // 4))
            return f"shrank the suffix history to {h.limit} tokens"
        h.shrink(1)  # holds nothing from now on: add() keeps no output of 1 token
        return "dropped the suffix history"


KV_POOL_HEADROOM = 256  # cells a shrunk pool keeps past the held tokens (llama.cpp's own padding)


class KvPoolReleaser(Releaser):
    """Shrink the KV pool of each llama.cpp runtime `runtimes()` gives (an engine's target and draft) to
    its held tokens plus KV_POOL_HEADROOM (`LlamaCppRuntime.resize_pool`: about 50 ms for Qwen2.5-Coder
    -1.5B; a 32k-token pool gave back 928 MiB). The pools grow back as generation needs, so the step
    may be taken again after they do."""

    step = "kv_pool"

    def __init__(self, runtimes: Callable[[], list]) -> None:
        self.runtimes = runtimes

    def _resizable(self) -> list:
        return [rt for rt in self.runtimes() if rt is not None and getattr(rt, "pool_resizable", False)]

    def frees(self) -> int:
        return sum(max(0, rt.pool_bytes() - rt.pool_bytes(rt.n_past + KV_POOL_HEADROOM)) for rt in self._resizable())

    def release(self) -> str:
        sizes = []
        for rt in self._resizable():
            before = rt.pool_cells
            rt.resize_pool(rt.n_past + KV_POOL_HEADROOM)
            sizes.append(f"{before} -> {rt.pool_cells}")
        return f"shrank the KV pools ({', '.join(sizes)} cells)"


class DraftModelReleaser(Releaser):
    """Unload an engine's draft model (an `Engine`, or a `ParallelEngine`'s slots). `planned`: the plan's
    estimate of its resident bytes; else the runtime's own report (weights + KV + buffers)."""

    step = "draft_model"

    def __init__(self, engine, planned: int | None = None) -> None:
        self.engine = engine
        self.planned = planned

    def frees(self) -> int:
        runtime = getattr(self.engine, "draft_runtime", None)
        if runtime is None:
            return 0
        if self.planned:
            return self.planned
        try:
            return int(runtime.memory().total)
        except Exception:  # noqa: BLE001 - a runtime without a report: still worth unloading
            return 1

    def release(self) -> str:
        release_draft(self.engine)
        return "unloaded the draft model"


class CallbackReleaser(Releaser):
    """A step given as two callables (the verifier's idle sessions, a test's ballast)."""

    def __init__(self, step: str, frees: Callable[[], int], release: Callable[[], str]) -> None:
        if step not in STEP_NAMES:
            raise ValueError(f"unknown step {step!r}; one of {', '.join(STEP_NAMES)}")
        self.step, self._frees, self._release = step, frees, release

    def frees(self) -> int:
        return int(self._frees())

    def release(self) -> str:
        return self._release()


class _OnceReleaser(Releaser):
    """A step given as one callable of unknown size, taken once."""

    def __init__(self, step: str, action: Callable[[], None], what: str) -> None:
        self.step, self.action, self.what = step, action, what

    def frees(self) -> int:
        return 1 if self.action is not None else 0

    def release(self) -> str:
        action, self.action = self.action, None
        action()
        return self.what


def release_draft(engine) -> None:
    """Drop the draft model of an `Engine` (or of every slot of a `ParallelEngine`) and give its memory
    back: new generations build their drafters without it, running ones draft nothing from it (the
    drafter is marked `released`), and the runtime is closed (llama.cpp frees weights, KV, buffers)."""
    runtime = engine.draft_runtime
    for e in getattr(engine, "engines", None) or [engine]:
        drafter = e.drafters.pop("draft", None)
        if drafter is not None:
            drafter.released = True
        e.draft_runtime = None
    engine.draft_runtime = None
    if runtime is not None:
        runtime.close()


def offer_engine_steps(guard: "MemoryGuard", engine, planned_draft_bytes: int | None = None) -> None:
    """Offer a guard what an engine (or a ParallelEngine) can give up: its suffix history, its KV pools,
    its draft model."""
    front = engine.engines[0] if hasattr(engine, "engines") else engine
    guard.offer(SuffixHistoryReleaser(lambda: front.history))
    if getattr(engine.target, "pool_resizable", False):  # llama.cpp, one sequence (not --parallel's pool)
        guard.offer(KvPoolReleaser(lambda: [engine.target, engine.draft_runtime]))
    if engine.draft_runtime is not None:
        guard.offer(DraftModelReleaser(engine, planned_draft_bytes))


def guard_loaded(engine, budget_bytes: int) -> "MemoryGuard":
    """A guard for an engine (or a ParallelEngine) loaded without a plan (ONNX Runtime, MLX and Core ML, which
    the planner does not model): the same ladder, its estimates from the runtimes' own reports. Refuses a
    process already over budget, closing the engine."""
    rss = current_rss()
    if rss >= budget_bytes:
        engine.close()
        raise EdgespecError(f"the models alone hold {format_bytes(rss)}, over the --budget of "
                            f"{format_bytes(budget_bytes)}; raise --budget or use smaller models")
    guard = MemoryGuard(budget_bytes)
    engine.memory_guard = guard
    offer_engine_steps(guard, engine)
    return guard


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim(0)); False where there is none."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _malloc_trim = libc.malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # musl, macOS, Windows: no malloc_trim
            _malloc_trim = False
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True


_malloc_trim = None


DEFAULT_PREFIX_CACHE_BYTES = 256 << 20   # serve's --prefix-cache-mb default
SUFFIX_TOKEN_BYTES = 4                   # int32 ids


def ladder_rows(estimates: dict[str, int | None], notes: dict[str, str] | None = None) -> list[dict]:
    """The ladder as rows for plan and doctor: step, what it does, bytes it frees about (None: unknown;
    a note says what decides it)."""
    notes = notes or {}
    return [{"step": s.name, "does": s.does, "frees_bytes": estimates.get(s.name), "note": notes.get(s.name, "")}
            for s in LADDER]


def ladder_lines(rows: list[dict]) -> list[str]:
    """A short table: step, frees about X MiB."""
    out = ["  under pressure the guard frees, in order:"]
    for r in rows:
        n = r["frees_bytes"]
        size = "-" if n is None else format_bytes(n)
        out.append(f"    {r['step']:15} frees about {size:>10}  {r['does']}" + (f" ({r['note']})" if r["note"] else ""))
    return out


def default_estimates(draft_bytes: int | None = None, prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                      history_tokens: int | None = None, kv_pool_bytes: int | None = None) -> dict[str, int | None]:
    """What each step frees at most, from the settings: serve's prefix cache when full, a full suffix
    history, the KV pools past their headroom when empty (the plan's), the draft's resident bytes (the
    plan's), nothing for admission (it stops growth)."""
    from edgespec.drafters.suffix import DEFAULT_HISTORY_TOKENS

    tokens = DEFAULT_HISTORY_TOKENS if history_tokens is None else history_tokens
    return {"saved_state": prefix_cache_bytes, "suffix_history": tokens * SUFFIX_TOKEN_BYTES,
            "kv_pool": kv_pool_bytes, "draft_model": draft_bytes, "admission": 0, "refuse": None}


# --- the guard ---------------------------------------------------------------------------------------

class MemoryGuard:
    """Frees memory under pressure, cheapest first; see the module docstring.

    budget_bytes: host RAM (or the unified pool) the process must stay under; gpu_budget_bytes: VRAM.
    max_draft: the plan's draft length (the cap the engine's choices keep; None = no cap of its own).
    releasers: what the process offers to free (`offer` adds more later: a server's prefix cache).
    release_draft: shorthand for a draft_model step given as a callable (older callers).
    device_baseline: (free, total) bytes per llama.cpp device before the models loaded (`device_memory()`);
    with it (or any llama.cpp offload device) device memory is read through llama.cpp, else through NVML.
    device_allocated: what the models allocated on the device, for drivers that report no usage.
    """

    def __init__(self, budget_bytes: int, *, gpu_budget_bytes: int | None = None, max_draft: int | None = None,
                 predicted_peak_bytes: int | None = None, release_draft: Callable[[], None] | None = None,
                 releasers: list[Releaser] = (), soft: float = 0.97, hard: float = 0.995,
                 watch_gpu: bool | None = None, device_baseline: dict[str, tuple[int, int]] | None = None,
                 device_allocated: Callable[[], int] | None = None, rss: Callable[[], int] = current_rss):
        if not 0 < soft <= hard <= 1:
            raise ValueError("need 0 < soft <= hard <= 1")
        self.budget_bytes = int(budget_bytes)
        self.gpu_budget_bytes = gpu_budget_bytes
        self.cap = max_draft
        self.predicted_peak_bytes = predicted_peak_bytes
        self.soft, self.hard = soft, hard
        self.events: list[str] = []
        self.released: list[dict] = []     # each step taken: step, estimate, resident before/after
        self.peak_rss_bytes = 0
        self.peak_gpu_bytes: int | None = None
        self.admitting = True
        self._rss = rss
        self._lock = threading.RLock()     # the server's threads and the engine's may both check
        self.releasers: list[Releaser] = []
        for r in releasers:
            self.offer(r)
        if release_draft is not None:
            self.offer(_OnceReleaser("draft_model", release_draft, "unloaded the draft model"))
        want_gpu = gpu_budget_bytes is not None if watch_gpu is None else watch_gpu
        self._gpu = _device_watcher(device_baseline, device_allocated) if want_gpu else None

    def offer(self, releaser: Releaser) -> None:
        """Add a step (kept in the ladder's order)."""
        if releaser.step not in STEP_NAMES:
            raise ValueError(f"unknown step {releaser.step!r}")
        with self._lock:
            self.releasers.append(releaser)
            self.releasers.sort(key=lambda r: STEP_NAMES.index(r.step))

    def estimates(self) -> dict[str, int]:
        """Bytes each step would free now, by step name."""
        out: dict[str, int] = {}
        for r in self.releasers:
            out[r.step] = out.get(r.step, 0) + r.frees()
        return out

    @property
    def device_memory_source(self) -> str | None:
        """Where device memory is read: "llama.cpp" (ggml_backend_dev_memory), "llama.cpp buffers" (its
        allocations, where the driver reports no usage), "nvml", or None (not watched)."""
        return self._gpu.source if self._gpu is not None and self._gpu.available else None

    # -- what the engine, the scheduler and the verifier call ----------------------------------------

    def check(self, state: "SpeculativeState | None" = None) -> int | None:
        """Sample memory, free what the ladder gives under pressure, record the peak; return the cap on k
        (None: no cap). Raises MemoryBudgetError at the hard line with nothing left to free."""
        with self._lock:
            pressure, rss, gpu = self._sample()
            if pressure >= self.soft:
                self._relieve(pressure, rss, gpu)
            elif not self.admitting and pressure < self.soft * 0.98:  # room again: take requests
                self.admitting = True
                self._event(f"memory back under the soft line ({self._where(rss, gpu)}): admitting again")
            self.observe(state)
            return self.cap

    def pressure(self) -> float:
        return self._sample()[0]

    def still_admitting(self) -> bool:
        """Whether new requests may come in, sampling again when they may not (from any thread: it frees
        nothing, so it never touches what another thread is running)."""
        with self._lock:
            if not self.admitting:
                pressure, rss, gpu = self._sample()
                if pressure < self.soft * 0.98:
                    self.admitting = True
                    self._event(f"memory back under the soft line ({self._where(rss, gpu)}): admitting again")
            return self.admitting

    def _sample(self) -> tuple[float, int, int | None]:
        rss = self._rss()
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        gpu = self._gpu.used_bytes() if self._gpu is not None else None
        if gpu is not None:
            self.peak_gpu_bytes = max(self.peak_gpu_bytes or 0, gpu)
        pressure = rss / self.budget_bytes
        if gpu is not None and self.gpu_budget_bytes:
            pressure = max(pressure, gpu / self.gpu_budget_bytes)
        return pressure, rss, gpu

    def observe(self, state: "SpeculativeState | None") -> None:
        """Write the peak and the prediction into the generation's stats."""
        if state is None:
            return
        stats = state.stats
        stats.peak_rss_bytes = max(self.peak_rss_bytes, peak_rss())
        stats.predicted_peak_bytes = self.predicted_peak_bytes
        if self.peak_gpu_bytes is not None:
            stats.peak_gpu_bytes = self.peak_gpu_bytes
        stats.memory_events = list(self.events)

    # -- climbing the ladder ------------------------------------------------------------------------

    def _event(self, text: str) -> None:
        self.events.append(text)
        del self.events[:-MAX_EVENTS]  # a long-running server under pressure keeps the latest

    def _where(self, rss: int, gpu: int | None) -> str:
        where = f"resident {format_bytes(rss)} of a {format_bytes(self.budget_bytes)} budget"
        if gpu is not None and self.gpu_budget_bytes:
            where += f", GPU {format_bytes(gpu)} of {format_bytes(self.gpu_budget_bytes)}"
        return where

    def _relieve(self, pressure: float, rss: int, gpu: int | None) -> None:
        """Release steps in order, measuring after each, until under the soft line or out of steps."""
        for releaser in self.releasers:
            if pressure < self.soft:
                return
            estimate = releaser.frees()
            if estimate <= 0:
                continue
            what = releaser.release()
            trim_heap()
            before = rss
            pressure, rss, gpu = self._sample()
            self.released.append({"step": releaser.step, "estimate_bytes": estimate, "rss_before": before,
                                  "rss_after": rss})
            self._event(f"memory pressure ({self._where(before, gpu)}): {what} (frees about "
                               f"{format_bytes(estimate)}; resident now {format_bytes(rss)})")
        if pressure < self.soft:
            return
        if self.admitting:
            self.admitting = False
            self._event(f"memory pressure ({self._where(rss, gpu)}): stopped admitting new requests")
        if pressure >= self.hard:
            self._event(f"memory budget reached ({self._where(rss, gpu)}): stopped")
            raise MemoryBudgetError(
                f"the memory budget of {format_bytes(self.budget_bytes)} is about to be exceeded "
                f"({self._where(rss, gpu)}) and there is nothing left to free (no prefix cache, suffix history, "
                "KV pool headroom or draft left to give up); raise --budget, shorten the context (--ctx) or "
                "the conversation")

    def refusal(self) -> str:
        """Why new work is refused now (for a 429's JSON reason)."""
        return (f"memory pressure: the process holds {format_bytes(self._rss())} of its "
                f"{format_bytes(self.budget_bytes)} --budget and has freed what it could "
                f"({', '.join(dict.fromkeys(r['step'] for r in self.released)) or 'nothing to free'}); "
                "not admitting new requests until running ones finish; retry shortly")

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()


def _device_watcher(baseline: dict[str, tuple[int, int]] | None,
                    allocated: Callable[[], int] | None) -> "DeviceMemoryWatcher | GpuMemoryWatcher":
    llama = DeviceMemoryWatcher(baseline, allocated)
    return llama if llama.available else GpuMemoryWatcher()


def cap_choice(choice: "Choice", cap: int | None) -> "Choice":
    """A policy's choice limited to `cap` drafted tokens (0: no draft; None: unchanged)."""
    if cap is None:
        return choice
    if cap <= 0:
        from edgespec.policy import Choice

        return Choice(None, 0)
    if choice.branch is not None and choice.k >= cap:  # a tree's siblings would pass the cap
        choice = replace(choice, branch=None)
    if choice.k > cap:
        draft = choice.draft
        if draft is not None and len(draft) > cap:
            draft = replace(draft, tokens=draft.tokens[:cap],
                            probs=None if draft.probs is None else draft.probs[:cap],
                            parents=None if draft.parents is None else draft.parents[:cap])
        choice = replace(choice, k=cap, draft=draft)
    return choice
