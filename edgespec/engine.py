"""The engine: prompts in, tokens and text out, through one speculative decoding loop.

Each round reads like the papers' pseudocode:

    forced     = grammar.forced()               # tokens a constraint admits alone (none unconstrained)
    choice     = policy.choose(state + forced)  # a drafter and k; k = 0 is plain decoding
    draft      = forced + drafter.propose(context + forced, k)  # x_1..x_k (and q_1..q_k when sampling),
                                                # cut at the first token the constraint forbids
    rows       = target.decode([last] + draft)  # p_1..p_{k+1} in one pass (none for a token the
                                                # constraint admits alone: its p is a point mass)
    n, token   = verify(draft, q, p)            # accept a prefix, then correct or add a bonus token
    target.truncate(...); commit(draft[:n] + [token]); policy.observe(...)

Invariant between rounds: the target's KV holds every committed token but the last one, which is
fed together with the next draft. The draft model keeps the same invariant (see drafters.py).
Under a constraint (edgespec.structured) every row the sampler processes is masked by the grammar
as it stands after the tokens before that row, and the grammar holds only committed tokens.
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from edgespec.audit import Recorder
from edgespec.chat import Message, render_chat
from edgespec.detokenize import Detokenizer, GenerationResult, TokenLogprob
from edgespec.drafters import EMPTY_DRAFT, Draft, Drafter, DraftSources, lead_with
from edgespec.drafters.table import build_drafters
from edgespec.errors import ContextOverflowError, EdgespecError
from edgespec.machine.guard import MemoryGuard, cap_choice
from edgespec.policy import (DEFAULT_DRAFT_MAX, AcceptanceRecord, AdaptivePolicy, Choice, FixedPolicy, Policy,
                             resolve_mode)
from edgespec.runtimes.base import GrammarVocabulary, Runtime, SelectedRows, TreeDecoding, sync_to
from edgespec.sampling import Sampler, SamplingParams
from edgespec.state import SpeculativeState
from edgespec.stats import GenerationStats
from edgespec.drafters.suffix import SuffixHistory, vocabulary_key
from edgespec.structured import Constraint, ConstraintError, Grammar
from edgespec.verify import Verifier, accept_greedy, accept_sampling, accept_tree_greedy, accept_tree_sampling
from edgespec.vocab import check_vocab_compatible


MAX_TOP_LOGPROBS = 20
FORCED_MAX = 16  # grammar-forced tokens one round feeds at most (a long constant string takes rounds)


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], n_top: int) -> list[TokenLogprob]:
    """Row i of `logits` is the target's prediction of tokens[i]."""
    rows = logits[: len(tokens)].astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    logp = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
    out = []
    for row, token in zip(logp, tokens):
        top = np.argpartition(-row, n_top - 1)[:n_top] if n_top else np.zeros(0, dtype=np.int64)
        top = top[np.argsort(-row[top], kind="stable")]
        out.append(TokenLogprob(int(token), float(row[token]), tuple((int(t), float(row[t])) for t in top)))
    return out


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how. Sampling defaults are llama.cpp's; temperature 0 is greedy."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's; over the same window as repeat_penalty (llama.cpp's)
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    seed: int | None = None        # None = a fresh seed, reported in the stats
    stop: tuple[str, ...] = ()
    mode: str = "auto"             # auto | ar | draft | lookup | suffix
    draft_max: int | None = None   # tokens drafted per round; None = the mode's default
    raw: bool = False              # True: the prompt is used as is, no chat template
    logprobs: int | None = None    # record the target's log-probability of each emitted token and of
                                   # this many top alternatives (0 = the token's own only); None = off
    constraint: Constraint | None = None  # output must match this JSON schema / regex / grammar

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EdgespecError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.draft_max is not None and self.draft_max < 0:
            raise EdgespecError(f"--draft-max must be >= 0, got {self.draft_max}")
        if any(not s for s in self.stop):
            raise EdgespecError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise EdgespecError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        self.sampling  # validates the sampling fields

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logit_bias=tuple((int(t), float(b)) for t, b in self.logit_bias))


@dataclass(frozen=True)
class Verification:
    draft: Draft
    n_accepted: int
    token: int          # the target's correction, or the bonus token when the whole draft passed
    logits: np.ndarray | None = None  # the target's raw rows, one per position fed
    path: tuple[int, ...] | None = None  # a tree: the accepted nodes (1-based draft indices)
    pass_s: float | None = None  # seconds the target's pass over a chain took (auto learns its costs from it)

    @property
    def accepted(self) -> np.ndarray:
        """The drafted tokens the target took: a prefix of a chain, or a root-to-node path of a tree."""
        if self.path is None:
            return self.draft.tokens[: self.n_accepted]
        return self.draft.tokens[[i - 1 for i in self.path]]


