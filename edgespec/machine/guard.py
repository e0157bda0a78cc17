"""The run-time memory guard: watches the real resident set between rounds and backs off before the
budget is reached.

The plan makes a setup fit before anything loads; the guard covers what a plan cannot see (a chat
history growing, a server's buffers, other allocations in the process). Each round the engine calls
`check(state)`, which samples the process's resident set (and, under a GPU budget, its device memory:
through llama.cpp's own query on any backend it offloads to, else NVML) and returns a cap on the
draft length:

1. under pressure (resident set above `soft` x budget) it halves the draft length, round by round;
2. at a draft length of 1 it drops the draft: the draft model's runtime is closed, which returns its
   weights, KV and buffers to the system, and the cap stays 0 (plain decoding) from then on;
3. with nothing left to give up, at `hard` x budget it stops the generation with a clear error,
   before the budget is crossed and long before the kernel's OOM killer would act.

It also records the peak resident set and the plan's prediction in the generation's stats.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from edgespec.errors import EdgespecError
from edgespec.machine.memory import current_rss, format_bytes, peak_rss

if TYPE_CHECKING:
    from edgespec.state import SpeculativeState
    from edgespec.policy import Choice


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


class MemoryGuard:
    """Caps the draft length under memory pressure; see the module docstring.

    budget_bytes: host RAM (or the unified pool) the process must stay under; gpu_budget_bytes: VRAM.
    max_draft: the plan's draft length (the cap never exceeds it; None = no cap of its own).
    release_draft: called once when the draft is dropped (closes its runtime).
    device_baseline: (free, total) bytes per llama.cpp device before the models loaded (`device_memory()`);
    with it (or any llama.cpp offload device) device memory is read through llama.cpp, else through NVML.
    device_allocated: what the models allocated on the device, for drivers that report no usage.
    """

    def __init__(self, budget_bytes: int, *, gpu_budget_bytes: int | None = None, max_draft: int | None = None,
                 predicted_peak_bytes: int | None = None, release_draft: Callable[[], None] | None = None,
                 soft: float = 0.97, hard: float = 0.995, watch_gpu: bool | None = None,
                 device_baseline: dict[str, tuple[int, int]] | None = None,
                 device_allocated: Callable[[], int] | None = None):
        if not 0 < soft <= hard <= 1:
            raise ValueError("need 0 < soft <= hard <= 1")
        self.budget_bytes = int(budget_bytes)
        self.gpu_budget_bytes = gpu_budget_bytes
        self.cap = max_draft
        self.predicted_peak_bytes = predicted_peak_bytes
        self.release_draft = release_draft
        self.soft, self.hard = soft, hard
        self.events: list[str] = []
        self.peak_rss_bytes = 0
        self.peak_gpu_bytes: int | None = None
        want_gpu = gpu_budget_bytes is not None if watch_gpu is None else watch_gpu
        self._gpu = _device_watcher(device_baseline, device_allocated) if want_gpu else None

    @property
    def device_memory_source(self) -> str | None:
        """Where device memory is read: "llama.cpp" (ggml_backend_dev_memory), "llama.cpp buffers" (its
        allocations, where the driver reports no usage), "nvml", or None (not watched)."""
        return self._gpu.source if self._gpu is not None and self._gpu.available else None

    # -- what the engine calls ------------------------------------------------------------------

    def check(self, state: "SpeculativeState | None" = None) -> int | None:
        """Sample memory, act on pressure, record the peak; return the cap on k (None: no cap)."""
        rss = current_rss()
        self.peak_rss_bytes = max(self.peak_rss_bytes, peak_rss(), rss)
        gpu = self._gpu.used_bytes() if self._gpu is not None else None
        if gpu is not None:
            self.peak_gpu_bytes = max(self.peak_gpu_bytes or 0, gpu)
        pressure = rss / self.budget_bytes
        if gpu is not None and self.gpu_budget_bytes:
            pressure = max(pressure, gpu / self.gpu_budget_bytes)
        if pressure >= self.soft:
            self._relieve(pressure, rss, gpu)
        self.observe(state)
        return self.cap

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

    # -- backing off ------------------------------------------------------------------------------

    def _relieve(self, pressure: float, rss: int, gpu: int | None) -> None:
        where = f"resident {format_bytes(rss)} of a {format_bytes(self.budget_bytes)} budget"
        if gpu is not None and self.gpu_budget_bytes:
            where += f", GPU {format_bytes(gpu)} of {format_bytes(self.gpu_budget_bytes)}"
        if self.cap is None or self.cap > 1:
            self.cap = max(1, (self.cap or 2) // 2)
            self.events.append(f"memory pressure ({where}): draft length capped at {self.cap}")
        elif self.cap == 1:
            self.cap = 0
            if self.release_draft is not None:
                self.release_draft()
                self.release_draft = None
                self.events.append(f"memory pressure ({where}): dropped the draft model")
            else:
                self.events.append(f"memory pressure ({where}): drafting stopped")
        elif pressure >= self.hard:
            self.events.append(f"memory budget reached ({where}): stopped")
            raise MemoryBudgetError(
                f"the memory budget of {format_bytes(self.budget_bytes)} is about to be exceeded ({where}) "
                "and there is no draft left to give up; raise --budget, shorten the context (--ctx) or "
                "the conversation")

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
