"""Cold-cache timings (session 24 probe): each try after streaming 100 MB through the caches, as a
target pass does, then the same try again back to back. Contexts: the race's prompts with plain's
SmolLM2 outputs (bench/replay-s21-smollm2/texts-smollm2.json).

    python bench/between-passes-s24/probe_cold.py
"""
import json
import statistics
import time
from bisect import bisect_right

import numpy as np

from edgespec.bench.race import shipped_items, structured_items
from edgespec.bench.run import setups
from edgespec.drafters.lookup import PromptLookupDrafter
from edgespec.drafters.suffix import SuffixDrafter, SuffixHistory
from edgespec.engine import Engine
from edgespec.models import store
from edgespec.sampling import Sampler, SamplingParams

[setup] = setups("smollm2")
engine = Engine.load(store.resolve(setup.target), None, n_ctx=4096, n_threads=1)
texts = json.load(open("bench/replay-s21-smollm2/texts-smollm2.json"))
items = {i.id: i for i in shipped_items(None) + structured_items()}
contexts = []
for pid, out in texts.items():
    full = np.array(list(engine.prompt_tokens(items[pid].messages)) + list(out), dtype=np.int32)
    contexts += [full[:n] for n in range(len(full) - len(out) + 1, len(full), 7)]
buf = np.ones(100 << 20, dtype=np.uint8)
sampler = Sampler(SamplingParams(temperature=0), 0)
history = SuffixHistory()
for out in list(texts.values())[:6]:
    history.add(np.array(out, dtype=np.int32))


def timeit(label, f, n=300):
    rng = np.random.default_rng(0)
    hot, cold = [], []
    for _ in range(n):
        c = contexts[int(rng.integers(len(contexts)))]
        buf.sum()
        t = time.perf_counter(); f(c); cold.append(time.perf_counter() - t)
        t = time.perf_counter(); f(c); hot.append(time.perf_counter() - t)
    print(f"{label:28s} cold {1e6 * statistics.median(cold):7.1f} us  hot {1e6 * statistics.median(hot):6.1f} us")


t, h = np.ones(16), np.ones(16)
edges, edge_list, conf = np.array([0.2, 0.4, 0.6, 0.8, 0.95]), [0.2, 0.4, 0.6, 0.8, 0.95], np.array([0.5, 0.7, 0.9])


def slice_add(c):
    t[0:2] += 1
    h[0:1] += 1


def loop_add(c):
    for i in range(0, 2):
        t[i] += 1
    h[0] += 1


def add_at(c):
    b = np.searchsorted(edges, conf[:2], side="right")
    np.add.at(t, b, 1.0)
    np.add.at(h, b[:1], 1.0)


def bisect_loop(c):
    for i, x in enumerate(conf[:2].tolist()):
        b = bisect_right(edge_list, x)
        t[b] += 1.0
        if i < 1:
            h[b] += 1.0


lookup, suffix = PromptLookupDrafter(), SuffixDrafter(history)
for label, f in [("lookup ask", lambda c: lookup.propose(c, 16, sampler)),
                 ("suffix ask", lambda c: suffix.propose(c, 16, sampler)),
                 ("two slice adds", slice_add), ("the same, a loop", loop_add),
                 ("searchsorted + np.add.at x2", add_at), ("the same, bisect and a loop", bisect_loop),
                 ("nothing", lambda c: None)]:
    timeit(label, f)