def emitted(v: Verification) -> list[int]:
    """The tokens a round emits before any stop: the accepted drafted tokens, then the target's own."""
    return [*v.accepted.tolist(), int(v.token)]


class Engine:
    """A target model, optionally a draft model, and the speculative loop that runs them.

    Not thread-safe (`thread_safe` is False): runtimes hold one KV sequence, so one generation at a
    time. It guards itself: a generation from another thread waits for the running one to end, and a
    second generation started in the same thread before the first ends is refused. Apps that serve
    several callers queue them through `edgespec.serve.aio.AsyncEngine`.
    """

    thread_safe = False

    def __init__(self, target: Runtime, draft: Runtime | None = None, *, memory_guard: "MemoryGuard | None" = None,
                 history: SuffixHistory | None = None):
        if draft is not None:
            check_vocab_compatible(target, draft)
        self.target = target
        self.draft_runtime = draft
        self.memory_guard = memory_guard  # caps k under memory pressure (see edgespec.machine.guard)
        self._lock = threading.Lock()
        self._owner: int | None = None
        self.drafters: dict[str, Drafter] = {}  # by name: the table's drafters these models allow (use_history)
        self.use_history(history if history is not None else SuffixHistory())
        self._profile = None
        self.recorder: Recorder | None = None  # records every verify pass (edgespec.audit); off by default
        # auto's acceptance estimates as the last generation left them, for the next if it is kin
        self.acceptance: AcceptanceRecord | None = None
        self._template_prefix: tuple[np.ndarray, np.ndarray] | None = None  # template_shares, computed once

    def use_history(self, history: SuffixHistory) -> None:
        """Earlier generations' outputs, which suffix drafting copies from (see edgespec.drafters.suffix);
        every generation adds its own. Keyed by this target's vocabulary. The drafters are built
        anew from the table (edgespec.drafters.table) over it and the draft model, if any."""
        history.key = history.key or vocabulary_key(self.target)
        self.history = history
        self.drafters = build_drafters(DraftSources(draft=self.draft_runtime, target=self.target, history=history))

    def cost_profile(self, refresh: bool = False):
        """The measured costs `--mode auto` weighs (cached on disk per model, build, device, threads)."""
        if self._profile is None or refresh:
            from edgespec.machine.profile import load_or_measure

            self._profile, _ = load_or_measure(self.target, self.draft_runtime, refresh=refresh)
        return self._profile

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None, *,
             n_ctx: int = 4096, n_threads: int | None = None, n_gpu_layers: int | None = None,
             flash_attn: bool | None = None, type_k: str = "f16", type_v: str = "f16",
             offload_kqv: bool = True, verbose: bool = False, trees: bool = True,
             memory_guard: "MemoryGuard | None" = None, runtime: str = "llamacpp",
             onnx_quant: str = "auto", onnx_provider: str = "auto",
             kv_resident: int | str | None = None) -> "Engine":
        """Load models by name (the default: the embedded smallest catalog model) through
        `edgespec.loader.load_pair`; the options are `edgespec.loader.LoadOptions`' fields."""
        from edgespec.loader import LoadOptions, load_pair

        options = LoadOptions(runtime=runtime, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                              flash_attn=flash_attn, type_k=type_k, type_v=type_v, offload_kqv=offload_kqv,
                              verbose=verbose, trees=trees, onnx_quant=onnx_quant, onnx_provider=onnx_provider,
                              kv_resident=kv_resident)
        return cls(*load_pair(target, draft, options), memory_guard=memory_guard)

    @contextmanager
    def exclusive(self) -> Iterator["Engine"]:
        """Hold the engine's runtimes for one generation (or a save/restore of their KV)."""
        if self._owner == threading.get_ident():
            raise EdgespecError("this engine is already generating in this thread; finish or close that "
                                "stream before starting another")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield self
            finally:
                self._owner = None

    def close(self) -> None:
        self.target.close()
        if self.draft_runtime is not None:
            self.draft_runtime.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- prompts ------------------------------------------------------------------------------

    def prompt_tokens(self, prompt: str | Sequence[Message], *, raw: bool = False,
                      tools: list | None = None) -> list[int]:
        """Token ids for a prompt: a string (chat-templated unless raw) or a list of chat messages."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EdgespecError("the prompt is empty; give some text to continue or answer")
            if raw:
                return self.target.tokenize(prompt, add_special=True, parse_special=False)
            prompt = [{"role": "user", "content": prompt}]
        text = self.prompt_text(prompt, tools=tools)
        bos_text = self._piece(self.target.vocab.bos)
        add_bos = not (bos_text and text.startswith(bos_text))  # templates often write BOS themselves
        return self.target.tokenize(text, add_special=add_bos, parse_special=True)

    def prompt_text(self, messages: Sequence[Message], *, tools: list | None = None) -> str:
        """Chat messages rendered with the target's chat template (what `prompt_tokens` tokenizes)."""
        return render_chat(self.target.chat_template(), messages, bos_token=self._piece(self.target.vocab.bos),
                           eos_token=self._piece(self.target.vocab.eos), tools=tools)

    def _piece(self, token: int | None) -> str:
        return "" if token is None else self.target.token_text(token)

    # -- the speculative loop -----------------------------------------------------------------

    def template_shares(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` any other prompt of its shape shares through the chat
        template alone (its header, a default system prompt it adds when a request has none): what
        two prompts must share more than to be of one kind (AcceptanceRecord.kin)."""
        if self._template_prefix is None:
            self._template_prefix = (self._shared_by(lambda c: [{"role": "user", "content": c}]),
                                     self._shared_by(lambda c: [{"role": "system", "content": c},
                                                                {"role": "user", "content": "z"}]))
        alone, with_system = self._template_prefix
        return len(alone) if np.array_equal(np.asarray(prompt[:len(alone)]), alone) else len(with_system)

    def _shared_by(self, chat) -> np.ndarray:
        """The tokens two renders of `chat(content)` with different contents start with."""
        try:
            a, b = (np.asarray(self.prompt_tokens(chat(c))) for c in ("x", "y"))
        except EdgespecError:  # no chat template, or none for this shape: raw prompts share nothing
            return np.zeros(0, dtype=np.int64)
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        return a[:differ[0] if len(differ) else n]

    def policy_for(self, config: GenerationConfig, prompt: Sequence[int] = ()) -> tuple[str, Policy]:
        """The policy of --mode `config.mode`; auto starts from the last generation's acceptance record
        where `prompt` is kin to the one it answered (AcceptanceRecord)."""
        mode = resolve_mode(config.mode, self.drafters)
        k = DEFAULT_DRAFT_MAX[mode if mode != "ar" else "auto"] if config.draft_max is None else config.draft_max
        if mode == "auto":
            sizing = self.target.sizing
            branches = sizing.n_seq_max if TreeDecoding in self.target.capabilities else 1
            rows = sizing.n_outputs_max  # a memory plan may size the context for fewer rows
            if rows:
                k = min(k, rows - 1)
            policy = AdaptivePolicy(self.cost_profile(), *self.drafters.values(), k_max=k, max_branches=branches)
            if self.acceptance is not None and self.acceptance.kin(prompt, self.template_shares(prompt)):
                policy.start_from(self.acceptance)
            return mode, policy
        if mode == "ar":
            return mode, FixedPolicy(None, 0)
        return mode, FixedPolicy(self.drafters[mode], k)

    def start(self, prompt_ids: Sequence[int], config: GenerationConfig, policy: Policy,
              mode: str) -> SpeculativeState:
        """Check the budget, then prefill the target and the drafters the policy prefills (all of it
        counts as time to first token; a drafter auto prefills later catches up inside draft_s)."""
        state = self.new_state(prompt_ids, config, mode)
        prompt, n_prompt = state.committed, state.n_prompt
        kept = sync_to(self.target, prompt[:-1])  # reuse the KV of a shared prefix
        if kept < n_prompt - 1:
            self.target.decode(prompt[kept:-1], 0)
        state.stats.cached_tokens, state.stats.prefilled_tokens = kept, n_prompt - 1 - kept
        for drafter in policy.prefilled:
            drafter.prepare(prompt)
        state.stats.prefill_s = time.perf_counter() - state.t_start
        return state

    def new_state(self, prompt_ids: Sequence[int], config: GenerationConfig, mode: str) -> SpeculativeState:
        """A generation's state before any KV work: the budget checked, the seed drawn."""
        n_prompt = len(prompt_ids)
        self.check_fits(n_prompt, config)
        seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**63)
        context = np.zeros(n_prompt + config.max_tokens, dtype=np.int32)
        context[:n_prompt] = prompt_ids
        n_vocab = self.target.vocab.n_vocab
        if any(t >= n_vocab for t, _ in config.logit_bias):
            raise EdgespecError(f"logit_bias names a token past the vocabulary ({n_vocab} tokens)")
        grammar = None
        if config.constraint is not None:
            if GrammarVocabulary not in self.target.capabilities:
                raise ConstraintError(f"the {self.target.name} runtime cannot constrain output; use llama.cpp or ONNX")
            grammar = Grammar(self.target.grammar_tokenizer(), config.constraint, n_vocab=n_vocab,
                              eog=self.target.vocab.eog, position=n_prompt)
        return SpeculativeState(context, n_prompt, n_prompt, config.max_tokens,
                                Sampler(config.sampling, seed, grammar),
                                GenerationStats(mode=mode, prompt_tokens=n_prompt, seed=seed),
                                top_logprobs=config.logprobs)

    def draft_step(self, state: SpeculativeState, choice: Choice) -> Draft:
        if choice.drafter is None or choice.k == 0:
            return EMPTY_DRAFT
        if choice.draft is not None:  # the policy already holds the proposal
            return choice.draft
        t = time.perf_counter()
        if choice.branch is not None:
            draft = choice.drafter.propose(state.committed, choice.k, state.sampler, choice.gate, choice.branch)
        else:
            draft = choice.drafter.propose(state.committed, choice.k, state.sampler, choice.gate)
        state.stats.draft_s += time.perf_counter() - t
        return draft

    def verify_step(self, state: SpeculativeState, draft: Draft, verifier: Verifier | None = None) -> Verification:
        """One target pass over the last committed token and the draft; accept a prefix."""
        if draft.parents is not None:
            return self.verify_tree_step(state, draft)
        t = time.perf_counter()
        logits, skipped = self.verify_rows(state, draft)
        pass_s = time.perf_counter() - t
        verification = self.verify_accept(state, draft, logits, verifier, skipped)
        state.stats.verify_s += time.perf_counter() - t
        return replace(verification, pass_s=pass_s)

    def verify_feed(self, state: SpeculativeState, draft: Draft) -> np.ndarray:
        """The tokens a verify pass appends; the pass returns logits of the last len(draft) + 1.

        Normally only the last committed token is new to the target; after a tree whose accepted
        path left the main chain, the tokens of that branch are too (see keep_tree_path).
        """
        return np.concatenate([state.committed[self.target.n_past:], draft.tokens])

    def verify_rows(self, state: SpeculativeState, draft: Draft) -> tuple[np.ndarray, np.ndarray]:
        """The target's raw rows of one pass over the last committed token and the draft, and the
        indices of those it did not compute.

        A drafted token the grammar admits alone (`draft.certain`) has a point mass for its masked
        distribution whatever its row says: it is accepted with probability 1. Where the runtime
        computes selected rows only, that row is skipped (zeros stand in; the mask turns them into
        the point mass) while the token is still fed, since its KV is needed. Not when log-probabilities
        are asked for: they report the model's own rows.
        """
        feed, n_rows = self.verify_feed(state, draft), len(draft) + 1
        skipped = np.flatnonzero(draft.certain) if draft.certain is not None else np.zeros(0, dtype=np.int64)
        if not len(skipped) or SelectedRows not in self.target.capabilities or state.top_logprobs is not None:
            return self.target.decode(feed, n_rows), skipped[:0]
        wanted = np.setdiff1d(np.arange(n_rows), skipped)
        logits = np.zeros((n_rows, self.target.vocab.n_vocab), dtype=np.float32)
        logits[wanted] = self.target.decode_rows(feed, wanted + len(feed) - n_rows)
        return logits, skipped

    def verify_accept(self, state: SpeculativeState, draft: Draft, logits: np.ndarray,
                      verifier: Verifier | None = None, skipped: Sequence[int] = ()) -> Verification:
        """Accept a prefix of the draft by the target's rows of the pass (`skipped`: rows not computed,
        see verify_rows); roll its KV back to it."""
        rows = state.sampler.rows(logits, state.committed, draft.tokens)
        verify = verifier or (accept_greedy if state.sampler.params.greedy else accept_sampling)
        if self.recorder is not None:
            verify = self.recorder.engine_rule(verify, state, logits, self.target, skipped=skipped)
        n_accepted, token = verify(draft.tokens, draft.probs, rows, state.sampler.rng)
        self.target.truncate(state.n + n_accepted)  # keep the last token and the accepted drafts
        return Verification(draft, n_accepted, token, logits)

    def verify_tree_step(self, state: SpeculativeState, draft: Draft) -> Verification:
        """One target pass over a token tree (branches on separate sequences); accept one path."""
        t = time.perf_counter()
        # Tokens the target has not seen (the last committed one, plus a branch accepted last round
        # that stayed off its KV) lead the tree as a chain; the draft hangs off the last of them.
        unseen = state.committed[self.target.n_past:]
        lead = len(unseen) - 1
        nodes = np.concatenate([unseen, draft.tokens])
        parents = np.concatenate([np.arange(-1, lead), draft.parents + lead])
        logits = self.target.decode_tree(nodes, parents)[lead:]
        nodes, parents = nodes[lead:], np.concatenate([[-1], draft.parents])
        rows = np.empty(logits.shape, dtype=np.float32 if state.sampler.params.greedy else np.float64)
        for i in range(len(nodes)):  # each node's row follows its own path
            path, j = [], i
            while j > 0:
                path.append(nodes[j])
                j = int(parents[j])
            rows[i] = state.sampler.rows(logits[i:i + 1], state.committed, np.asarray(path[::-1], dtype=np.int32))[0]
        verify = accept_tree_greedy if state.sampler.params.greedy else accept_tree_sampling
        if self.recorder is not None:
            verify = self.recorder.engine_rule(verify, state, logits, self.target, tree_lead=unseen[:lead])
        path, token = verify(nodes, parents, rows, state.sampler.rng)
        self.target.keep_tree_path(list(range(lead)) + [lead + i for i in path])
        state.stats.verify_s += time.perf_counter() - t
        state.stats.tree_rounds += 1
        return Verification(draft, len(path) - 1, token, logits[path], tuple(path[1:]))

    def accept_step(self, state: SpeculativeState, verification: Verification, drafter_name: str) -> np.ndarray:
        """Commit the accepted tokens, applying end-of-generation and length stops. Returns what was added."""
        v = verification
        f = v.draft.forced
        state.stats.record_round(drafter_name, len(v.draft) - f, max(0, v.n_accepted - f),
                                 forced=f, forced_accepted=min(f, v.n_accepted), held=state.n)
        new = emitted(v)  # a Python list: a token or a few, every round, right after a pass
        eog = self.target.vocab.eog
        for i, token in enumerate(new):
            if token in eog:
                new, state.finish_reason = new[:i], "stop"
                break
        if len(new) >= state.remaining:
            new = new[: state.remaining]
            state.finish_reason = state.finish_reason or "length"
        if state.top_logprobs is not None and v.logits is not None:
            state.logprobs.extend(token_logprobs(v.logits, new, state.top_logprobs))
        state.context[state.n:state.n + len(new)] = new
        state.n += len(new)
        if state.grammar is not None:
            state.grammar.consume(new)
        state.stats.generated += len(new)
        if state.stats.ttft_s == 0.0 and len(new):
            state.stats.ttft_s = time.perf_counter() - state.t_start
        return np.array(new, dtype=np.int32)

    def check_fits(self, n_prompt: int, config: GenerationConfig) -> None:
        """A prompt plus its budget must fit the context: said before anything runs."""
        if n_prompt == 0:
            raise EdgespecError("the prompt has no tokens; give some text")
        if n_prompt + config.max_tokens > self.target.n_ctx:
            raise ContextOverflowError(
                f"prompt ({n_prompt} tokens) plus --max-tokens ({config.max_tokens}) exceeds the context of "
                f"{self.target.n_ctx} tokens; use a shorter prompt, fewer --max-tokens or a larger --ctx")

    def begin(self, prompt_ids: Sequence[int], config: GenerationConfig) -> tuple[SpeculativeState, Policy]:
        self.check_fits(len(prompt_ids), config)  # before auto mode's first profile measurement
        mode, policy = self.policy_for(config, prompt_ids)
        return self.start(prompt_ids, config, policy, mode), policy

    def rounds(self, state: SpeculativeState, policy: Policy, verifier: Verifier | None = None) -> Iterator[np.ndarray]:
        """The loop: yields the tokens each round adds until a stop.

        `verifier` replaces the acceptance rule (tests use it to prove the statistical test has power).
        """
        t_decode = time.perf_counter()
        try:
            while state.finish_reason is None:
                choice, draft = self.propose(state, policy)
                verification = self.verify_step(state, draft, verifier)
                new = self.commit(state, policy, choice, verification)
                if len(new):
                    yield new
        finally:
            state.stats.decode_s = time.perf_counter() - t_decode
            self.remember(state, policy)
            if self.memory_guard is not None:
                self.memory_guard.observe(state)

    def remember(self, state: SpeculativeState, policy: Policy) -> None:
        """What a generation leaves for later ones: its text, which suffix drafting may copy from, and
        auto's acceptance record, which the next auto generation starts from."""
        self.history.add(state.committed[state.n_prompt:])
        if isinstance(policy, AdaptivePolicy):
            self.acceptance = policy.record(state.committed[:state.n_prompt])

    def propose(self, state: SpeculativeState, policy: Policy) -> tuple[Choice, Draft]:
        """The first half of a round: the policy's choice, and the draft it asks for."""
        t = time.perf_counter()
        grammar = state.grammar
        forced = grammar.forced(min(FORCED_MAX, state.remaining - 1)) if grammar is not None else EMPTY_DRAFT.tokens
        view = state.ahead(forced)
        choice = policy.choose(view)
        if self.memory_guard is not None:  # under memory pressure: a shorter draft, or none
            choice = cap_choice(choice, self.memory_guard.check(state))
        state.stats.draft_s += time.perf_counter() - t  # choosing includes asking lookup
        draft = self.draft_step(view, choice)
        return choice, draft if grammar is None else self.constrain(grammar, forced, draft)

    @staticmethod
    def constrain(grammar: Grammar, forced: np.ndarray, draft: Draft) -> Draft:
        """A round's draft under a constraint: the forced tokens, then the drafter's chain cut before
        its first token the grammar forbids (the target would reject it for certain: its masked
        probability is 0; a one-hot draft's residual is then the masked row itself, so the cut is
        exact; the draft model drafts from masked rows and is never cut). A tree is left whole: a
        forbidden node is never accepted, and rows under it are never used."""
        if len(draft) and draft.parents is None:
            draft = draft.head(grammar.valid_prefix(np.concatenate([forced, draft.tokens])) - len(forced))
        draft = lead_with(forced, draft)
        return replace(draft, certain=grammar.certain(forced)) if len(forced) else draft

    def commit(self, state: SpeculativeState, policy: Policy, choice: Choice,
               verification: Verification) -> np.ndarray:
        """The last half of a round: commit what was accepted, tell the policy. Returns the new tokens."""
        v, f = verification, verification.draft.forced
        name = choice.drafter.name if choice.drafter is not None and len(v.draft) > f else "none"
        new = self.accept_step(state, v, name)
        if v.n_accepted >= f:  # the drafter's part was judged from where it started (after the forced tokens)
            policy.observe(choice, len(v.draft) - f, v.n_accepted - f, emitted(v)[f:], pass_s=v.pass_s if not f else None)
        return new

    # -- public API ---------------------------------------------------------------------------

    def stream(self, prompt: str | Sequence[Message], config: GenerationConfig = GenerationConfig(),
               **overrides) -> "GenerationStream":
        """Text pieces as they are produced; `.result` holds the whole result once iteration ends."""
        config = replace(config, **overrides) if overrides else config
        return GenerationStream(self, self.prompt_tokens(prompt, raw=config.raw), config)

    def generate(self, prompt: str | Sequence[Message], config: GenerationConfig = GenerationConfig(),
                 **overrides) -> GenerationResult:
        stream = self.stream(prompt, config, **overrides)
        for _ in stream:
            pass
        return stream.result

    def generate_tokens(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig(), *,
                        verifier: Verifier | None = None) -> GenerationResult:
        """Token ids in, result out: no template, no stop strings. For tests and tools."""
        stream = GenerationStream(self, list(prompt_ids), config, verifier=verifier)
        for _ in stream:
            pass
        return stream.result


class GenerationStream:
    """Iterates the text pieces of one generation; `.result` holds the whole result afterwards."""

    def __init__(self, engine: Engine, prompt_ids: list[int], config: GenerationConfig,
                 verifier: Verifier | None = None):
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.config = config
        self.verifier = verifier
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        with self.engine.exclusive():
            yield from self._pieces()

    def _pieces(self) -> Iterator[str]:
        state, policy = self.engine.begin(self.prompt_ids, self.config)
        output = Detokenizer(self.engine.target, self.config.stop, state)
        yield from output.texts(self.engine.rounds(state, policy, self.verifier))
        self.result = output.result()
