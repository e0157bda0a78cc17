"""Do auto's 1-row passes cost more than plain's? Prompts where auto drafts nothing, ar/auto alternated."""
import sys, time, statistics
import numpy as np
import edgespec.runtimes.llamacpp as lc
from edgespec.bench.race import edgespec_run, shipped_items
from edgespec.bench.run import setups
from edgespec.engine import Engine
from edgespec.models import store
ids_wanted = sys.argv[1].split(","); REPEATS = int(sys.argv[2]); model = sys.argv[3] if len(sys.argv) > 3 else "smollm2"
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
[setup] = setups(model)
engine = Engine.load(store.resolve(setup.target), setup.draft_path(), n_ctx=4096, n_threads=threads, trees=False)
engine.cost_profile()
decode, passes = lc.ll.llama_decode, []
def timed(ctx, batch):
    t = time.perf_counter(); rc = decode(ctx, batch)
    if ctx == engine.target._ctx: passes.append((t, time.perf_counter() - t, batch.n_tokens))
    return rc
lc.ll.llama_decode = timed
items = [i for i in shipped_items(None) if i.id in ids_wanted]
rows = {"ar": [], "auto": []}; pairs = []
for rep in range(REPEATS):
    for item in items:
        ids = engine.prompt_tokens(item.messages)
        got = {}
        for s in (("ar", "auto") if rep % 2 == 0 else ("auto", "ar")):
            passes.clear(); time.sleep(0.3)
            out = edgespec_run(engine, s, s, None, ids, [], 96)
            one = [p[1] for p in passes[1:] if p[2] == 1]
            r = passes[1:]; span = r[-1][0] + r[-1][1] - r[0][0]
            got[s] = (statistics.mean(one), len(one), len(r), span, (span - sum(p[1] for p in r)) / len(r), out["chosen"])
        pairs.append(got)
for s in ("ar", "auto"):
    print(s, "1-row pass ms: %.3f" % (1e3 * statistics.mean(g[s][0] for g in pairs)), "between ms/round %.3f" % (1e3 * statistics.mean(g[s][4] for g in pairs)))
r = [g["auto"][0] / g["ar"][0] for g in pairs]
boot = np.random.default_rng(0); b = [np.exp(np.mean(np.log(boot.choice(r, len(r))))) for _ in range(2000)]
print("auto/ar 1-row pass: geomean %.4f  90%% %.4f-%.4f  n=%d" % (np.exp(np.mean(np.log(r))), *np.percentile(b, [5, 95]), len(r)))
sp = [g["auto"][3] / g["ar"][3] * g["ar"][2] / g["auto"][2] for g in pairs]
print("auto/ar span per round: geomean %.4f" % np.exp(np.mean(np.log(sp))))
print("chosen (auto):", {k for g in pairs for k in g["auto"][5]})
