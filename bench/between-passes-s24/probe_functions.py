"""Per-function CPU time between passes, auto vs ar, SmolLM2 chat prompts (session 24 probe)."""
import time, sys, collections, functools
import numpy as np
import edgespec.runtimes.llamacpp as lc
from edgespec.bench.race import edgespec_run, shipped_items
from edgespec.bench.run import setups
from edgespec.engine import Engine
import edgespec.engine as E
from edgespec.models import store
import edgespec.policy as P
import edgespec.drafters.lookup as L
import edgespec.drafters.suffix as S
import edgespec.sampling as SA
import edgespec.stats as ST

acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(owner, name, label=None):
    f = getattr(owner, name); label = label or f"{getattr(owner,'__name__',owner)}.{name}"
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t; cnt[label] += 1
    setattr(owner, name, g)

for owner, name in [(P.AdaptivePolicy, "choose"), (P.AdaptivePolicy, "observe"), (L.PromptLookupDrafter, "propose"),
                    (S.SuffixDrafter, "propose"), (P.ShadowScorer, "add"), (P.ShadowScorer, "observe"),
                    (P.AdaptivePolicy, "rate_proposals"), (P.AdaptivePolicy, "chain_speeds"),
                    (Engine, "propose"), (Engine, "verify_step"), (Engine, "commit"), (Engine, "accept_step"),
                    (Engine, "verify_accept"), (Engine, "verify_rows"), (P.FixedPolicy, "choose"),
                    (P.AdaptivePolicy, "model_speeds"), (P.DecayedRates, "decay_step"), (P.AcceptanceEstimate, "record"),
                    (P.ConfidenceCalibration, "record"), (P.ConfidenceCalibration, "rates"), (P.OnlineCosts, "observe"),
                    (P.OnlineCosts, "curve"), (ST.GenerationStats, "record_round"), (P.AdaptivePolicy, "_reach"),
                    (P.EvidenceEstimate, "shrunk"), (P.AdaptivePolicy, "rates_of")]:
    wrap(owner, name)
wrap(lc.ll, "llama_decode", "llama_decode")
import edgespec.drafters.draft_model as DM
wrap(DM.DraftModelDrafter, "unseen")
wrap(P, "exclusive")

[setup] = setups("smollm2")
engine = Engine.load(store.resolve(setup.target), setup.draft_path(), n_ctx=4096, n_threads=1, trees=False)
engine.cost_profile()
items = [i for i in shipped_items(None) if i.category == "chat"]
res = {}
for rep in range(2):
    for mode in (("ar", "auto") if rep % 2 == 0 else ("auto", "ar")):
        acc.clear(); cnt.clear(); rounds = 0
        for item in items:
            ids = engine.prompt_tokens(item.messages)
            out = edgespec_run(engine, mode, mode, None, ids, [], 96)
            rounds += sum(out["passes_by_rows"].values()) if out["passes_by_rows"] else 0
        res.setdefault(mode, []).append((rounds, dict(acc), dict(cnt)))
for mode, runs in res.items():
    print("==", mode)
    keys = sorted(set().union(*[r[1] for r in runs]))
    for k in keys:
        print(f"  {k:40s}", "  ".join(f"{1e6*r[1].get(k,0)/max(r[0],1):8.1f}us/rnd n={r[2].get(k,0)}" for r in runs))
    print("  rounds", [r[0] for r in runs])
