"""Parallel slots: several requests decoded together, one batched target pass per step.

N slots share one llama.cpp context: one KV sequence each in a unified pool
(`LlamaCppMultiSeqRuntime`, the runtime the cloud verifier batches its sessions with); on MLX
(`MlxMultiSeqRuntime`) they share the weights and the "one pass" is a pass per slot in turn. Each slot has
its own `Engine` over its sequence (`LlamaCppSequence`), so a request keeps its own policy, drafters,
draft length, sampler and acceptance rule. One step, for the requests active now:

    choice, draft = engine.propose(state, policy)                    # each request: its drafter and k
    rows = target.decode_batch([(seq, engine.verify_feed(state, draft), len(draft) + 1), ...])  # ONE pass
    engine.commit(state, policy, choice, engine.verify_accept(state, draft, rows))   # each request

Continuous batching: requests join a free slot and leave between steps, never waiting for a batch to
end. A joining request's prompt goes into the same passes in chunks (rows without logits), so its
prefill never stalls the others for more than a chunk. Prefix reuse per slot: the KV of a finished
request stays in its sequence, a new request takes the free slot that shares the longest prefix with
its prompt, and the prefix cache (when given) restores a saved blob into that slot.

Output: each sequence attends only to its own cells, so a request's tokens are what it would emit
alone, up to the near-ties batched arithmetic flips (the same as the one-request engine; flash
attention is off in the shared pool so cell order cannot change results). Sampling draws from each
request's own seeded generator.

Memory: the target's weights once; a KV pool of n_ctx cells (each slot at most n_ctx / N of them);
logits rows of one pass (the sum of k + 1 over the active requests); with a draft model, its weights
once and its own pool of the same shape. Python state per slot is O(prompt + max_tokens) token ids.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgespec.serve.aio import AsyncGeneration, QueueFullError, RequestTimeoutError, Submitter
from edgespec.detokenize import Detokenizer
from edgespec.engine import Engine, GenerationConfig, SpeculativeState
from edgespec.errors import EdgespecError
from edgespec.runtimes.base import common_prefix_length, sync_to

MAX_SLOTS = 256         # llama.cpp's limit on sequences in one context
MIN_SLOT_CTX = 128      # tokens a slot needs at least (a prompt, a reply, the cost profile's probe)
PREFILL_CHUNK = 256     # prompt tokens a joining request adds to one pass


class SlotsError(EdgespecError):
    """Parallel slots that cannot be set up as asked."""


class MemoryPressureError(QueueFullError):
    """Under --budget the memory guard stopped admitting requests (HTTP 429, code memory_pressure)."""

    code = "memory_pressure"


class StepFailedError(EdgespecError):
    """llama.cpp failed a batched pass (out of compute memory or KV cells): the requests in it end,
    the slots are freed, the server keeps serving (HTTP 503: retry)."""


def slot_context(n_ctx: int, n_slots: int) -> int:
    """Tokens each slot may hold: its share of the pool (llama-server's rule: --ctx / --parallel)."""
    if not 1 <= n_slots <= MAX_SLOTS:
        raise SlotsError(f"--parallel must be between 1 and {MAX_SLOTS} (llama.cpp's limit of sequences in one "
                         f"context), got {n_slots}")
    if n_ctx <= 0:
        raise SlotsError("--parallel needs an explicit --ctx: the KV pool the slots share (each gets --ctx / "
                         "--parallel tokens)")
    per_slot = n_ctx // n_slots
    if per_slot < MIN_SLOT_CTX:
        raise SlotsError(f"--parallel {n_slots} leaves {per_slot} tokens of context per slot (--ctx {n_ctx} / "
                         f"{n_slots}); each slot needs at least {MIN_SLOT_CTX}: use fewer slots or a larger --ctx "
                         f"(at least {MIN_SLOT_CTX * n_slots})")
    return per_slot


class ParallelEngine:
    """A target (and optional draft) holding one sequence per slot, and one `Engine` per slot over it.

    The slot engines share the runtimes' weights and pools; `front` (slot 0's engine) serves
    tokenizing and the model's facts. Drive it through `SlotScheduler`; not thread-safe itself.
    """

    def __init__(self, target, draft=None, *, slot_ctx: int):
        self.target = target
        self.draft_runtime = draft
        self.n_slots = target.n_seq
        self.slot_ctx = slot_ctx
        self.memory_guard = None  # under --budget: one MemoryGuard for the process (edgespec.machine.guard)
        if slot_ctx * self.n_slots > target.n_ctx:  # then a full slot could not overflow the pool
            raise SlotsError(f"{self.n_slots} slots of {slot_ctx} tokens do not fit a pool of {target.n_ctx} cells")
        from edgespec.drafters.suffix import SuffixHistory

        history = SuffixHistory()  # one for all slots: a request may copy from any earlier one's output
        self.engines = [Engine(target.sequence(i, slot_ctx), draft.sequence(i, slot_ctx) if draft else None,
                               history=history) for i in range(self.n_slots)]

    def use_history(self, history) -> None:
        """Every slot drafts (suffix) from, and adds to, this `SuffixHistory`."""
        for engine in self.engines:
            engine.use_history(history)

    @property
    def front(self) -> Engine:
        return self.engines[0]

    @classmethod
    def load(cls, target: str | None, draft: str | None = None, *, parallel: int, n_ctx: int = 4096,
             n_threads: int | None = None, n_gpu_layers: int | None = None, type_k: str = "f16",
             type_v: str = "f16", offload_kqv: bool = True, verbose: bool = False,
             runtime: str = "llamacpp") -> "ParallelEngine":
        """Load models by name (edgespec.loader) with `parallel` slots sharing a pool of `n_ctx` KV cells
        (llama.cpp, or MLX: see `edgespec.runtimes.mlx.MlxMultiSeqRuntime`)."""
        from edgespec.loader import LoadOptions, load_slots

        per_slot = slot_context(n_ctx, parallel)
        options = LoadOptions(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, type_k=type_k,
                              type_v=type_v, offload_kqv=offload_kqv, verbose=verbose, runtime=runtime)
        target_rt, draft_rt = load_slots(target, draft, options, n_seq=parallel)
        try:
            return cls(target_rt, draft_rt, slot_ctx=per_slot)
        except BaseException:
            target_rt.close()
            raise

    def close(self) -> None:
        self.target.close()
        if self.draft_runtime is not None:
            self.draft_runtime.close()

    def __enter__(self) -> "ParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Slot:
    """One sequence and the request it serves (None while free)."""

    index: int
    engine: Engine
    gen: AsyncGeneration | None = None
    state: SpeculativeState | None = None
    policy: object = None
    output: Detokenizer | None = None
    fed: int = 0                  # prompt tokens whose KV is held (prefill progress)
    prefilling: bool = False
    t_decode: float = 0.0
    rows: int = 0                 # rows this slot put into the last pass

    def runtimes(self) -> dict:
        out = {"target": self.engine.target}
        if self.engine.draft_runtime is not None:
            out["draft"] = self.engine.draft_runtime
        return out


class SlotScheduler(Submitter):
    """A `ParallelEngine` behind one worker thread, for asyncio callers; `AsyncEngine`'s interface.

    Up to n_slots requests run at once, batched step by step; `max_queue` more wait for a free slot
    (FIFO), and past that `submit` raises `QueueFullError` at once. `counters` says what happened,
    including `steps` (target passes) and `batched_steps` (passes that served more than one request).
    """

    thread_safe = True

    def __init__(self, engine: ParallelEngine, *, max_queue: int = 8, prefix_cache=None, reuse_prefix: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK):
        if max_queue < 0:
            raise EdgespecError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.reuse_prefix = reuse_prefix
        self.prefill_chunk = max(1, prefill_chunk)
        self.slots = [_Slot(i, e) for i, e in enumerate(engine.engines)]
        self.counters = {"completed": 0, "cancelled": 0, "timed_out": 0, "failed": 0, "rejected": 0,
                         "steps": 0, "batched_steps": 0, "rows": 0, "max_active": 0, "prefill_chunks": 0,
                         "mixed_steps": 0}
        self._profile = engine.front._profile
        self._last_rows = 0
        if engine.memory_guard is not None and hasattr(engine.target, "seq_release"):
            # On MLX each slot's caches are memory of its own: an idle slot's kept prefix can be given back
            # (llama.cpp's pool is allocated once, so clearing its cells frees nothing).
            from edgespec.machine.guard import CallbackReleaser

            engine.memory_guard.offer(CallbackReleaser("saved_state", self._idle_kv_bytes, self._release_idle_kv))
        self._start_worker("edgespec-slots")

    # -- any thread -------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def active(self) -> int:
        return sum(s.gen is not None for s in self.slots)

    @property
    def running(self) -> list[AsyncGeneration] | None:
        """The requests in a slot now (None when every slot is free), as `AsyncEngine.running`."""
        gens = [s.gen for s in self.slots if s.gen is not None]
        return gens or None

    @property
    def waiting(self) -> int:
        return max(0, self._inflight - self.active)

    def submit(self, prompt_ids: Sequence[int], config: GenerationConfig, *,
               timeout: float | None = None) -> AsyncGeneration:
        """Queue a generation; raises `QueueFullError` at once when every slot is busy and the queue full."""
        import asyncio

        if self._closed:
            raise EdgespecError("the engine is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        gen = AsyncGeneration(next(self._ids), list(prompt_ids), config, deadline, asyncio.get_running_loop())
        guard = self.engine.memory_guard
        if guard is not None and not guard.still_admitting():
            self.counters["rejected"] += 1
            raise MemoryPressureError(guard.refusal())
        with self._count_lock:
            if self._inflight >= self.n_slots + self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFullError(f"the server is busy: all {self.n_slots} slots are generating and "
                                     f"{self._inflight - self.n_slots} requests wait (limit {self.max_queue}); "
                                     "try again shortly")
            self._inflight += 1
        self._jobs.put(gen)
        return gen

    def close(self) -> None:
        """Cancel what runs, drop what waits, stop the worker."""
        self._closed = True
        for slot in self.slots:
            if slot.gen is not None:
                slot.gen.cancel()
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _idle_runtimes(self):
        """(runtime, sequence) of every free slot, target and draft."""
        owners = [rt for rt in (self.engine.target, self.engine.draft_runtime) if rt is not None]
        return [(rt, s.index) for s in self.slots if s.gen is None for rt in owners]

    def _idle_kv_bytes(self) -> int:
        return sum(rt.seq_kv_bytes(i) for rt, i in self._idle_runtimes())

    def _release_idle_kv(self) -> str:
        """The memory guard's step, on the worker thread (between steps) or while nothing runs."""
        freed = sum(rt.seq_release(i) for rt, i in self._idle_runtimes())
        return f"dropped the KV kept by idle slots ({freed / 2**20:.1f} MiB)"

    # -- the worker thread ----------------------------------------------------------------------------

    def _work(self) -> None:
        stopping = False
        while True:
            stopping = self._admit(stopping)
            if stopping and not self.active:
                self._drain()
                return
            if self.active:
                try:
                    self._guard_memory()
                    self._step()
                except Exception as exc:  # noqa: BLE001 - never let the worker die: fail the slots, keep serving
                    for slot in self.slots:
                        if slot.gen is not None:
                            self._fail(slot, exc)

    def _guard_memory(self) -> None:
        """Between steps: the process's memory guard frees what it can under pressure (a MemoryBudgetError
        fails the running requests: the worker's handler)."""
        guard = self.engine.memory_guard
        if guard is not None:
            guard.check()

    def _admitting(self) -> bool:
        guard = self.engine.memory_guard
        return guard is None or guard.admitting or not self.active  # an idle server always takes one

    def _admit(self, stopping: bool) -> bool:
        """Move queued requests into free slots; wait for one only when nothing runs. Returns stopping."""
        while not stopping and any(s.gen is None for s in self.slots) and self._admitting():
            try:
                gen = self._jobs.get(block=not self.active)
            except queue.Empty:
                break
            if gen is None:
                return True
            self._join(gen)
        if stopping:
            for slot in self.slots:
                if slot.gen is not None:
                    slot.gen.cancel()
        return stopping

    def _drain(self) -> None:
        while True:
            try:
                gen = self._jobs.get_nowait()
            except queue.Empty:
                return
            if gen is not None:
                self.counters["cancelled"] += 1
                self._release_count()
                gen._put_end()

    def _release_count(self) -> None:
        with self._count_lock:
            self._inflight -= 1

    def _pick_slot(self, prompt_ids: np.ndarray) -> _Slot:
        """The free slot whose sequence shares the longest prefix with the prompt; the emptiest on ties."""
        free = [s for s in self.slots if s.gen is None]
        return max(free, key=lambda s: (common_prefix_length(s.engine.target.tokens, prompt_ids[:-1]),
                                        -s.engine.target.n_past))

    def _join(self, gen: AsyncGeneration) -> None:
        gen.info["queue_s"] = round(time.monotonic() - gen.enqueued, 6)
        if self._closed or gen.cancel_event.is_set():
            self.counters["cancelled"] += 1
            self._release_count()
            gen._put_end()
            return
        if gen.deadline is not None and time.monotonic() > gen.deadline:
            self.counters["timed_out"] += 1
            self._release_count()
            gen._put(RequestTimeoutError("the request waited in the queue past its time limit"))
            return
        prompt = np.asarray(gen.prompt_ids, dtype=np.int32)
        slot = self._pick_slot(prompt)
        engine = slot.engine
        try:
            if gen.config.mode == "auto" and engine._profile is None:
                # one measurement for every slot, on this free slot's sequence (it drops that KV)
                self._profile = self._profile or engine.cost_profile()
                for e in self.engine.engines:
                    e._profile = self._profile
            engine.check_fits(len(prompt), gen.config)
            if not self.reuse_prefix:
                for rt in slot.runtimes().values():
                    rt.truncate(0)
            elif self.prefix_cache is not None:
                gen.info["prefix_cache"] = self.prefix_cache.restore(slot.runtimes(), gen.prompt_ids)
            mode, policy = engine.policy_for(gen.config, prompt)
            state = engine.new_state(prompt, gen.config, mode)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller; the worker keeps serving
            self.counters["failed"] += 1
            self._release_count()
            gen._put(exc)
            return
        kept = sync_to(engine.target, state.committed[:-1])
        state.stats.cached_tokens, state.stats.prefilled_tokens = kept, state.n_prompt - 1 - kept
        slot.gen, slot.state, slot.policy = gen, state, policy
        slot.output = Detokenizer(engine.target, gen.config.stop, state)
        slot.fed, slot.prefilling, slot.rows = kept, True, 0
        self.counters["max_active"] = max(self.counters["max_active"], self.active)
        if kept == state.n_prompt - 1:
            self._prefilled(slot)

    def _prefilled(self, slot: _Slot) -> None:
        state = slot.state
        for drafter in slot.policy.prefilled:  # the others catch up when first used
            drafter.prepare(state.committed)
        slot.prefilling = False
        slot.t_decode = time.perf_counter()
        state.stats.prefill_s = slot.t_decode - state.t_start

    def _interrupted(self, gen: AsyncGeneration) -> str | None:
        if gen.cancel_event.is_set():
            return "cancelled"
        if gen.deadline is not None and time.monotonic() > gen.deadline:
            return "timeout"
        return None

    def _step(self) -> None:
        """One target pass over every active request's rows, then each request's acceptance."""
        work, plans = [], []
        # Rows the other requests put into the same pass, which auto weighs; passes that take turns
        # (MLX) share nothing, so each request pays for its own pass alone.
        others = self._last_rows if self.engine.target.batched else 0
        for slot in self.slots:
            if slot.gen is None:
                continue
            why = self._interrupted(slot.gen)
            if why is not None:
                self._finish(slot, why)
                continue
            if slot.prefilling:
                end = min(slot.fed + self.prefill_chunk, slot.state.n_prompt - 1)
                work.append((slot.index, slot.state.committed[slot.fed:end], 0))
                plans.append((slot, None, end))
                continue
            slot.policy.rows_besides = max(0, others - slot.rows)  # auto weighs the rows the others add to the pass
            choice, draft = slot.engine.propose(slot.state, slot.policy)
            work.append((slot.index, slot.engine.verify_feed(slot.state, draft), len(draft) + 1))
            plans.append((slot, (choice, draft), None))
        if not work:
            return
        t = time.perf_counter()
        try:
            outs = self.engine.target.decode_batch(work)
        except EdgespecError as exc:  # compute failed: every sequence was rolled back
            for slot, _, _ in plans:
                self._fail(slot, StepFailedError(f"the model could not evaluate this step ({exc}); retry"))
            return
        pass_s = time.perf_counter() - t
        self.counters["steps"] += 1
        self.counters["batched_steps"] += len(work) > 1
        self._last_rows = sum(len(w[1]) for w in work if w[2])  # verify rows (prefill chunks are one-off)
        chunks = sum(1 for w in work if not w[2])
        self.counters["prefill_chunks"] += chunks
        self.counters["mixed_steps"] += 0 < chunks < len(work)  # a prefill chunk rode along other requests' rows
        self.counters["rows"] += sum(len(w[1]) for w in work)
        for (slot, round_, end), (_, fed, _), logits in zip(plans, work, outs):
            try:
                if round_ is None:
                    slot.fed, slot.rows = end, 0
                    if end == slot.state.n_prompt - 1:
                        self._prefilled(slot)
                    continue
                choice, draft = round_
                slot.rows = len(fed)
                slot.state.stats.verify_s += pass_s
                verification = slot.engine.verify_accept(slot.state, draft, logits)
                new = slot.engine.commit(slot.state, slot.policy, choice, verification)
                self._emit(slot, new)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                self._fail(slot, exc)

    def _emit(self, slot: _Slot, new: np.ndarray) -> None:
        if len(new):
            piece = slot.output.feed(new)
            if piece:
                slot.gen._put(piece)
        if slot.output.stopped or slot.state.finish_reason is not None:
            self._finish(slot, None)

    def _finish(self, slot: _Slot, interrupted: str | None) -> None:
        state, gen = slot.state, slot.gen
        tail = slot.output.finish(interrupted)
        if tail:
            gen._put(tail)
        state.stats.decode_s = time.perf_counter() - slot.t_decode if not slot.prefilling else 0.0
        gen.result = slot.output.result()
        finish = gen.result.finish_reason
        if not slot.prefilling:
            slot.engine.remember(state, slot.policy)  # its text and auto's acceptance, for later requests
            for other in self.slots:  # every slot's next request starts from what auto learned here
                other.engine.acceptance = slot.engine.acceptance
        if self.prefix_cache is not None and finish != "cancelled" and not slot.prefilling:
            self.prefix_cache.store(slot.runtimes())
        self.counters[{"cancelled": "cancelled", "timeout": "timed_out"}.get(finish, "completed")] += 1
        self._free(slot)
        gen._put_end()

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        gen = slot.gen
        self.counters["failed"] += 1
        # the slot's KV may be out of step with what it committed: start its next request afresh
        for rt in slot.runtimes().values():
            try:
                rt.truncate(0)
            except Exception:  # noqa: BLE001 - best effort; the next request syncs anyway
                pass
        self._free(slot)
        gen._put(exc)

    def _free(self, slot: _Slot) -> None:
        slot.gen = slot.state = slot.policy = slot.output = None
        slot.prefilling, slot.rows = False, 0
        self._release_count()

    def stats(self) -> dict:
        return {"slots": self.n_slots, "active": self.active, "slot_ctx": self.engine.slot_ctx,
                "kv_cells_used": self.engine.target.cells_used, "kv_cells": self.engine.target.n_ctx,
                **{k: self.counters[k] for k in ("steps", "batched_steps", "rows", "max_active", "prefill_chunks",
                                                 "mixed_steps")}}
