"""The memory planner: choose the settings of a target + draft setup that fit a memory budget.

`plan(target, draft, budget=...)` searches the settings in order of what they cost to give up and
returns the first that fits, with its predicted peak and a breakdown (see `edgespec.machine.memory`):

1. the context asked for (without --ctx: 4096, then 2048, 1024, 512);
2. the draft on (only once nothing with the draft fits: the draft off, and the same steps again);
3. KV cache types f16, then q8_0, then K q8_0 with V q4_0 (flash attention on for a quantized V cache;
   a q4_0 K cache only when asked for with `kv_ladder=KV_LADDER_ALL`: it broke Qwen2.5-Coder-1.5B);
4. on a GPU: every layer and its KV on the GPU, then the target's KV in host memory while the draft's
   stays on the GPU, then fewer target layers;
5. the longest draft length first (k = 4 down to 1);
6. weights mapped (mmap), else read into memory (what repacked weights hold counts once instead of
   twice; free at run time), then smaller ubatches (512, 256, 128 tokens: a smaller compute buffer,
   slower prefill only).

With N parallel slots (`serve --parallel N`) the context is the KV pool the slots share (each slot
--ctx / N tokens, so the ladder is N x the one above), a target pass returns up to N x (k + 1)
logits rows, and flash attention stays off (the slots' cells interleave in one pool), so only
float V caches are tried.

A setup fits when its predicted peak plus a safety margin (2 %, at least 8 MiB) stays within the
budget, and on a discrete GPU the VRAM within --gpu-budget. When nothing fits the plan says so and
names the smallest budget that would.

`apply_budget(...)` plans, loads exactly the planned settings and returns an Engine whose memory
guard watches the real peak at run time (see `edgespec.machine.guard`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from edgespec.errors import EdgespecError
from edgespec.machine.guard import (DEFAULT_PREFIX_CACHE_BYTES, KV_POOL_HEADROOM, default_estimates, ladder_lines,
                                    ladder_rows, offer_engine_steps, release_draft)  # release_draft: its old home
from edgespec.machine.memory import (MiB, Calibration, Hardware, ModelFacts, ModelSettings, Prediction, Setup,
                             calibrate, format_bytes, model_facts, padded_ctx, predict, repacked)
from edgespec.runtimes.base import FLOAT_KV, flash_attention

CTX_LADDER = (4096, 2048, 1024, 512)
# (K, V) cache types, best first. K stops at q8_0: a q4_0 K cache turned Qwen2.5-Coder-1.5B's greedy output
# into garbage on this build (0 of 24 tokens equal to f16's) while q4_0 V kept all 24 (bench/MEMORY_RESULTS.md).
KV_LADDER = (("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"))
KV_LADDER_ALL = KV_LADDER + (("q4_0", "q4_0"),)  # for models known to tolerate a q4_0 K cache
BATCH_LADDER = (512, 256, 128)
DEFAULT_MAX_DRAFT = 4
MARGIN = 0.02
MARGIN_MIN = 8 * MiB


@dataclass(frozen=True)
class PlanSettings:
    """What a plan chooses. `max_draft` is k, the most tokens drafted per round (by the draft model, or
    by prompt lookup when the draft is off); the target's context holds k + 1 logits rows."""

    n_ctx: int
    type_k: str = "f16"
    type_v: str = "f16"
    n_batch: int = 512
    use_mmap: bool = True
    target_gpu_layers: int = 0
    target_offload_kqv: bool = True
    draft: bool = False
    draft_gpu_layers: int = 0
    draft_offload_kqv: bool = True
    max_draft: int = 0
    parallel: int = 1       # slots sharing the KV pool of n_ctx cells (serve --parallel)

    @property
    def flash_attn(self) -> bool | None:
        """On where a quantized V cache needs it; else llama.cpp decides; off for parallel slots."""
        if self.parallel > 1:
            return False
        return flash_attention(None, self.type_v)

    def target_settings(self) -> ModelSettings:
        return ModelSettings(n_ctx=self.n_ctx, type_k=self.type_k, type_v=self.type_v, flash_attn=self.flash_attn,
                             n_batch=self.n_batch, n_outputs_max=min(self.n_batch, self.parallel * (self.max_draft + 1)),
                             n_gpu_layers=self.target_gpu_layers, offload_kqv=self.target_offload_kqv,
                             use_mmap=self.use_mmap)

    def draft_settings(self) -> ModelSettings | None:
        if not self.draft:
            return None
        return ModelSettings(n_ctx=self.n_ctx, type_k=self.type_k, type_v=self.type_v, flash_attn=self.flash_attn,
                             n_batch=self.n_batch, n_outputs_max=1, n_gpu_layers=self.draft_gpu_layers,
                             offload_kqv=self.draft_offload_kqv, use_mmap=self.use_mmap)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["n_ctx_allocated"] = padded_ctx(self.n_ctx)
        d["flash_attn"] = "on" if self.flash_attn else "off" if self.flash_attn is False else "auto"
        d["offload_kqv"] = {"target": self.target_offload_kqv, "draft": self.draft_offload_kqv if self.draft else None}
        return d


