"""Does libgomp's wait policy change what a 2-thread target pass costs? (session 14, issue 23 item 6)

    ROUNDS=3 python bench/omp_wait.py 0.05,0.5,1,3                      # every setting
    ROUNDS=6 python bench/omp_wait.py 0.3,1 default,active,spin30M      # the second run

llama.cpp's CPU backend is built with OpenMP here: between passes its worker thread spins, then sleeps.
Session 7 saw a pass slow by 10-20 % after 1-3 ms of main-thread work. This times single-row passes of
Qwen2.5-Coder-1.5B at 2 threads, 6 blocks x 9 passes per gap (gaps alternated), one process per
(setting, round), settings in alternated order per round; per setting the median over rounds of each
round's median pass, and CPU seconds per wall second (2.0: the worker never slept).
Settings: libgomp's default, GOMP_SPINCOUNT 3M / 30M, OMP_WAIT_POLICY ACTIVE (spin for good: not a
default for a laptop) and PASSIVE (sleep at once).
"""
import json, os, statistics, subprocess, sys, time

CHILD = r'''
import json, statistics, sys, time
import numpy as np
from edgespec.loader import LoadOptions, resolve
from edgespec.runtimes.llamacpp import LlamaCppRuntime
gaps = [float(g) for g in sys.argv[1].split(",")]
rt = LlamaCppRuntime(resolve("qwen2.5-coder-1.5b"), LoadOptions(n_ctx=512, n_threads=2).llamacpp())
ids = rt.tokenize("The quick brown fox jumps over the lazy dog and keeps running")
rt.decode(ids, 1)
def busy(ms):
    end, x = time.thread_time() + ms / 1e3, np.arange(64)
    while time.thread_time() < end:
        x = np.cumsum(x) % 7
passes = {g: [] for g in gaps}
c0 = time.process_time(); w0 = time.perf_counter()
for b in range(6):
    for g in gaps if b % 2 == 0 else gaps[::-1]:
        rt.truncate(len(ids))
        for i in range(10):
            busy(g)
            t = time.perf_counter()
            rt.decode([ids[i % len(ids)]], 1)
            if i:
                passes[g].append(time.perf_counter() - t)
cpu = time.process_time() - c0; wall = time.perf_counter() - w0
print(json.dumps({"pass_ms": {str(g): 1e3 * statistics.median(p) for g, p in passes.items()},
                  "cpu_per_wall": cpu / wall}))
'''
settings = {"default": {}, "spin3M": {"GOMP_SPINCOUNT": "3000000"}, "spin30M": {"GOMP_SPINCOUNT": "30000000"},
            "active": {"OMP_WAIT_POLICY": "ACTIVE"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(settings)
gaps = sys.argv[1] if len(sys.argv) > 1 else "0.05,0.5,1,3"
res = {k: [] for k in only}
for r in range(int(os.environ.get("ROUNDS", "3"))):
    order = only if r % 2 == 0 else only[::-1]
    for name in order:
        env = dict(os.environ, **settings[name])
        out = subprocess.run([sys.executable, "-c", CHILD, gaps], env=env, capture_output=True, text=True, cwd="/tmp")
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
        print(r, name, line, flush=True)
        try: res[name].append(json.loads(line))
        except Exception: pass
for name, runs in res.items():
    if runs:
        gs = runs[0]["pass_ms"].keys()
        print(name, {g: round(statistics.median(x["pass_ms"][g] for x in runs), 2) for g in gs},
              "cpu/wall", round(statistics.median(x["cpu_per_wall"] for x in runs), 2))
