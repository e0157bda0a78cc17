"""An audit trail of verify passes, and the two checks that make "output unchanged" checkable.

Off by default and free when off: each place an acceptance rule runs (`Engine.verify_accept`,
`Engine.verify_tree_step`, the cloud verifier; `--parallel` slots go through `verify_accept`) holds
one `if recorder is not None` line that wraps the rule. The wrapped rule records what it was given
and what it drew, and changes nothing: the rows are the same objects, and the uniforms come from the
sampler's own generator through a recording proxy.

    recorder = Recorder(); engine.recorder = recorder
    result = engine.generate_tokens(prompt, config)
    check_decisions(recorder.passes, prompt, result.tokens)     # zero tolerance: the rule, re-run
    check_rows(recorder.passes, Fresh(reference_runtime))        # the rows belong to their context

`check_decisions` re-runs the reference rule (greedy: the argmax; sampling: rejection sampling with
the recorded uniforms) on the recorded rows and demands exactly the emitted tokens. It cannot see rows
computed from the wrong context, since a faithful rule on wrong rows emits "correctly": `check_rows`
does, by evaluating each row's committed prefix afresh in a one-sequence runtime and at other batch
shapes; the spread among those shapes is the bound, measured by the same call, never a constant.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Hashable, Sequence

import numpy as np

from edgespec.verify import accept_greedy, accept_sampling, accept_tree_greedy, accept_tree_sampling


class ExactnessError(AssertionError):
    """A recorded verify pass that the acceptance rule, or a fresh evaluation, contradicts."""


@dataclass
class VerifyPass:
    """One verify pass as the acceptance rule saw it."""

    key: object                   # the generation (an engine's state, a cloud session id)
    seq: int                      # the KV sequence the pass ran on (slot, session, 0 alone)
    committed: np.ndarray         # the committed text before the pass: prompt + emitted tokens
    fed: np.ndarray               # the tokens whose rows were read, as the runtime holds them
    positions: np.ndarray         # their KV positions
    draft: np.ndarray             # chain: x_1..x_k; tree: the nodes after the root
    draft_probs: np.ndarray | None
    parents: np.ndarray | None    # tree: parents of nodes 0..n (node 0 = the last committed token)
    logits: np.ndarray            # the raw rows the runtime returned, one per fed token
    rows: np.ndarray              # the same rows after the sampling chain: what the rule saw
    greedy: bool
    uniforms: list[float] = field(default_factory=list)  # the rule's draws, in order
    decision: tuple = ()          # what the rule returned: (n_accepted or path, token)
    skipped: tuple[int, ...] = ()  # raw rows not computed: their draft token is the only one the
    #                                grammar admits, so the rule sees a point mass there (Engine.verify_rows)

    def emitted(self) -> list[int]:
        """The tokens this pass commits (before stops cut them)."""
        taken, token = self.decision
        if self.parents is None:
            return [int(t) for t in self.draft[:taken]] + [int(token)]
        nodes = self._nodes()
        return [int(nodes[i]) for i in taken[1:]] + [int(token)]

    def _nodes(self) -> np.ndarray:
        return np.concatenate([self.committed[-1:], self.draft]).astype(np.int32)

    def contexts(self) -> list[np.ndarray]:
        """For each raw row: the committed prefix it must predict from (the text up to its token)."""
        if self.parents is None:
            return [np.concatenate([self.committed, self.draft[:i]]) for i in range(len(self.logits))]
        nodes, out = self._nodes(), []
        for i in range(len(nodes)):
            path, j = [], i
            while j > 0:
                path.append(nodes[j])
                j = int(self.parents[j])
            out.append(np.concatenate([self.committed, np.asarray(path[::-1], dtype=np.int32)]).astype(np.int32))
        return out


class RecordingRng:
    """A `numpy.random.Generator` stand-in that passes the real generator's draws through and keeps them."""

    def __init__(self, rng: np.random.Generator, sink: list[float]):
        self._rng, self._sink = rng, sink

    def random(self, size=None):
        value = self._rng.random(size)
        self._sink.extend(np.atleast_1d(value).tolist())
        return value


class ReplayRng:
    """Hands out recorded uniforms in order, in the shapes asked; running out is an error."""

    def __init__(self, uniforms: Sequence[float]):
        self._left = list(uniforms)

    def random(self, size=None):
        n = 1 if size is None else int(np.prod(size))
        if n > len(self._left):
            raise ExactnessError("the rule asked for more uniforms than the engine drew")
        taken, self._left = self._left[:n], self._left[n:]
        return taken[0] if size is None else np.asarray(taken, dtype=np.float64).reshape(size)

    @property
    def unused(self) -> int:
        return len(self._left)


