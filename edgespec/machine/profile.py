"""What speculation costs on this machine: measured once, cached, and read by the adaptive policy.

The profile holds the target's time to evaluate a batch of n tokens (n = 1 .. K+1: one verify pass
of k drafted tokens), the draft model's time per drafted token, and prompt lookup's time per
proposal. It is keyed by model identity, runtime build, device and thread count; a key that
changes (another model file, a GPU build, more threads) means it is measured again. The target's
costs and the draft model's are cached apart: a target's curve is the same measurement whether or
not a draft is loaded (a memory guard that unloads the draft, `--mode ar`), so auto weighs the same
prices with and without it instead of another one-off measurement's noise.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from edgespec import atomic
from edgespec.runtimes.base import ModelIdentity, Runtime

PROFILE_VERSION = 9  # 3: sizes measured round-robin, coarse first; 4: the MTP head step (mtp_s);
                     # 5: a recurrent model's rollback (rollback_s); 6: target and draft costs cached apart;
                     # 7: every coarse size timed `repeats` times, bent curves re-timed (6's could be one run);
                     # 8: the rollback timed as the cut alone (7's could read 0 on a tiny model);
                     # 9: the coarse sizes timed again over DEEP_CONTEXT_TOKENS (verify_deep_s)
BATCH_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 17)  # verify pass sizes measured (17: k = 16); others interpolate
CONTEXT_TOKENS = 64                              # KV already held while timing, like a short prompt
# The same passes over a long prompt's KV. A pass's attention grows linearly with the tokens held
# (bench/DEPTH_CURVE_RESULTS.md: SmolLM2's 17-row pass 140 ms over 64, 289 over 512, 469 over 1024,
# 827 over 2048, each step of it ~0.35 ms per 1000 held tokens), so two depths price any depth; with one,
# a 490-token prompt's 17-row pass was priced at 7.5 steps where it takes 10.
DEEP_CONTEXT_TOKENS = 512


@dataclass
class CostProfile:
    """Seconds per operation. `verify_s[n]` is one target pass over n tokens after CONTEXT_TOKENS held;
    `verify_deep_s[n]` the same after `deep_tokens` (none measured: the pass's cost taken as the same at
    any depth)."""

    verify_s: dict[int, float]
    draft_s: float | None = None        # one draft-model decode step (per drafted token)
    draft_catchup_s: float | None = None  # a two-token draft decode (after a fully accepted draft)
    lookup_s: float = 0.0               # one prompt-lookup proposal
    suffix_s: float = 0.0               # one suffix-drafting proposal over a full default history
    mtp_s: float | None = None          # one step of the target's own MTP head (NextTokenHeads), per drafted token
    rollback_s: float = 0.0             # what rolling a rejected draft back adds to a round (recurrent
                                        # models: restore a checkpoint and replay the accepted tokens)
    key: dict = field(default_factory=dict)
    measured_in_s: float = 0.0
    verify_deep_s: dict[int, float] = field(default_factory=dict)
    deep_tokens: int = 0                # the KV held while verify_deep_s was timed (0: not timed)

    def verify(self, n: int, held: int = CONTEXT_TOKENS) -> float:
        """Target pass over n tokens after `held` tokens in the KV cache: each measured depth's curve
        linearly interpolated (and extrapolated) over n, then the two depths over `held` (a pass never
        costs less for holding more)."""
        shallow = _along(self.verify_s, n)
        if not self.deep_tokens or held == CONTEXT_TOKENS:
            return shallow
        per_token = max(0.0, (_along(self.verify_deep_s, n) - shallow) / (self.deep_tokens - CONTEXT_TOKENS))
        return shallow + per_token * (max(held, 0) - CONTEXT_TOKENS)

    @property
    def max_batch(self) -> int:
        return max(self.verify_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        for curve in ("verify_s", "verify_deep_s"):
            d[curve] = {str(k): v for k, v in d[curve].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        d = dict(d)
        for curve in ("verify_s", "verify_deep_s"):
            d[curve] = {int(k): float(v) for k, v in d.get(curve, {}).items()}
        return cls(**d)


def describe_curves(d: dict) -> str:
    """A profile's passes (CostProfile.to_dict's) in one line: over CONTEXT_TOKENS, and the deep depth's."""
    def curve(c: dict) -> str:
        return ", ".join(f"{n}: {1e3 * float(v):.1f} ms" for n, v in sorted(c.items(), key=lambda kv: int(kv[0])))
    deep = f"; over {d['deep_tokens']}: {curve(d['verify_deep_s'])}" if d.get("deep_tokens") else ""
    return f"verify(n) over {CONTEXT_TOKENS} held tokens: {curve(d['verify_s'])}{deep}"