@dataclass
class Plan:
    fits: bool
    settings: PlanSettings                # the chosen settings (when nothing fits: the cheapest)
    prediction: Prediction
    budget_bytes: int
    gpu_budget_bytes: int | None
    hardware: Hardware
    margin_bytes: int
    smallest_budget_bytes: int | None = None      # when nothing fits: the least RAM (pool) that would
    smallest_gpu_budget_bytes: int | None = None  # ... and VRAM, on a discrete GPU
    notes: list[str] = field(default_factory=list)
    target: str = ""
    draft: str | None = None

    @property
    def predicted_peak_bytes(self) -> int:
        return self.prediction.peak_bytes

    def to_dict(self) -> dict:
        out = {"fits": self.fits, "predicted_peak_bytes": self.predicted_peak_bytes,
               "breakdown": self.prediction.breakdown(), "settings": self.settings.to_dict(),
               "budget_bytes": self.budget_bytes, "gpu_budget_bytes": self.gpu_budget_bytes,
               "margin_bytes": self.margin_bytes, "memory_kind": self.hardware.kind,
               "target": self.target, "draft": self.draft, "notes": list(self.notes),
               "guard_ladder": self.guard_ladder()}
        if self.prediction.device:
            out["predicted_gpu_peak_bytes"] = self.prediction.device_peak_bytes
        if not self.fits:
            out["smallest_budget_bytes"] = self.smallest_budget_bytes
            if self.smallest_gpu_budget_bytes is not None:
                out["smallest_gpu_budget_bytes"] = self.smallest_gpu_budget_bytes
        return out

    def failure_message(self) -> str:
        """One line: nothing fits, and the smallest budget that would."""
        need = f"at least {format_bytes(self.smallest_budget_bytes)}" if self.smallest_budget_bytes else "more"
        what = f"{Path(self.target).name}" + (f" with draft {Path(self.draft).name}" if self.draft else "")
        gpu = ""
        if self.smallest_gpu_budget_bytes is not None:
            gpu = f" and --gpu-budget {format_bytes(self.smallest_gpu_budget_bytes)}"
        s = self.settings
        how = f"{s.n_ctx}-token context, KV {s.type_k}/{s.type_v}" + (", no draft" if self.draft and not s.draft else "")
        return (f"nothing fits a budget of {format_bytes(self.budget_bytes)}: {what} needs {need}{gpu} even with "
                f"the smallest settings ({how}); raise --budget or use a smaller --ctx or model")

    def summary_lines(self) -> list[str]:
        s = self.settings
        lines = [f"budget {format_bytes(self.budget_bytes)}"
                 + (f", GPU {format_bytes(self.gpu_budget_bytes)}" if self.gpu_budget_bytes else "")
                 + f" ({self.hardware.kind} memory): " + ("fits" if self.fits else "does NOT fit")]
        lines.append(f"  context {s.n_ctx} (allocated {padded_ctx(s.n_ctx)}), KV {s.type_k}/{s.type_v}, flash attention "
                     f"{'on' if s.flash_attn else 'off' if s.flash_attn is False else 'auto'}, ubatch {s.n_batch}, "
                     f"weights {'mmap' if s.use_mmap else 'read'}")
        if s.parallel > 1:
            lines.append(f"  {s.parallel} slots of {s.n_ctx // s.parallel} tokens in one KV pool, up to "
                         f"{s.target_settings().n_outputs_max} logits rows per pass")
        no_gpu = " (no GPU)" if self.hardware.kind == "cpu" else ""
        lines.append(f"  target: GPU layers {s.target_gpu_layers}{no_gpu}, offload_kqv {s.target_offload_kqv}")
        if self.draft and s.draft:
            lines.append(f"  draft: on, max draft length {s.max_draft}, GPU layers {s.draft_gpu_layers}{no_gpu}, "
                         f"offload_kqv {s.draft_offload_kqv}")
        else:
            lines.append(("  draft: off" if self.draft else "  draft: none")
                         + (f"; prompt lookup up to {s.max_draft} tokens" if s.max_draft else ""))
        p = self.prediction
        lines.append(f"  predicted peak {format_bytes(p.peak_bytes)} (+ margin {format_bytes(self.margin_bytes)})"
                     + (f", GPU {format_bytes(p.device_peak_bytes)}" if p.device else ""))
        for pool, terms in (("host", p.host), ("gpu", p.device)):
            for name, value in terms.items():
                if value:
                    lines.append(f"    {pool:4} {name:26} {format_bytes(value):>12}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += ladder_lines(self.guard_ladder())
        return lines

    def guard_ladder(self) -> list[dict]:
        """What the run-time guard's steps free about, under this plan (edgespec.machine.guard.LADDER)."""
        draft = draft_bytes(self)
        notes = {"saved_state": "serve's prefix cache when full (--prefix-cache-mb)",
                 "suffix_history": "a full history (--history-limit)",
                 "kv_pool": "the pools when empty, past 256 cells each" if self.settings.parallel <= 1
                            else "--parallel's shared pool is not shrunk",
                 "draft_model": "its weights, KV and buffers" if draft else "no draft in this plan",
                 "refuse": "the last step"}
        return ladder_rows(default_estimates(draft or 0, self.prediction.host.get("reserved") or
                                             DEFAULT_PREFIX_CACHE_BYTES, kv_pool_bytes=kv_pool_bytes(self)), notes)


def _margin(peak: int) -> int:
    return max(int(MARGIN * peak), MARGIN_MIN)


def _fits(pred: Prediction, budget: int, gpu_budget: int | None, hw: Hardware) -> bool:
    if pred.peak_bytes + _margin(pred.peak_bytes) > budget:
        return False
    if hw.kind == "discrete" and pred.device:
        return gpu_budget is not None and pred.device_peak_bytes + _margin(pred.device_peak_bytes) <= gpu_budget
    return True


def _gpu_options(facts: ModelFacts, hw: Hardware) -> list[tuple[int, bool]]:
    """(n_gpu_layers, offload_kqv) for a target, most offloaded first."""
    if hw.kind == "cpu":
        return [(0, True)]
    every = facts.n_layer + 1
    return [(-1, True), (-1, False)] + [(g, True) for g in range(every - 1, 0, -1)] + [(0, True)]


def _offloaded_rank(n_gpu_layers: int, facts: ModelFacts) -> int:
    """0 for every layer on the GPU, growing as fewer are."""
    return 0 if n_gpu_layers < 0 else facts.n_layer + 1 - n_gpu_layers


def _weight_options(facts: list[ModelFacts], cal: Calibration) -> list[tuple[bool, int]]:
    """(use_mmap, n_batch): mapped first; reading the file only where it saves memory (repacked weights)."""
    opts = [(True, BATCH_LADDER[0])]
    read_helps = any(repacked(t, cal) for f in facts for t in f.tensors)
    if read_helps:
        opts.append((False, BATCH_LADDER[0]))
    mmap = not read_helps
    opts += [(mmap, b) for b in BATCH_LADDER[1:]]
    return opts


def candidates(target: ModelFacts, draft: ModelFacts | None, *, contexts: tuple[int, ...], max_draft: int,
               hw: Hardware, cal: Calibration,
               kv_ladder: tuple[tuple[str, str], ...] = KV_LADDER, parallel: int = 1) -> Iterator[PlanSettings]:
    """Every setting the planner may choose, most preferred first."""
    if parallel > 1:  # flash attention off: a quantized V cache is not possible
        kv_ladder = tuple((k, v) for k, v in kv_ladder if v in FLOAT_KV)
    for n_ctx in contexts:
        for draft_on in ((True, False) if draft is not None else (False,)):
            models = [target] + ([draft] if draft_on else [])
            d_gpu_opts = [(-1, True), (0, True)] if (draft_on and hw.kind != "cpu") else [(0, True)]
            # Most of the target on the GPU first; with all of it there, its KV may go to host memory
            # while the draft (and its KV) stays on the GPU, before the draft leaves the GPU.
            placements = sorted(((t, d) for t in _gpu_options(target, hw) for d in d_gpu_opts),
                                key=lambda td: (_offloaded_rank(td[0][0], target), td[1][0] == 0, not td[0][1]))
            for type_k, type_v in kv_ladder:
                for (t_gpu, t_kqv), (d_gpu, d_kqv) in placements:
                    # without the draft model, k is what prompt lookup may draft (rows cost little)
                    for k in (range(max_draft, 0, -1) if draft_on else (max_draft,)):
                        for use_mmap, n_batch in _weight_options(models, cal):
                            yield PlanSettings(n_ctx=n_ctx, type_k=type_k, type_v=type_v, n_batch=n_batch,
                                               use_mmap=use_mmap, target_gpu_layers=t_gpu,
                                               target_offload_kqv=t_kqv, draft=draft_on,
                                               draft_gpu_layers=d_gpu, draft_offload_kqv=d_kqv, max_draft=k,
                                               parallel=parallel)


def setup_for(settings: PlanSettings, target: ModelFacts, draft: ModelFacts | None, hw: Hardware,
              sampling: bool = True) -> Setup:
    return Setup(target=target, target_settings=settings.target_settings(),
                 draft=draft if settings.draft else None, draft_settings=settings.draft_settings(),
                 max_draft=settings.max_draft, sampling=sampling, hardware=hw, parallel=settings.parallel)


def plan(target: str | os.PathLike, draft: str | os.PathLike | None = None, *, budget: int,
         gpu_budget: int | None = None, ctx: int | None = None, max_draft: int | None = None,
         sampling: bool = True, hardware: Hardware | None = None, calibration: Calibration | None = None,
         base_bytes: int | None = None, reserve_bytes: int = 0,
         kv_ladder: tuple[tuple[str, str], ...] = KV_LADDER, parallel: int = 1) -> Plan:
    """Choose settings for target (+ draft) that fit `budget` bytes (see the module docstring).

    target/draft: model files (resolve names with `edgespec.loader.resolve` first).
    base_bytes: the planning process's own resident set when it will load the models itself.
    reserve_bytes: host memory the caller will hold besides the engine (a server's prefix cache).
    parallel: slots sharing the KV pool; `ctx` is then the pool (each slot gets ctx / parallel).
    """
    if budget <= 0:
        raise EdgespecError("--budget must be a positive size, like 2G or 800M")
    hw = hardware or Hardware.detect()
    if hw.kind == "discrete" and gpu_budget is None:
        gpu_budget = hw.gpu_bytes
    cal = calibration or calibrate()
    t_facts = model_facts(target)
    d_facts = model_facts(draft) if draft is not None else None
    k_max = DEFAULT_MAX_DRAFT if max_draft is None else max_draft
    if ctx is not None and ctx < 1:
        raise EdgespecError("--ctx must be >= 1")
    contexts = (ctx,) if ctx else tuple(c for c in CTX_LADDER if not t_facts.n_ctx_train or c <= t_facts.n_ctx_train)
    contexts = contexts or (CTX_LADDER[-1],)
    if parallel > 1:
        from edgespec.serve.slots import slot_context

        contexts = contexts if ctx else tuple(c * parallel for c in contexts)
        slot_context(contexts[0], parallel)  # a pool too small for the slots is said at once

    cheapest: tuple[int, PlanSettings, Prediction] | None = None
    cheapest_gpu: int | None = None
    for settings in candidates(t_facts, d_facts if k_max > 0 else None, contexts=contexts, max_draft=k_max,
                               hw=hw, cal=cal, kv_ladder=kv_ladder, parallel=parallel):
        pred = _reserve(predict(setup_for(settings, t_facts, d_facts, hw, sampling), cal, base_bytes=base_bytes),
                        reserve_bytes)
        if _fits(pred, budget, gpu_budget, hw):
            return Plan(True, settings, pred, budget, gpu_budget, hw, _margin(pred.peak_bytes),
                        notes=_notes(settings, d_facts, k_max, contexts), target=str(target),
                        draft=str(draft) if draft is not None else None)
        need = pred.peak_bytes + _margin(pred.peak_bytes)
        gpu_ok = hw.kind != "discrete" or not pred.device or (
            gpu_budget is not None and pred.device_peak_bytes + _margin(pred.device_peak_bytes) <= gpu_budget)
        if gpu_ok and (cheapest is None or need < cheapest[0]):
            cheapest = (need, settings, pred)
        if pred.device:
            need_gpu = pred.device_peak_bytes + _margin(pred.device_peak_bytes)
            cheapest_gpu = need_gpu if cheapest_gpu is None else min(cheapest_gpu, need_gpu)
    if cheapest is None:  # nothing within the GPU budget: report the least host memory regardless
        settings = PlanSettings(n_ctx=contexts[-1], type_k=kv_ladder[-1][0], type_v=kv_ladder[-1][1],
                                n_batch=BATCH_LADDER[-1], use_mmap=False, parallel=parallel)
        pred = _reserve(predict(setup_for(settings, t_facts, None, hw, sampling), cal, base_bytes=base_bytes),
                        reserve_bytes)
        cheapest = (pred.peak_bytes + _margin(pred.peak_bytes), settings, pred)
    need, settings, pred = cheapest
    return Plan(False, settings, pred, budget, gpu_budget, hw, _margin(pred.peak_bytes), smallest_budget_bytes=need,
                smallest_gpu_budget_bytes=cheapest_gpu if hw.kind == "discrete" else None,
                target=str(target), draft=str(draft) if draft is not None else None)


def _reserve(pred: Prediction, reserve_bytes: int) -> Prediction:
    if reserve_bytes:
        pred.host["reserved"] = int(reserve_bytes)
        pred.host_peak_bytes += int(reserve_bytes)
        pred.phases = {k: v + int(reserve_bytes) for k, v in pred.phases.items()}
    return pred


def _notes(s: PlanSettings, draft: ModelFacts | None, k_max: int, contexts: tuple[int, ...]) -> list[str]:
    notes = []
    if len(contexts) > 1 and s.n_ctx != contexts[0]:
        notes.append(f"context reduced to {s.n_ctx} tokens to fit")
    if draft is not None and not s.draft:
        notes.append("draft dropped to fit")
    elif s.draft and s.max_draft < k_max:
        notes.append(f"draft length reduced to {s.max_draft} to fit")
    if (s.type_k, s.type_v) != ("f16", "f16"):
        kv = s.type_k if s.type_k == s.type_v else f"K {s.type_k} / V {s.type_v}"
        notes.append(f"KV cache quantized to {kv} to fit (flash attention on)")
    if not s.use_mmap:
        notes.append("weights read into memory instead of mapped (repacked weights held once)")
    if s.n_batch != BATCH_LADDER[0]:
        notes.append(f"ubatch reduced to {s.n_batch} tokens (smaller compute buffer, slower prefill)")
    if s.target_gpu_layers == -1 and not s.target_offload_kqv:
        notes.append("target KV in host memory" + (", draft KV on the GPU" if s.draft and s.draft_offload_kqv
                                                   and s.draft_gpu_layers != 0 else ""))
    return notes


# --- applying a plan -------------------------------------------------------------------------------

def apply_budget(target: str | os.PathLike | None, draft: str | os.PathLike | None, *, budget: int | str,
                 gpu_budget: int | str | None = None, ctx: int | None = None, max_draft: int | None = None,
                 sampling: bool = True, n_threads: int | None = None, verbose: bool = False,
                 require_draft: bool = False, hardware: Hardware | None = None, reserve_bytes: int = 0):
    """Plan for this process, load exactly the planned settings, and return (engine, plan).

    The engine carries a `MemoryGuard` that watches the real peak between rounds. Raises
    EdgespecError (one line, naming the smallest budget that would fit) when nothing fits, and
    when `require_draft` is set (--mode draft) but the budget leaves no room for the draft.
    For `chat` and `serve`: call this instead of `Engine.load` when --budget is given, with
    `reserve_bytes` for what they hold besides the engine (serve: its prefix cache).
    """
    from edgespec import loader
    from edgespec.engine import Engine
    from edgespec.machine.guard import MemoryGuard, device_memory
    from edgespec.machine.memory import current_rss, parse_size
    from edgespec.runtimes import llamacpp

    budget_b = parse_size(budget)
    gpu_b = parse_size(gpu_budget) if gpu_budget is not None else None
    target_path, draft_path = _resolve(target, draft)
    info = llamacpp.backend_info()
    cal = calibrate(build=info["build"], system_info=info["system_info"], announce=True)
    hw = hardware or Hardware.detect(use_gpu=None if info["gpu_offload"] else False)
    the_plan = plan(target_path, draft_path, budget=budget_b, gpu_budget=gpu_b, ctx=ctx, max_draft=max_draft,
                    sampling=sampling, hardware=hw, calibration=cal, base_bytes=current_rss(),
                    reserve_bytes=reserve_bytes)
    if not the_plan.fits:
        raise EdgespecError(the_plan.failure_message())
    s = the_plan.settings
    if require_draft and draft_path is not None and not s.draft:
        raise EdgespecError(f"a budget of {format_bytes(budget_b)} leaves no room for the draft model; "
                            "raise --budget or drop --mode draft")
    t_opts, d_opts = _runtime_options(s, n_threads, verbose)
    device_baseline = device_memory() if hw.kind == "discrete" else None  # before the models take their share
    target_rt, draft_rt = loader.open_llamacpp_pair(target_path, t_opts, draft_path if s.draft else None, d_opts)
    try:
        holder: dict = {}
        guard = MemoryGuard(budget_b, gpu_budget_bytes=the_plan.gpu_budget_bytes if hw.kind == "discrete" else None,
                            max_draft=s.max_draft, predicted_peak_bytes=the_plan.predicted_peak_bytes,
                            device_baseline=device_baseline,
                            device_allocated=lambda: _device_bytes(holder["engine"]))
        engine = Engine(target_rt, draft_rt, memory_guard=guard)
        holder["engine"] = engine
        offer_engine_steps(guard, engine, draft_bytes(the_plan))
    except BaseException:
        target_rt.close()
        if draft_rt is not None:
            draft_rt.close()
        raise
    return engine, the_plan


def apply_budget_parallel(target: str | os.PathLike | None, draft: str | os.PathLike | None, *, parallel: int,
                          budget: int | str, ctx: int | None = None, max_draft: int | None = None,
                          n_threads: int | None = None, verbose: bool = False, reserve_bytes: int = 0):
    """`serve --parallel N --budget B`: plan the N slots' pool, load exactly that; (ParallelEngine, plan).

    The plan's peak is the one a full pool and N verify passes reach; a `MemoryGuard` (the engine's
    `memory_guard`) covers the rest at run time, checked between the scheduler's steps.
    """
    from edgespec import loader
    from edgespec.machine.guard import MemoryGuard
    from edgespec.machine.memory import current_rss, parse_size
    from edgespec.runtimes import llamacpp
    from edgespec.serve.slots import ParallelEngine, slot_context

    budget_b = parse_size(budget)
    target_path, draft_path = _resolve(target, draft)
    info = llamacpp.backend_info()
    cal = calibrate(build=info["build"], system_info=info["system_info"], announce=True)
    hw = Hardware.detect(use_gpu=None if info["gpu_offload"] else False)
    the_plan = plan(target_path, draft_path, budget=budget_b, ctx=ctx, max_draft=max_draft, hardware=hw,
                    calibration=cal, base_bytes=current_rss(), reserve_bytes=reserve_bytes, parallel=parallel)
    if not the_plan.fits:
        raise EdgespecError(the_plan.failure_message())
    s = the_plan.settings
    per_slot = slot_context(s.n_ctx, parallel)
    t_opts, d_opts = _runtime_options(s, n_threads, verbose)
    target_rt, draft_rt = loader.open_llamacpp_pair(target_path, t_opts, draft_path if s.draft else None, d_opts,
                                                    n_seq=parallel)
    try:
        engine = ParallelEngine(target_rt, draft_rt, slot_ctx=per_slot)
    except BaseException:
        target_rt.close()
        raise
    # one guard for the process, checked between the scheduler's steps (edgespec.serve.slots)
    engine.memory_guard = MemoryGuard(budget_b, max_draft=s.max_draft, predicted_peak_bytes=the_plan.predicted_peak_bytes)
    offer_engine_steps(engine.memory_guard, engine, draft_bytes(the_plan))
    return engine, the_plan


def _resolve(target: str | os.PathLike | None, draft: str | os.PathLike | None) -> tuple[Path, Path | None]:
    """The model files a plan is made for (edgespec.loader resolves the names; no target and no draft:
    the default model with its draft)."""
    from edgespec.loader import choose_draft, resolve

    draft = choose_draft(target, draft)
    return resolve(target), resolve(draft) if draft else None


def _runtime_options(s: PlanSettings, n_threads: int | None, verbose: bool):
    """The llama.cpp options of the plan's target and draft (None: the plan has no draft)."""
    from edgespec.runtimes.llamacpp import LlamaCppOptions

    draft = s.draft_settings()
    return (LlamaCppOptions(n_threads=n_threads, verbose=verbose, **s.target_settings().runtime_options()),
            LlamaCppOptions(n_threads=n_threads, verbose=verbose, **draft.runtime_options()) if draft else None)


def _device_bytes(engine) -> int:
    """What llama.cpp allocated on offload devices for an engine's models (the draft's until it is dropped)."""
    return sum(sum(rt.device_buffers().values()) for rt in (engine.target, engine.draft_runtime) if rt is not None)


def kv_pool_bytes(the_plan: Plan) -> int:
    """What the guard's kv_pool step frees at most under this plan: each model's KV pool (host and
    device) past the KV_POOL_HEADROOM it keeps, with nothing held; none under --parallel (a shared pool)."""
    s = the_plan.settings
    if s.parallel > 1:
        return 0
    pools = [v for part in (the_plan.prediction.host, the_plan.prediction.device) for k, v in part.items()
             if k.endswith(".kv")]
    return int(sum(pools) * max(0.0, 1 - padded_ctx(KV_POOL_HEADROOM) / padded_ctx(s.n_ctx)))


def draft_bytes(the_plan: Plan) -> int | None:
    """What the plan predicts the draft model holds resident (weights, KV, buffers; not load-time peaks)."""
    if not the_plan.settings.draft:
        return None
    transient = ("repack_staging",)
    return sum(v for k, v in the_plan.prediction.host.items()
               if k.startswith("draft.") and k.split(".", 1)[1] not in transient) or None


def plan_for_cli(target: str | None, draft: str | None, *, budget: str, gpu_budget: str | None = None,
                 ctx: int | None = None, max_draft: int | None = None, parallel: int = 1) -> Plan:
    """`edgespec plan`: resolve names, calibrate (once per build), plan for a fresh process."""
    from edgespec.machine.memory import parse_size
    from edgespec.runtimes import llamacpp

    target_path, draft_path = _resolve(target, draft)
    info = llamacpp.backend_info()
    cal = calibrate(build=info["build"], system_info=info["system_info"], announce=True)
    hw = Hardware.detect(use_gpu=None if info["gpu_offload"] else False)
    return plan(target_path, draft_path, budget=parse_size(budget),
                gpu_budget=parse_size(gpu_budget) if gpu_budget else None, ctx=ctx, max_draft=max_draft,
                hardware=hw, calibration=cal, parallel=parallel)


__all__ = ["Plan", "PlanSettings", "apply_budget", "apply_budget_parallel", "candidates", "plan", "plan_for_cli", "release_draft",
           "setup_for"]