class Recorder:
    """Collects `VerifyPass`es. Not thread-safe; give each worker thread's engines one of their own
    (the slot scheduler's passes all run in its one worker thread).

    With `spill`, a directory, every pass is appended to `spill/audit-<pid>.pkl` instead of being kept
    in memory: how a server in another process (a Ray Serve replica, `serve --verifier --audit-dir`)
    is audited from outside; `Recorder.read(spill)` loads them back in order."""

    def __init__(self, spill: str | Path | None = None):
        self.passes: list[VerifyPass] = []
        self.spill = None
        if spill is not None:
            Path(spill).mkdir(parents=True, exist_ok=True)
            self.spill = Path(spill) / f"audit-{os.getpid()}.pkl"

    def _keep(self, p: VerifyPass) -> None:
        if self.spill is None:
            self.passes.append(p)
            return
        if not isinstance(p.key, (str, int)):  # an engine's state: its identity names the generation
            p = replace(p, key=f"{type(p.key).__name__}@{id(p.key):x}")
        with self.spill.open("ab") as f:
            pickle.dump(p, f, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def read(spill: str | Path) -> list[VerifyPass]:
        """Every pass spilled under `spill`, file by file (one per process), each in recorded order."""
        out: list[VerifyPass] = []
        for path in sorted(Path(spill).glob("audit-*.pkl")):
            with path.open("rb") as f:
                while True:
                    try:
                        out.append(pickle.load(f))
                    except (EOFError, pickle.UnpicklingError):  # the end, or a record cut by a killed process
                        break
        return out

    def rule(self, rule: Callable, *, key: Hashable, committed: np.ndarray, logits: np.ndarray,
             held: np.ndarray, seq: int = 0, greedy: bool, tree: bool = False, skipped: Sequence[int] = ()) -> Callable:
        """`rule` wrapped so that calling it records the pass. `held`: for a chain, the tokens the
        runtime holds after the pass (the rows are its last ones); for a tree, the tokens before the root."""
        committed = np.array(committed, dtype=np.int32)
        held = np.asarray(held, dtype=np.int32)
        m = len(logits)

        def recorded(draft, draft_probs_or_parents, rows, rng):
            uniforms: list[float] = []
            decision = rule(draft, draft_probs_or_parents, rows, None if rng is None else RecordingRng(rng, uniforms))
            if tree:
                parents = np.asarray(draft_probs_or_parents)
                depth = np.zeros(len(parents), dtype=np.int64)
                for i in range(1, len(parents)):
                    depth[i] = depth[parents[i]] + 1
                fed, positions, nodes, probs = np.asarray(draft), len(held) + depth, np.asarray(draft)[1:], None
            else:
                parents, fed, positions = None, held[len(held) - m:], np.arange(len(held) - m, len(held))
                nodes, probs = np.asarray(draft), draft_probs_or_parents
            self._keep(VerifyPass(key, seq, committed, fed.copy(), positions, nodes.copy(), probs,
                                  parents, logits, rows, greedy, uniforms,
                                  (list(decision[0]) if tree else int(decision[0]), int(decision[1])),
                                  tuple(int(j) for j in skipped)))
            return decision

        return recorded

    def engine_rule(self, rule: Callable, state, logits: np.ndarray, target, tree_lead: np.ndarray | None = None,
                    skipped: Sequence[int] = ()):
        """`rule` wrapped for one of `Engine`'s passes on `target`; a tree's pass also fed `tree_lead`
        (unseen committed tokens) as a chain before its root; `skipped`: rows the pass did not compute."""
        tree = tree_lead is not None
        held = np.concatenate([target.tokens, tree_lead]) if tree else target.tokens
        return self.rule(rule, key=state, committed=state.committed, logits=logits, held=held,
                         seq=target.seq, greedy=state.sampler.params.greedy, tree=tree, skipped=skipped)

    def by_key(self) -> dict[Hashable, list[VerifyPass]]:
        """The passes of each generation, in order (keyed by identity where the key is not hashable;
        the passes keep their keys alive, so an identity is not reused meanwhile)."""
        out: dict = {}
        for p in self.passes:
            key = p.key if getattr(p.key, "__hash__", None) is not None else id(p.key)
            out.setdefault(key, []).append(p)
        return out


# --- check 1: every emitted token is the rule's on the recorded rows, with no tolerance -------------

def reference_decision(p: VerifyPass) -> tuple:
    """The project's acceptance rule re-run on the recorded rows (sampling: with the recorded uniforms)."""
    if p.parents is None:
        if p.greedy:
            n, token = accept_greedy(p.draft, None, p.rows)
            return n, token
        rng = ReplayRng(p.uniforms)
        n, token = accept_sampling(p.draft, p.draft_probs, p.rows, rng)
    else:
        nodes = p._nodes()
        if p.greedy:
            path, token = accept_tree_greedy(nodes, p.parents, p.rows)
            return list(path), token
        rng = ReplayRng(p.uniforms)
        path, token = accept_tree_sampling(nodes, p.parents, p.rows, rng)
        n = list(path)
    if rng.unused:
        raise ExactnessError(f"the engine drew {rng.unused} uniforms the rule does not use")
    return n, token


def check_structure(p: VerifyPass, where: str) -> None:
    """The fed rows sit at their positions in the committed text (+ draft): what the runtime holds is
    what the engine claims to verify."""
    contexts = p.contexts()
    if len(contexts) != len(p.fed) or len(p.fed) != len(p.positions):
        raise ExactnessError(f"{where}: {len(p.logits)} rows for {len(p.fed)} fed tokens")
    for ctx, token, pos in zip(contexts, p.fed, p.positions):
        if pos != len(ctx) - 1 or ctx[-1] != token:
            raise ExactnessError(f"{where}: the row of token {int(token)} at position {int(pos)} is not the "
                                 f"committed text's token there (context of {len(ctx)} tokens ends {ctx[-3:]})")


def check_skipped(p: VerifyPass, where: str) -> None:
    """A row the pass did not compute must be one the rule cannot be swayed by: a point mass on its
    draft token after the grammar's mask (greedy: the only finite entry; sampling: probability 1)."""
    for j in p.skipped:
        if p.parents is not None or not 0 <= j < len(p.draft):
            raise ExactnessError(f"{where}: row {j} was skipped, but only a chain's drafted tokens may be")
        row, token = p.rows[j], int(p.draft[j])
        certain = (np.isfinite(row).sum() == 1 and np.isfinite(row[token])) if p.greedy else row[token] == 1.0
        if not certain:
            raise ExactnessError(f"{where}: row {j} was not computed, yet its processed row is not a point mass "
                                 f"on the drafted token {token}")


def check_decisions(passes: Sequence[VerifyPass], prompt: Sequence[int], emitted: Sequence[int]) -> int:
    """One generation's passes, in order: each committed context is prompt + what came before, each
    decision is the reference rule's on the recorded rows, and together they emit exactly `emitted`
    (the last pass may be cut by a stop). Returns the number of passes checked; raises ExactnessError."""
    text, emitted = [int(t) for t in prompt], [int(t) for t in emitted]
    n_prompt = len(text)
    if not passes:
        raise ExactnessError("no verify pass was recorded")
    for i, p in enumerate(passes):
        where = f"pass {i}"
        if p.committed.tolist() != text:
            raise ExactnessError(f"{where}: verified after {len(p.committed)} committed tokens that are not the "
                                 f"prompt + the {len(text) - n_prompt} tokens emitted before it")
        check_structure(p, where)
        check_skipped(p, where)
        expected = reference_decision(p)
        if tuple(expected) != tuple(p.decision):
            raise ExactnessError(f"{where}: the rule on the recorded rows gives {expected}, the engine took "
                                 f"{p.decision}")
        text += p.emitted()
        got = emitted[len(text) - n_prompt - len(p.emitted()):len(text) - n_prompt]
        last = i == len(passes) - 1
        if got != p.emitted()[:len(got)] or (not last and len(got) != len(p.emitted())):
            raise ExactnessError(f"{where}: emitted {got}, the rule's decision commits {p.emitted()}")
    if len(text) - n_prompt < len(emitted):
        raise ExactnessError(f"{len(emitted) - (len(text) - n_prompt)} emitted tokens came from no recorded pass")
    return len(passes)


# --- check 2: the rows belong to their committed context -------------------------------------------

class Fresh:
    """Fresh evaluations of a context on a one-sequence runtime (`decode`/`truncate`), at several
    batch shapes: in one batch (the reference); its last token alone; its tail one token at a time;
    its tail of j tokens in one batch after the rest (j = 2, 4, 8, 16: the sizes of verify passes);
    in chunks of three; padded with extra rows after it. The spread between the shapes is what
    batched arithmetic alone does to a row of this model on this machine."""

    TAIL = 8
    TAIL_BATCHES = (2, 4, 8, 16)
    PADS = (7, 16)

    def __init__(self, runtime, pool=None, chunks: Sequence[int] = (3,)):
        self.runtime = runtime
        self.pool = pool  # a several-sequence runtime (decode_batch): adds shapes that share passes and a pool
        # the whole prefix in passes of each of these sizes (a recurrent model's state carries the
        # arithmetic of every earlier pass: give it the pass sizes a generation used, e.g. 1 and k + 1)
        self.chunks = tuple(chunks)

    def _eval(self, pieces: Sequence[tuple[np.ndarray, int]], row: int = -1) -> np.ndarray:
        rt = self.runtime
        rt.truncate(0)
        out = None
        for piece, n_logits in pieces:
            if len(piece):
                out = rt.decode(piece, n_logits) if n_logits else (rt.decode(piece, 0), out)[1]
        rt.truncate(0)
        return out[row].astype(np.float64)

    def shapes(self, ctx: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The reference row and the rows at the other shapes."""
        ctx = np.asarray(ctx, dtype=np.int32)
        n = len(ctx)
        reference = self._eval([(ctx, 1)])
        tail = max(1, n - self.TAIL)
        others = [self._eval([(ctx[:-1], 0), (ctx[-1:], 1)]),
                  self._eval([(ctx[:tail], 0)] + [(ctx[j:j + 1], 1) for j in range(tail, n)]),
                  *(self._eval([(ctx[j:j + c], len(ctx[j:j + c])) for j in range(0, n, c)]) for c in self.chunks)]
        others += [self._eval([(ctx[:n - j], 0), (ctx[n - j:], j)]) for j in self.TAIL_BATCHES if j < n]
        others += [self._eval([(np.concatenate([ctx, ctx[-pad:]]), 1 + min(pad, n))], 0) for pad in self.PADS]
        if self.pool is not None:
            others += [self._shared(ctx, tail, 3), self._shared(ctx, n - 1, 3), self._shared(ctx, tail, 12),
                       self._shared(ctx, 1, 4), self._shared(ctx, max(1, n - 16), 24)]
        return reference, others

    def _shared(self, ctx: np.ndarray, tail: int, m: int) -> np.ndarray:
        """The context in sequence 0 of the pool, beside another sequence in the same passes: the head
        in one pass with it, then each tail token in a pass with m of its rows, all but one of which
        it rolls back (so the context's later cells fall out of position order, as slots' cells do)."""
        pool, other = self.pool, np.resize(ctx[::-1], len(ctx) + m * (len(ctx) - tail))
        pool.seq_clear(0)
        pool.seq_clear(1)
        try:
            row = pool.decode_batch([(1, other[:tail], 0), (0, ctx[:tail], 1)])[1][-1]
            for j in range(tail, len(ctx)):
                row = pool.decode_batch([(0, ctx[j:j + 1], 1), (1, other[tail + m * (j - tail):][:m], m)])[0][-1]
                pool.seq_truncate(1, pool.seq_n_past(1) - (m - 1))
        finally:
            pool.seq_clear(0)
            pool.seq_clear(1)
        return row.astype(np.float64)


@dataclass
class RowReport:
    rows: list[tuple[int, int, float, float]]  # (pass index, row index, |recorded - fresh|, that prefix's spread)
    bound: float                # the largest spread between the fresh shapes, over all the rows checked

    @property
    def max_deviation(self) -> float:
        return max(d for _, _, d, _ in self.rows)

    @property
    def beyond(self) -> list[tuple[int, int, float, float]]:
        """Rows further from their fresh evaluation than the bound: computed from another context."""
        return [r for r in self.rows if r[2] > self.bound]

    def __str__(self) -> str:
        own = sum(d <= s for _, _, d, s in self.rows)
        return (f"{len(self.rows)} rows: max |recorded - fresh| = {self.max_deviation:.3g}, measured batch-shape "
                f"spread = {self.bound:.3g} ({own} rows within their own prefix's spread)")


def check_rows(passes: Sequence[VerifyPass], fresh: Fresh, *, which: Callable[[int, VerifyPass], bool] | None = None,
               raise_on_failure: bool = True) -> RowReport:
    """Each raw row of the passes (those `which` picks; they may span several generations) against a
    fresh one-sequence evaluation of its committed prefix. The bound is the largest spread between the
    fresh batch shapes over the same rows: what batched arithmetic alone does, measured here and now."""
    results = []
    for i, p in enumerate(passes):
        if which is not None and not which(i, p):
            continue
        for r, ctx in enumerate(p.contexts()):
            if r in p.skipped:  # never computed: nothing to compare
                continue
            reference, others = fresh.shapes(ctx)
            spread = max(float(np.abs(o - reference).max()) for o in others)
            deviation = float(np.abs(p.logits[r].astype(np.float64) - reference).max())
            results.append((i, r, deviation, spread))
    if not results:
        raise ExactnessError("no rows to check")
    report = RowReport(results, max(s for *_, s in results))
    if raise_on_failure and report.beyond:
        i, r, d, _ = max(report.beyond, key=lambda x: x[2])
        raise ExactnessError(f"pass {i} row {r}: recorded logits differ from a fresh evaluation of its committed "
                             f"prefix by {d:.3g}, beyond the measured batch-shape spread {report.bound:.3g}: "
                             f"the row was computed from another context ({report})")
    return report