def _along(curve: dict[int, float], n: int) -> float:
    """curve[n], linearly interpolated (and extrapolated) from its measured sizes."""
    if n in curve:
        return curve[n]
    sizes = sorted(curve)
    if n > sizes[-1]:
        if len(sizes) == 1:
            return curve[sizes[0]] * n / sizes[0]
        a, b = sizes[-2], sizes[-1]
        slope = (curve[b] - curve[a]) / (b - a)
        return curve[b] + slope * (n - b)
    return float(np.interp(n, sizes, [curve[s] for s in sizes]))


def _best_time(fn, repeats: int) -> float:
    """Fastest of a few runs: other load on the machine only ever adds time."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(min(times))


def measure_profile(target: Runtime, draft: Runtime | None = None, *, max_batch: int = 17,
                    repeats: int = 3, budget_s: float = 2.5) -> CostProfile:
    """Time the operations the policy weighs. Leaves both runtimes' KV empty.

    Sizes are timed smallest first and with fewer repeats once the budget runs short, so the
    catalog models profile in well under 3 s here.
    """
    profile = measure_target_costs(target, max_batch=max_batch, repeats=repeats, budget_s=budget_s)
    return profile if draft is None else with_draft(profile, measure_draft_costs(draft, repeats=repeats))


def _context(vocab_size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(100, min(vocab_size, 30000), size=CONTEXT_TOKENS).astype(np.int32)


def measure_target_costs(target: Runtime, *, max_batch: int = 17, repeats: int = 3,
                         budget_s: float = 2.5) -> CostProfile:
    """The target's passes (and rollback, MTP head) and the model-free drafters' asks; no draft costs."""
    t_start = time.perf_counter()
    rows = target.sizing.n_outputs_max
    if rows:  # a memory plan sized the context for at most this many logits rows per pass
        max_batch = min(max_batch, rows)
    rng = np.random.default_rng(1)
    n_vocab = target.vocab.n_vocab
    context = _context(n_vocab)
    target.truncate(0)
    target.decode(context, 0)

    def target_step(n: int, held: int = CONTEXT_TOKENS):
        batch = rng.integers(100, min(n_vocab, 30000), size=n).astype(np.int32)

        def step():
            target.decode(batch, n)
            target.truncate(held)
        step()  # warm the kernels and buffers for this size
        return step

    sizes = [s for s in BATCH_SIZES if s <= max_batch] or [1]
    # The curve's shape first (doubling sizes and the largest), its detail while the budget lasts:
    # a slow model on a busy machine still gets a curve that spans every k auto may choose.
    coarse = [s for s in sizes if s & (s - 1) == 0] + [sizes[-1]]
    steps = {}
    for n in dict.fromkeys(coarse + sizes):
        if time.perf_counter() - t_start > budget_s / 2 and n not in coarse:
            break
        steps[n] = target_step(n)
    # Repeats go round the sizes rather than size by size, so a burst of other load on the machine
    # slows every size alike instead of bending the curve; each size keeps its fastest run. The curve's
    # shape (the coarse sizes) gets every repeat whatever the budget: one run per size let a single
    # burst price a 1-row pass at 134 ms where it takes 58 (Qwen2.5-Coder-1.5B here), and the cache kept
    # that for good, so auto saw plain decoding at half its speed and drafted at a loss.
    times: dict[int, list[float]] = {n: [] for n in steps}
    for rep in range(repeats):
        for n, step in steps.items():
            if rep and n not in coarse and time.perf_counter() - t_start > budget_s:
                continue
            times[n].append(_best_time(step, 1))
    # A larger pass timed cheaper than a smaller one means load hit the smaller: time it again.
    for _ in range(repeats):
        verify_s = {n: min(ts) for n, ts in times.items()}
        bent = [n for n in steps if any(verify_s[m] < verify_s[n] for m in steps if m > n)]
        if not bent:
            break
        for n in bent:
            times[n].append(_best_time(steps[n], 1))
    verify_s = {n: min(ts) for n, ts in times.items()}

    rollback_s = _rollback_cost(target, rng, n_vocab, repeats) if getattr(target, "recurrent", False) else 0.0
    mtp_s = _mtp_step_s(target, context, repeats)
    # The curve's shape again over a long prompt's KV, round-robin like the above; a context too small
    # to hold it leaves the profile depth-free (its prompts are short anyway).
    verify_deep_s, deep = {}, DEEP_CONTEXT_TOKENS
    if target.n_ctx >= deep + max(steps):
        target.truncate(CONTEXT_TOKENS)
        target.decode(rng.integers(100, min(n_vocab, 30000), size=deep - CONTEXT_TOKENS).astype(np.int32), 0)
        deep_steps = {n: target_step(n, deep) for n in dict.fromkeys(coarse) if n in steps}
        deep_times: dict[int, list[float]] = {n: [] for n in deep_steps}
        for _ in range(repeats):
            for n, step in deep_steps.items():
                deep_times[n].append(_best_time(step, 1))
        verify_deep_s = {n: min(ts) for n, ts in deep_times.items()}
    target.truncate(0)

    from edgespec.drafters import PromptLookupDrafter
    from edgespec.sampling import Sampler, SamplingParams

    history = rng.integers(100, 1000, size=2048).astype(np.int32)
    lookup, sampler = PromptLookupDrafter(), Sampler(SamplingParams(temperature=0), 0)
    lookup_s = _best_time(lambda: lookup.propose(history, 8, sampler), 5)
    from edgespec.drafters.suffix import DEFAULT_HISTORY_TOKENS, SuffixDrafter, SuffixHistory

    past = SuffixHistory()
    past.add(rng.integers(100, 1000, size=DEFAULT_HISTORY_TOKENS).astype(np.int32))
    suffix = SuffixDrafter(past)
    suffix_s = _best_time(lambda: suffix.propose(history, 16, sampler), 5)
    return CostProfile(verify_s, None, None, lookup_s, suffix_s, mtp_s=mtp_s, rollback_s=rollback_s,
                       measured_in_s=time.perf_counter() - t_start, verify_deep_s=verify_deep_s,
                       deep_tokens=deep if verify_deep_s else 0)


DRAFT_FIELDS = ("draft_s", "draft_catchup_s")


def with_draft(profile: CostProfile, part: dict) -> CostProfile:
    """A target's profile with a draft model's costs (measure_draft_costs' dict) added."""
    return replace(profile, **{f: part[f] for f in DRAFT_FIELDS},
                   measured_in_s=profile.measured_in_s + part["measured_in_s"])


def measure_draft_costs(draft: Runtime, *, repeats: int = 3) -> dict:
    """The draft model's step (one token) and catch-up (two tokens) after a short context."""
    t_start = time.perf_counter()
    context = _context(draft.vocab.n_vocab)
    draft.truncate(0)
    draft.decode(context, 0)

    def draft_step(n: int):
        def step():
            draft.decode(context[:n], 1)
            draft.truncate(CONTEXT_TOKENS)
        step()
        return step
    draft_s = _best_time(draft_step(1), repeats)
    catchup_s = _best_time(draft_step(2), repeats)
    draft.truncate(0)
    return {"draft_s": draft_s, "draft_catchup_s": catchup_s, "measured_in_s": time.perf_counter() - t_start}


ROLLBACK_PASS = 5  # a verify pass of k = 4 of which one draft is kept: the rollback keeps 2 of its 5 tokens


def _rollback_cost(target: Runtime, rng, n_vocab: int, repeats: int) -> float:
    """A recurrent model's rollback beyond what the verify curve holds. Each timed pass there ends in a
    cut back to the pass's start (a checkpoint restored); a round that keeps some drafts also replays
    them (or uses llama.cpp's own snapshots). Only the cuts are timed, the kept-two cut and the
    back-to-start cut interleaved after the same pass, so a burst of other load lands on both: a
    difference of two whole-pass timings (session 17) sank the ~0.2 ms replay of a tiny model into
    the passes' noise and read 0."""
    batch = rng.integers(100, min(n_vocab, 30000), size=ROLLBACK_PASS).astype(np.int32)
    best = {0: float("inf"), 2: float("inf")}
    for rep in range(2 * (repeats + 1)):  # the first two runs warm the replay's buffers
        for kept in (0, 2) if rep % 2 else (2, 0):
            target.decode(batch, ROLLBACK_PASS)
            t = time.perf_counter()
            target.truncate(CONTEXT_TOKENS + kept)
            if rep > 1:
                best[kept] = min(best[kept], time.perf_counter() - t)
            target.truncate(CONTEXT_TOKENS)
    return max(0.0, best[2] - best[0])


def _mtp_step_s(target: Runtime, context: np.ndarray, repeats: int) -> float | None:
    """One step of the target's MTP head (a one-token decode of its NextN layer), where it has one."""
    from edgespec.runtimes.base import NextTokenHeads

    if NextTokenHeads not in target.capabilities:
        return None
    head = target.next_token_head()
    head.truncate(0)
    head.decode(context, target.hidden_rows(-1, len(context) - 1), 0)
    row = target.hidden_rows(len(context) - 2, len(context) - 1)

    def step():
        head.decode(context[-1:], row, 1)
        head.truncate(len(context))
    step()
    seconds = _best_time(step, repeats)
    head.truncate(0)
    return seconds


# --- cache -----------------------------------------------------------------------------------

def profile_key(target: Runtime, draft: Runtime | None, device: str) -> dict:
    """Everything a measured cost depends on."""
    def runtime_key(rt: Runtime) -> dict:
        key = rt.compatibility_key() if ModelIdentity in rt.capabilities else {"name": rt.name}
        sizing = rt.sizing
        offload = {"gpu_layers": sizing.n_gpu_layers} if sizing.n_gpu_layers else {}  # CPU keys stay as they were
        return {**key, "threads": sizing.n_threads, "n_batch": sizing.n_batch, "rows": sizing.n_outputs_max, **offload}
    return {"version": PROFILE_VERSION, "device": device, "target": runtime_key(target),
            "draft": runtime_key(draft) if draft is not None else None}


def profile_dir() -> Path:
    home = os.environ.get("EDGESPEC_HOME")
    if home:
        return Path(home).expanduser() / "profiles"
    import platformdirs

    return Path(platformdirs.user_cache_dir("edgespec")) / "profiles"


def _cached(part: str, key: dict, measure, refresh: bool) -> tuple[dict, bool]:
    """One part of a profile ("target" or "draft"), read from its cache file or measured and written."""
    path = profile_dir() / f"{part}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    if not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.pop("key") == key:
                return cached, False
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # an unreadable cache entry is measured again
    values = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, json.dumps({**values, "key": key}, indent=1))
    return values, True


def load_or_measure(target: Runtime, draft: Runtime | None, *, device: str | None = None,
                    refresh: bool = False) -> tuple[CostProfile, bool]:
    """The cached profile for this configuration, or a fresh measurement (then cached).

    The target's part and the draft's are cached apart (see the module's docstring).
    Returns (profile, measured_now).
    """
    if device is None:
        from edgespec.machine.hardware import detect, device_key

        # NVML as doctor and the planner ask it: without it a GPU has no compute capability and the key
        # read "cuda-NVIDIA_H200-smunknown" where docs/install.md (and doctor) say "...-sm90".
        device = device_key(detect(llama_cpp=True, onnxruntime=False))
    key = profile_key(target, draft, device)
    target_part, measured = _cached("target", {**key, "draft": None},
                                    lambda: measure_target_costs(target).to_dict(), refresh)
    profile = CostProfile.from_dict({**target_part, "key": key})
    if draft is not None:
        draft_part, draft_measured = _cached("draft", {"version": PROFILE_VERSION, "device": device,
                                                       "draft": key["draft"]},
                                             lambda: measure_draft_costs(draft), refresh)
        profile, measured = with_draft(profile, draft_part), measured or draft_measured
    return profile, measured
