#!/usr/bin/env python3
"""The GPU benchmark: on a bare CUDA machine, build, generate models, measure, write JSON and markdown.

    python3 bench/gpu/run.py                          # every phase, Qwen2.5 0.5B / 1.5B / 7B shapes
    python3 bench/gpu/run.py --phases build,install   # a first call when the build needs its own
    python3 bench/gpu/run.py --sizes tiny --max-tokens 16 --repeats 1 --threads 1   # CPU, as CI runs it

Phases, each with a time budget (printed as it goes; a phase that runs out of time leaves the rest
of its points marked skipped, and the whole run stops at --deadline-s):

  build     llama-cpp-python from the carried, stripped sdist (bench/gpu/prepare.sh) with
            -DGGML_CUDA=on for this GPU's architecture only; skipped where there is no GPU or nvcc,
            or where the installed build already offloads
  install   the carried wheels edgespec lacks, then edgespec itself (editable, from this tree)
  models    random-weight GGUFs of real shapes through edgespec's exporters (exporters/random_checkpoint)
            as f16, with a lower-bit copy of each as its self-draft
  doctor    `edgespec doctor --json`, checked against what the machine is
  profile   `edgespec profile --curve 17 --tree-widths 1,2,3,4`: verify cost for k = 0..16, tree widths
  generate  plain, draft k = 1..8, lookup, suffix and auto on each size (medians of --repeats)
  guard     `edgespec plan` and `generate --budget --gpu-budget` against NVML readings of the process
  report    $OUT/gpu_bench.json and $OUT/gpu_bench.md ($OUT defaults to bench/gpu/out)

Only the standard library is imported before the install phase; phases after an install run in a
fresh interpreter (an editable install takes effect at start-up). Everything the run makes lives in
--work (bench/gpu/.work, git-ignored), so a second call on the same machine reuses the build and the
models.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CARRY = HERE / "carry"
LLAMA_VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{LLAMA_VERSION}-stripped.tar.gz"
NO_AMX = "-U__AMX_INT8__ -U__AMX_TILE__ -U__AMX_BF16__"  # as scripts/install.sh (see the README on AMX)
# Only the libraries the Python package loads: no tools, examples, tests, server, mtmd, TLS, ccache.
BUILD_FLAGS = ("-DGGML_CUDA=on", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DGGML_CCACHE=OFF", "-DGGML_CUDA_NCCL=OFF")

PHASES = ("build", "install", "models", "doctor", "profile", "generate", "guard", "report")
BUDGET_S = {"build": 560, "install": 90, "models": 180, "doctor": 30, "profile": 120, "generate": 240,
            "guard": 150, "report": 10}
GPU_SIZES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
DRAFT_KS = tuple(range(1, 9))
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.",
    "def moving_average(values, window):\n    total = sum(values[:window])\n    out = [total / window]\n"
    "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n",
)


# --- the run: progress, time budgets, results ---------------------------------------------------

class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.work).resolve()
        self.out = Path(args.out).resolve()
        self.partial = self.work / "results.partial.json"
        self.t0 = time.monotonic()
        self.results: dict = {"command": "python3 bench/gpu/run.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "phases": {}, "checks": []}
        self.current = None
        if self.partial.is_file() and not args.fresh:  # an earlier call's phases (the build) stay in the report
            previous = json.loads(self.partial.read_text())
            if args.resume:  # a restart after the install: the deadline counts the first interpreter's time
                self.t0 -= previous.get("elapsed_s", 0.0)
            else:
                previous["command"] = f"{previous['command']}; then {self.results['command']}"
            self.results = previous

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.args.deadline_s - self.elapsed()

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", flush=True)

    def check(self, name: str, ok: bool | None, detail: str = "") -> None:
        """A finding: ok True/False, or None where it does not apply here (the detail says why)."""
        self.results["checks"].append({"phase": self.current, "name": name, "ok": ok, "detail": detail})
        mark = {True: "ok", False: "FAILED", None: "n/a"}[ok]
        self.log(f"  check {mark}: {name}{' - ' + detail if detail else ''}")

    def budget(self, phase: str) -> float:
        return max(0.0, min(BUDGET_S[phase], self.left()))

    def phase(self, name: str, fn) -> None:
        budget = self.budget(name)
        if budget < 2:
            self.results["phases"][name] = {"status": "skipped", "reason": "the run's deadline passed", "seconds": 0.0,
                                            "budget_s": BUDGET_S[name]}
            self.log(f"phase {name}: skipped (deadline)")
            return
        self.log(f"phase {name} (budget {budget:.0f}s)")
        self.current = name
        self.results["checks"] = [c for c in self.results["checks"] if c.get("phase") != name]  # a re-run replaces them
        start = time.monotonic()
        entry: dict = {"budget_s": round(budget)}
        try:
            reason = fn(time.monotonic() + budget)
            entry.update(status="skipped" if reason else "ok", **({"reason": reason} if reason else {}))
        except Exception as exc:  # a failed phase is a finding; the later ones still run
            entry.update(status="failed", reason=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc()[-3000:])
            self.log(f"phase {name} FAILED: {type(exc).__name__}: {exc}")
        entry["seconds"] = round(time.monotonic() - start, 1)
        self.results["phases"][name] = entry
        self.log(f"phase {name}: {entry['status']} in {entry['seconds']}s" + (f" ({entry['reason']})"
                                                                              if entry.get("reason") else ""))
        self.save_partial()

    def save_partial(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        self.partial.write_text(json.dumps(self.results, indent=1, default=str))

    def env(self) -> dict:
        """Environment for every edgespec process: caches in the work folder, llama.cpp quiet."""
        return {**os.environ, "EDGESPEC_HOME": str(self.work / "home"), "PYTHONUNBUFFERED": "1"}

    def edgespec(self, *argv: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgespec.cli", *argv], capture_output=True, text=True,
                              timeout=max(5.0, timeout), env=self.env(), cwd=self.work)


def sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kw)


# --- the machine, without edgespec (it may not be installed yet) ------------------------------

def nvidia_gpus() -> list[dict]:
    """GPUs as nvidia-smi lists them (name, memory MiB, compute capability); [] without a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = sh(["nvidia-smi", "--query-gpu=name,memory.total,compute_cap,driver_version",
                   "--format=csv,noheader,nounits"], timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"name": parts[0], "memory_mib": parts[1], "compute_cap": parts[2], "driver": parts[3]})
    return gpus


def describe_machine() -> dict:
    mem = None
    try:
        mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        pass
    cpu = None
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    nvcc = shutil.which("nvcc")
    nvcc_version = None
    if nvcc:
        m = re.search(r"release (\d+\.\d+)", sh([nvcc, "--version"]).stdout)
        nvcc_version = m.group(1) if m else None
    return {"platform": platform.platform(), "python": sys.version.split()[0], "cpu": cpu,
            "cores": os.cpu_count(), "ram_bytes": mem, "gpus": nvidia_gpus(), "nvcc": nvcc_version}


def cuda_arch(args) -> str | None:
    if args.cuda_arch:
        return args.cuda_arch
    gpus = nvidia_gpus()
    return gpus[0]["compute_cap"].replace(".", "") if gpus and gpus[0]["compute_cap"] else None


def toolkit_dirs() -> list[Path]:
    """The CUDA toolkit's root(s): nvcc's, $CUDA_PATH, /usr/local/cuda."""
    roots = [Path(shutil.which("nvcc")).resolve().parents[1]] if shutil.which("nvcc") else []
    roots += [Path(p) for p in (os.environ.get("CUDA_PATH"), "/usr/local/cuda") if p]
    return [r for i, r in enumerate(roots) if r.is_dir() and r not in roots[:i]]


def cublas_dirs(search: list[Path] | None = None) -> tuple[Path, Path] | None:
    """(include dir, lib dir) of a cuBLAS outside the toolkit: the nvidia-cublas wheel torch installs
    (site-packages/nvidia/cu13/{include,lib}, or nvidia/cublas/ for CUDA 12). A toolkit made of nvcc
    alone (as on the machines this runs on) has no cuBLAS, and ggml-cuda links it."""
    import site

    search = search if search is not None else [Path(p) for p in (*site.getsitepackages(), site.getusersitepackages())]
    for base in search:
        for header in sorted(base.glob("nvidia/*/include/cublas_v2.h")):
            lib = header.parents[1] / "lib"
            if list(lib.glob("libcublas.so*")) and list(lib.glob("libcublasLt.so*")):
                return header.parent, lib
    return None


def driver_library() -> Path | None:
    """The NVIDIA driver's libcuda.so.1 (ldconfig's cache, else the usual folders)."""
    listed = sh(["ldconfig", "-p"]).stdout if shutil.which("ldconfig") else ""
    m = re.search(r"libcuda\.so\.1 \(libc6,x86-64\) => (\S+)", listed)
    candidates = [Path(m.group(1))] if m else []
    candidates += [Path(p) / "libcuda.so.1" for p in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64",
                                                       "/usr/lib/wsl/lib")]
    return next((c for c in candidates if c.exists()), None)


def cuda_flags(work: Path, search: list[Path] | None = None, driver: Path | None | bool = True) -> tuple[list[str], dict]:
    """CMake flags for ggml-cuda's libraries, where a toolkit made of nvcc alone (as on the machines
    this runs on) lacks them: cuBLAS from the nvidia-cublas wheel torch installs (headers on the
    include path, unversioned links in a shim folder, since find_library wants libcublas.so), and the
    driver's libcuda.so.1 linked as libcuda.so (no toolkit stubs); without a driver, VMM is off."""
    cxx_flags, cuda_includes, links = NO_AMX, "", {}
    note: dict = {"cublas": "toolkit", "cuda_driver": "toolkit"}
    extra: list[str] = []
    toolkits = toolkit_dirs()
    if not any((r / "include" / "cublas_v2.h").is_file() for r in toolkits):
        found = cublas_dirs(search)
        if found is None:
            note["cublas"] = "not found (neither the toolkit nor an nvidia-cublas wheel has cublas_v2.h)"
        else:
            include, lib = found
            for real in lib.glob("libcublas*.so.*"):
                stem = real.name.split(".so")[0]
                links.update({f"{stem}.so": real, real.name: real})
            cxx_flags += f" -I{include}"
            cuda_includes = f"-I{include}"
            note.update(cublas=f"nvidia-cublas wheel: {include.parent}", library_dir=str(lib))
    if not any(list(r.glob("lib64/libcuda.so")) + list(r.glob("lib64/stubs/libcuda.so")) for r in toolkits):
        libcuda = driver_library() if driver is True else (driver or None)
        if libcuda is not None:
            links["libcuda.so"] = libcuda
            note["cuda_driver"] = f"driver library {libcuda}"
        else:
            extra.append("-DGGML_CUDA_NO_VMM=ON")  # VMM is the only part that links libcuda directly
            note["cuda_driver"] = "no libcuda.so.1 found: built with GGML_CUDA_NO_VMM"
    flags = [*BUILD_FLAGS, *extra, f"-DCMAKE_C_FLAGS='{NO_AMX}'", f"-DCMAKE_CXX_FLAGS='{cxx_flags}'"]
    if cuda_includes:
        flags.append(f"-DCMAKE_CUDA_FLAGS='{cuda_includes}'")
    if links:
        shim = work / "cuda-shim"
        shutil.rmtree(shim, ignore_errors=True)
        shim.mkdir(parents=True)
        for name, real in links.items():
            (shim / name).symlink_to(real)
        flags.append(f"-DCMAKE_LIBRARY_PATH={shim}")
    return flags, note


def runtime_library_dirs() -> list[str]:
    """Folders the dynamic loader needs for a CUDA build: the wheels' cuBLAS, the toolkit's cudart."""
    dirs = []
    found = cublas_dirs()
    if found:
        dirs.append(str(found[1]))
    dirs += [str(r / "lib64") for r in toolkit_dirs() if list((r / "lib64").glob("libcudart.so*"))]
    return dirs


def ensure_library_path(argv: list[str]) -> None:
    """Start again with LD_LIBRARY_PATH naming those folders: the loader reads it only at start-up, and
    llama.cpp's CUDA library is loaded in this process (generate phase) and in the edgespec children."""
    if not nvidia_gpus():  # no GPU: llama.cpp runs its CPU build, nothing CUDA to load
        return
    have = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    missing = [d for d in runtime_library_dirs() if d not in have]
    if missing and not os.environ.get("EDGESPEC_GPU_BENCH_LIBS"):
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join(missing + have), "EDGESPEC_GPU_BENCH_LIBS": "1"}
        print(f"bench/gpu/run.py: restarting with LD_LIBRARY_PATH += {':'.join(missing)}", flush=True)
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def pip_command() -> list[str]:
    """pip of this interpreter, else the carried pip wheel run as a zip (a venv made without pip)."""
    if sh([sys.executable, "-m", "pip", "--version"]).returncode == 0:
        return [sys.executable, "-m", "pip"]
    wheel = next(iter(sorted((CARRY / "wheels").glob("pip-*.whl"))), None)
    if wheel is None:
        raise RuntimeError(f"{sys.executable} has no pip and {CARRY / 'wheels'} holds no pip wheel "
                           "(run bench/gpu/prepare.sh where the network is)")
    return [sys.executable, str(wheel / "pip")]


def llama_offloads() -> tuple[bool | None, str]:
    """Whether the installed llama-cpp-python can offload to a GPU (asked in a fresh process)."""
    done = sh([sys.executable, "-c", "import llama_cpp, sys; sys.stdout.write(str(bool("
               "llama_cpp.llama_supports_gpu_offload())) + ' ' + llama_cpp.__version__)"], timeout=120)
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["not importable"])[-1]
    offload, version = done.stdout.split()
    return offload == "True", version


# --- phases: build and install ------------------------------------------------------------------

def phase_build(run: Run, until: float) -> str | None:
    args = run.args
    arch = cuda_arch(args)
    flags, cublas = cuda_flags(run.work)
    cmake_args = " ".join((*flags, f"-DCMAKE_CUDA_ARCHITECTURES={arch or 'native'}"))
    info = run.results["build"] = {"cmake_args": cmake_args, "cuda_arch": arch, "sdist": str(CARRY / SDIST), **cublas}
    offload, version = llama_offloads()
    info["installed_before"] = {"gpu_offload": offload, "version": version}
    if args.build == "no":
        return "--build no"
    if args.build == "auto":
        if not shutil.which("nvcc"):
            return f"no nvcc on this machine: using the installed llama-cpp-python ({version}, gpu_offload {offload})"
        if not arch:
            return "no NVIDIA GPU visible to nvidia-smi: nothing to build for"
        if offload:
            return f"the installed llama-cpp-python {version} already offloads to the GPU"
    sdist = CARRY / SDIST
    if not sdist.is_file():
        raise RuntimeError(f"{sdist} is missing: run bench/gpu/prepare.sh where the network is, and carry bench/gpu/carry")
    wheels = run.work / "wheels" / re.sub(r"[^A-Za-z0-9]+", "_", cmake_args)[:120]
    built = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_VERSION}-*.whl"))
    if built:
        info["wheel"] = str(built[-1])
        info["reused"] = True
        run.log(f"  reusing {built[-1].name} built earlier with these flags")
    else:
        src = run.work / "src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
        source = next(src.glob("llama_cpp_python-*"))
        tmp = wheels.with_name(wheels.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if sh([sys.executable, "-c", "import scikit_build_core"]).returncode != 0:  # the sdist's build backend
            done = sh([*pip_command(), "install", "--quiet", "--no-index", "--find-links", str(CARRY / "wheels"),
                       "scikit-build-core"])
            if done.returncode != 0:
                raise RuntimeError(f"installing scikit-build-core from {CARRY / 'wheels'} failed: {done.stderr[-400:]}")
        env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4),
               "FORCE_CMAKE": "1"}
        argv = [*pip_command(), "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index", "--find-links",
                str(CARRY / "wheels"), "-w", str(tmp), str(source)]
        run.log(f"  CMAKE_ARGS={cmake_args}")
        log_file = run.work / "build.log"
        info["log"] = str(log_file)
        start = time.monotonic()
        with log_file.open("w") as log:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            last = 0.0
            for line in proc.stdout:  # ninja prints "[n/N] ..." per object: show one every 15 s
                log.write(line)
                if time.monotonic() - last > 15 and re.match(r"\s*\[\d+/\d+\]", line):
                    last = time.monotonic()
                    run.log(f"  build {line.strip()[:100]}")
                if time.monotonic() > until:
                    proc.kill()
                    raise RuntimeError(f"the build ran past its budget; see {log_file}")
            rc = proc.wait()
        info["build_s"] = round(time.monotonic() - start, 1)
        if rc != 0:
            raise RuntimeError(f"pip wheel failed (exit {rc}); last lines: "
                               + " | ".join(log_file.read_text().splitlines()[-8:]))
        wheels.mkdir(parents=True, exist_ok=True)
        for whl in tmp.glob("*.whl"):
            shutil.move(str(whl), wheels / whl.name)
        shutil.rmtree(tmp, ignore_errors=True)
        info["wheel"] = str(next(wheels.glob("*.whl")))
        info["wheel_bytes"] = Path(info["wheel"]).stat().st_size
    done = sh([*pip_command(), "install", "--no-deps", "--force-reinstall", info["wheel"]])
    if done.returncode != 0:
        raise RuntimeError(f"installing the wheel failed: {done.stderr.strip()[-500:]}")
    offload, version = llama_offloads()
    info["installed_after"] = {"gpu_offload": offload, "version": version}
    run.check("the CUDA build offloads to the GPU", bool(offload), f"llama-cpp-python {version}")
    return None


def edgespec_location() -> str | None:
    done = sh([sys.executable, "-c", "import edgespec, edgespec.runtimes, sys; sys.stdout.write(edgespec.__file__)"])
    return done.stdout.strip() if done.returncode == 0 else None


def runtime_requirements() -> list[str]:
    """edgespec's run-time dependencies from pyproject.toml, but llama-cpp-python (built above)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if not d.lower().startswith("llama-cpp-python")]


def phase_install(run: Run, until: float) -> str | None:
    info = run.results["install"] = {}
    where = edgespec_location()
    info["edgespec_before"] = where
    mine = where is not None and Path(where).resolve().is_relative_to(ROOT)
    if run.args.install == "no" or (run.args.install == "auto" and mine):
        return "--install no" if run.args.install == "no" else f"edgespec is already installed from this tree ({where})"
    pip = pip_command()
    wheels = CARRY / "wheels"
    offline = ["--no-index", "--find-links", str(wheels)] if wheels.is_dir() else []
    for reqs in (["setuptools>=69", "wheel"], runtime_requirements()):
        done = sh([*pip, "install", "--quiet", *offline, *reqs], timeout=max(10, until - time.monotonic()))
        if done.returncode != 0:  # one at a time, so one missing wheel does not stop the others
            missing = []
            for req in reqs:
                if sh([*pip, "install", "--quiet", *offline, req]).returncode != 0:
                    missing.append(req)
            info.setdefault("not_installed", []).extend(missing)
            run.log(f"  could not install {', '.join(missing)} (not among the carried wheels?)")
    done = sh([*pip, "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", str(ROOT)])
    if done.returncode != 0:
        raise RuntimeError(f"pip install -e failed: {done.stderr.strip()[-800:]}")
    info["edgespec_after"] = edgespec_location()
    run.check("edgespec imports from this tree after the install", bool(info["edgespec_after"]),
              str(info["edgespec_after"]))
    return None


# --- phases after the install (edgespec importable) ----------------------------------------------

def model_paths(run: Run, size: str) -> dict[str, Path]:
    d = run.work / "models" / f"{size}-s{run.args.seed}"
    return {"dir": d, "target": d / f"{size}.{run.args.target_quant}.gguf", "draft": d / f"{size}.{run.args.draft_quant}.gguf",
            "done": d / "made.json"}


def phase_models(run: Run, until: float) -> str | None:
    from edgespec.exporters.gguf_export import export_gguf
    from edgespec.exporters.random_checkpoint import config_for, random_checkpoint

    made = run.results.setdefault("models", {})
    for size in run.args.sizes:
        paths = model_paths(run, size)
        if paths["done"].is_file() and paths["target"].is_file() and paths["draft"].is_file():
            made[size] = json.loads(paths["done"].read_text())
            run.log(f"  {size}: reusing {paths['dir']}")
            continue
        if time.monotonic() > until:
            made[size] = {"status": "skipped", "reason": "time budget"}
            continue
        start = time.monotonic()
        shutil.rmtree(paths["dir"], ignore_errors=True)
        ckpt = random_checkpoint(size, paths["dir"] / "checkpoint", seed=run.args.seed)
        artifacts = export_gguf(ckpt, paths["dir"], [run.args.target_quant, run.args.draft_quant], stem=size,
                                n_threads=run.args.threads)
        entry = {"status": "ok", "config": config_for(size), "n_params": ckpt.n_params(),
                 "target": str(artifacts.files[run.args.target_quant]), "draft": str(artifacts.files[run.args.draft_quant]),
                 "target_bytes": artifacts.files[run.args.target_quant].stat().st_size,
                 "draft_bytes": artifacts.files[run.args.draft_quant].stat().st_size,
                 "tokenizer_parity": artifacts.tokenizer_parity, "seconds": round(time.monotonic() - start, 1)}
        paths["done"].write_text(json.dumps(entry, indent=1))
        made[size] = entry
        run.log(f"  {size}: {entry['n_params'] / 1e6:,.1f}M parameters, target {_gib(entry['target_bytes'])}, "
                f"draft {_gib(entry['draft_bytes'])}, in {entry['seconds']}s")
    return None


def ready_sizes(run: Run) -> list[str]:
    return [s for s in run.args.sizes if run.results.get("models", {}).get(s, {}).get("status") == "ok"]


def phase_doctor(run: Run, until: float) -> str | None:
    done = run.edgespec("doctor", "--json", timeout=until - time.monotonic())
    if done.returncode != 0:
        raise RuntimeError(f"edgespec doctor --json exited {done.returncode}: {done.stderr.strip()[-500:]}")
    doc = json.loads(done.stdout)
    run.results["doctor"] = doc
    gpus = nvidia_gpus()
    devices = doc["gpus"]["devices"]
    if gpus:
        run.check("doctor sees the GPU through NVML", doc["gpus"]["status"] == "ok",
                  f"status {doc['gpus']['status']}: {doc['gpus'].get('reason')}")
        run.check("doctor's compute capability matches nvidia-smi", bool(devices) and
                  devices[0].get("compute_capability") == gpus[0]["compute_cap"],
                  f"doctor {devices[0].get('compute_capability') if devices else None}, nvidia-smi {gpus[0]['compute_cap']}")
        run.check("llama.cpp reports GPU offload and a CUDA backend", bool(doc["llama_cpp"]["gpu_offload"]) and
                  "CUDA" in doc["llama_cpp"]["backends"], f"backends {doc['llama_cpp']['backends']}")
        run.check("default GPU layers is all (-1)", doc["gpu_layers"] == -1, f"gpu_layers {doc['gpu_layers']}")
        run.check("device key names the GPU", doc["device_key"].startswith("cuda-"), doc["device_key"])
        run.check("memory kind is discrete", doc["memory_kind"] == "discrete", doc["memory_kind"])
    else:
        run.check("doctor reports no usable NVIDIA GPU", doc["gpus"]["status"] in ("none", "unavailable"),
                  f"status {doc['gpus']['status']}: {doc['gpus'].get('reason')}")
        run.check("no GPU: default GPU layers 0 and a cpu device key", doc["gpu_layers"] == 0 and
                  doc["device_key"].startswith("cpu-"), f"gpu_layers {doc['gpu_layers']}, key {doc['device_key']}")
    return None


def _common_flags(run: Run) -> list[str]:
    return ["--ctx", str(run.args.ctx)] + (["--threads", str(run.args.threads)] if run.args.threads else [])


def phase_profile(run: Run, until: float) -> str | None:
    profiles = run.results.setdefault("profile", {})
    for size in ready_sizes(run):
        left = until - time.monotonic()
        if left < 5:
            profiles[size] = {"status": "skipped", "reason": "time budget"}
            continue
        m = run.results["models"][size]
        done = run.edgespec("profile", "--target", m["target"], "--draft", m["draft"], "--refresh", "--json",
                            "--curve", str(run.args.curve), "--tree-widths", "1,2,3,4", *_common_flags(run),
                            timeout=left)
        if done.returncode != 0:
            profiles[size] = {"status": "failed", "reason": done.stderr.strip()[-500:]}
            run.check(f"{size}: edgespec profile runs", False, profiles[size]["reason"])
            continue
        prof = json.loads(done.stdout)
        profiles[size] = {"status": "ok", **prof}
        (run.out / f"profile-{size}.json").parent.mkdir(parents=True, exist_ok=True)
        (run.out / f"profile-{size}.json").write_text(json.dumps(prof, indent=1))
        steps = prof["curve"]["verify_steps"]
        run.log(f"  {size}: one step {prof['curve']['verify_s']['1'] * 1000:.2f} ms; verify of 17 = "
                f"{steps.get(str(run.args.curve), float('nan'))} steps; draft step "
                f"{(prof['draft_s'] or 0) / prof['verify_s']['1']:.2f} of a target step")
        doctor_key = run.results.get("doctor", {}).get("device_key")
        if doctor_key:
            run.check(f"{size}: the profile is keyed by doctor's device key", prof["key"]["device"] == doctor_key,
                      f"profile {prof['key']['device']}, doctor {doctor_key}")
        run.check(f"{size}: the curve has every pass size 1..{run.args.curve}",
                  len(prof["curve"]["verify_s"]) == run.args.curve, f"{len(prof['curve']['verify_s'])} sizes")
    return None


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def phase_generate(run: Run, until: float) -> str | None:
    from edgespec.engine import Engine, GenerationConfig

    gen = run.results.setdefault("generate", {})
    from edgespec.policy import MODES

    modes = [("ar", 0)] + [("draft", k) for k in DRAFT_KS] + [("lookup", 4)]
    modes += [("suffix", None)] if "suffix" in MODES else []  # suffix drafting (its default k)
    modes += [("auto", None)]
    for size in ready_sizes(run):
        m = run.results["models"][size]
        rows = gen[size] = []
        with Engine.load(m["target"], m["draft"], n_ctx=run.args.ctx, n_threads=run.args.threads) as engine:
            gpu_layers = engine.target.options.n_gpu_layers
            plain_tokens: dict[int, list[int]] = {}
            # a target with NextN layers (README: a real MTP model) also drafts through its own MTP head
            for mode, k in modes[:-1] + ([("mtp", 3)] if "mtp" in engine.drafters else []) + modes[-1:]:
                if time.monotonic() > until:
                    rows.append({"mode": mode, "k": k, "status": "skipped", "reason": "time budget"})
                    continue
                runs = []
                for _ in range(run.args.repeats):
                    for p, prompt in enumerate(PROMPTS[:run.args.prompts]):
                        config = GenerationConfig(max_tokens=run.args.max_tokens, temperature=0.0, seed=0, mode=mode,
                                                  draft_max=k, raw=True)
                        result = engine.generate(prompt, config)
                        runs.append((p, result))
                        if mode == "ar":
                            plain_tokens.setdefault(p, result.tokens)
                stats = [r.stats for _, r in runs]
                same = [_same_prefix(r.tokens, plain_tokens.get(p, [])) / max(1, len(r.tokens)) for p, r in runs]
                chosen: dict[str, int] = {}
                for s in stats:
                    for key, n in s.chosen.items():
                        chosen[key] = chosen.get(key, 0) + n
                rows.append({"mode": mode, "k": k, "status": "ok", "runs": len(runs),
                             "tokens_per_s": round(_median([s.tokens_per_s for s in stats]), 2),
                             "generated": int(_median([s.generated for s in stats])),
                             "acceptance_rate": round(_median([s.acceptance_rate for s in stats]), 3),
                             "mean_accepted_length": round(_median([s.mean_accepted_length for s in stats]), 3),
                             "ttft_ms": round(_median([s.ttft_s for s in stats]) * 1000, 1),
                             "tree_rounds": sum(s.tree_rounds for s in stats), "chosen": chosen,
                             "same_as_plain": round(min(same), 3), "gpu_layers": gpu_layers})
            plain = next((r["tokens_per_s"] for r in rows if r["mode"] == "ar" and r["status"] == "ok"), 0)
            for r in rows:
                if r["status"] == "ok" and plain:
                    r["x_plain"] = round(r["tokens_per_s"] / plain, 3)
        best = max((r for r in rows if r.get("x_plain")), key=lambda r: r["x_plain"], default=None)
        auto = next((r for r in rows if r["mode"] == "auto" and r["status"] == "ok"), None)
        run.log(f"  {size}: plain {plain:.1f} tok/s; best {best['mode']} k={best['k']} x{best['x_plain']}"
                if best else f"  {size}: no timings")
        if auto:
            run.log(f"  {size}: auto x{auto.get('x_plain')} choosing {auto['chosen']}")
        run.check(f"{size}: every mode generated tokens", all(r.get("generated", 0) > 0 for r in rows if r["status"] == "ok"),
                  ", ".join(f"{r['mode']}{r['k'] or ''}:{r.get('generated')}" for r in rows if r["status"] == "ok"))
    return None


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class NvmlPoller:
    """Peak GPU memory of one child process (NVML's per-process figure) and of the device, polled."""

    def __init__(self) -> None:
        self.reason = None
        self.nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
            if not self.handles:
                self.reason, self.nvml = "NVML reports 0 devices", None
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
        except Exception as exc:  # no driver: NVML is absent, which is what a CPU machine reports
            self.reason = f"NVML did not initialise: {exc}"

    @property
    def available(self) -> bool:
        return self.nvml is not None

    def device_used(self) -> int:
        return sum(int(self.nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self.handles)

    def watch(self, proc: subprocess.Popen, period: float = 0.02) -> dict:
        """Poll until proc exits: {process_peak_bytes, device_peak_delta_bytes, pid_seen}."""
        base = self.device_used()
        peak_proc = peak_dev = 0
        seen = False
        while proc.poll() is None:
            for h in self.handles:
                try:
                    for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h):
                        if p.pid == proc.pid:
                            seen = True
                            peak_proc = max(peak_proc, int(p.usedGpuMemory or 0))
                except Exception:
                    pass
            peak_dev = max(peak_dev, self.device_used() - base)
            time.sleep(period)
        return {"process_peak_bytes": peak_proc if seen else None, "device_peak_delta_bytes": peak_dev,
                "pid_seen": seen}


def phase_guard(run: Run, until: float) -> str | None:
    from edgespec.machine.memory import calibrate, format_bytes, parse_size
    from edgespec.runtimes import llamacpp

    sizes = ready_sizes(run)
    if not sizes:
        return "no models"
    size = run.args.guard_size if run.args.guard_size in sizes else sizes[min(1, len(sizes) - 1)]
    m = run.results["models"][size]
    guard = run.results["guard"] = {"size": size}
    info = llamacpp.backend_info()
    start = time.monotonic()
    smallest = run.results["models"][sizes[0]]["draft"]
    calibrate(build=info["build"], system_info=info["system_info"], reference=smallest)
    guard["calibration"] = {"reference": smallest, "seconds": round(time.monotonic() - start, 1)}
    poller = NvmlPoller()
    guard["nvml"] = "available" if poller.available else f"absent: {poller.reason}"
    gpus = nvidia_gpus()
    ram = run.results["machine"].get("ram_bytes") or 8 * 2**30
    host_budget = min(int(ram * 0.8), 64 * 2**30)
    gpu_total = int(float(gpus[0]["memory_mib"]) * 2**20) if gpus else None
    prompt = PROMPTS[0]
    cases = [("generous", host_budget, int(gpu_total * 0.9) if gpu_total else None)]

    def plan(budget: int, gpu_budget: int | None) -> dict:
        flags = ["--budget", str(budget)] + (["--gpu-budget", str(gpu_budget)] if gpu_budget else [])
        done = run.edgespec("plan", "--target", m["target"], "--draft", m["draft"], *flags, "--json",
                            timeout=until - time.monotonic())
        return json.loads(done.stdout) if done.stdout.strip() else {"error": done.stderr.strip()}

    def generate(budget: int, gpu_budget: int | None) -> dict:
        flags = ["--budget", str(budget)] + (["--gpu-budget", str(gpu_budget)] if gpu_budget else [])
        argv = [sys.executable, "-m", "edgespec.cli", "generate", prompt, "--raw", "--json", "--temperature", "0",
                "-n", str(run.args.max_tokens), "--target", m["target"], "--draft", m["draft"], "--mode", "draft",
                *flags, *(["--threads", str(run.args.threads)] if run.args.threads else [])]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run.env(),
                                cwd=run.work)
        readings = {}
        if poller.available:
            holder: dict = {}
            watcher = threading.Thread(target=lambda: holder.update(poller.watch(proc)))
            watcher.start()
        out, err = proc.communicate(timeout=max(5.0, until - time.monotonic()))
        if poller.available:
            watcher.join()
            readings = holder
        stats = json.loads(out)["stats"] if proc.returncode == 0 and out.strip() else None
        return {"exit": proc.returncode, "stderr_tail": err.strip().splitlines()[-3:], "stats": stats, "nvml": readings}

    first = plan(*cases[0][1:])
    predicted_gpu = first.get("predicted_gpu_peak_bytes")
    if gpu_total and predicted_gpu:
        cases.append(("tight GPU", host_budget, int(predicted_gpu * 0.6)))
    results = guard["cases"] = []
    for name, budget, gpu_budget in cases:
        if time.monotonic() > until:
            results.append({"case": name, "status": "skipped", "reason": "time budget"})
            continue
        p = first if name == "generous" else plan(budget, gpu_budget)
        g = generate(budget, gpu_budget)
        s = (p.get("settings") or {})
        entry = {"case": name, "budget_bytes": budget, "gpu_budget_bytes": gpu_budget, "plan_fits": p.get("fits"),
                 "plan_kind": p.get("memory_kind"), "target_gpu_layers": s.get("target_gpu_layers"),
                 "draft_on": s.get("draft"), "predicted_peak_bytes": p.get("predicted_peak_bytes"),
                 "predicted_gpu_peak_bytes": p.get("predicted_gpu_peak_bytes"), **g}
        results.append(entry)
        stats = g["stats"] or {}
        run.check(f"guard {name}: generate --budget runs", g["exit"] == 0, " | ".join(g["stderr_tail"]))
        if stats.get("peak_rss_bytes"):
            run.check(f"guard {name}: host peak within the budget", stats["peak_rss_bytes"] <= budget,
                      f"peak {format_bytes(stats['peak_rss_bytes'])}, predicted "
                      f"{format_bytes(p.get('predicted_peak_bytes') or 0)}, budget {format_bytes(budget)}")
        if not poller.available:
            run.check(f"guard {name}: GPU memory against NVML", None, guard["nvml"])
            continue
        nv = g["nvml"]
        measured = nv.get("process_peak_bytes") or nv.get("device_peak_delta_bytes")
        run.check(f"guard {name}: NVML sees the process", bool(nv.get("pid_seen")),
                  "NVML lists other pids (a container's pid namespace?): the guard cannot attribute GPU memory"
                  if not nv.get("pid_seen") else "")
        run.check(f"guard {name}: the guard read GPU memory", stats.get("peak_gpu_bytes") is not None,
                  f"guard {stats.get('peak_gpu_bytes')}, NVML poll {measured}")
        if gpu_budget and measured:
            run.check(f"guard {name}: GPU peak within --gpu-budget", measured <= gpu_budget,
                      f"measured {format_bytes(measured)}, predicted "
                      f"{format_bytes(entry['predicted_gpu_peak_bytes'] or 0)}, budget {format_bytes(gpu_budget)}, "
                      f"target GPU layers {entry['target_gpu_layers']}")
    # A budget nothing fits: one clear line and exit status 2, on any machine.
    done = run.edgespec("generate", prompt, "--raw", "--target", m["target"], "--budget", str(parse_size("32M")),
                        timeout=until - time.monotonic() + 30)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    results.append({"case": "impossible", "budget_bytes": parse_size("32M"), "exit": done.returncode,
                    "stderr_tail": lines[-3:]})
    run.check("guard impossible budget: one line, exit status 2", done.returncode == 2 and len(lines) >= 1
              and "Traceback" not in done.stderr and lines[-1].startswith("error:"), lines[-1] if lines else "")
    return None


# --- the report ----------------------------------------------------------------------------------

def _gib(n) -> str:
    """Bytes as people read them: MiB below a GiB."""
    if not n:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def markdown(r: dict) -> str:
    m = r.get("machine", {})
    gpu = ", ".join(f"{g['name']} ({g['memory_mib']} MiB, cc {g['compute_cap']}, driver {g['driver']})"
                    for g in m.get("gpus", [])) or "none"
    out = ["# GPU benchmark (bench/gpu/run.py)", "",
           f"Started {r.get('started')}; `{r.get('command')}`.", "",
           f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {_gib(m.get('ram_bytes'))} RAM, Python {m.get('python')}; "
           f"GPU: {gpu}; nvcc {m.get('nvcc') or 'absent'}.", "",
           "Models are random-weight GGUFs of the real shapes (exporters/random_checkpoint.py): costs and memory are "
           "real, acceptance between a model and its lower-bit copy is not a real model's.", "",
           "## Phases", "", "| phase | status | seconds | budget s | note |", "|---|---|---:|---:|---|"]
    for name in PHASES:
        p = r["phases"].get(name)
        if p:
            out.append(f"| {name} | {p['status']} | {p.get('seconds', 0)} | {p.get('budget_s', '')} | "
                       f"{(p.get('reason') or '').replace('|', '/')[:160]} |")
    b = r.get("build")
    if b:
        out += ["", f"Build: `CMAKE_ARGS=\"{b['cmake_args']}\"`; before: {b.get('installed_before')}; after: "
                f"{b.get('installed_after', '-')}; build {b.get('build_s', '-')} s."]
    d = r.get("doctor")
    if d:
        out += ["", f"Doctor: device key `{d.get('device_key')}`, memory kind {d.get('memory_kind')}, GPU layers "
                f"{d.get('gpu_layers')}, llama.cpp backends {d.get('llama_cpp', {}).get('backends')}, GPUs "
                f"{d.get('gpus', {}).get('status')}."]
    for size, model in r.get("models", {}).items():
        out += ["", f"## {size}", ""]
        if model.get("status") != "ok":
            out.append(f"not made: {model.get('reason')}")
            continue
        out.append(f"{model['n_params'] / 1e6:,.1f}M parameters; target {_gib(model['target_bytes'])}, "
                   f"draft {_gib(model['draft_bytes'])}; exported in {model['seconds']} s.")
        prof = r.get("profile", {}).get(size, {})
        if prof.get("status") == "ok":
            c = prof["curve"]
            out += ["", "Verify pass of n tokens (k = n - 1), in target steps: "
                    + ", ".join(f"{n}: {v}" for n, v in c["verify_steps"].items())
                    + f" (one step {float(c['verify_s']['1']) * 1000:.2f} ms; draft step "
                    f"{(prof.get('draft_s') or 0) * 1000:.2f} ms)."]
            for w, sizes in c["tree_vs_chain"].items():
                out.append(f"Tree width {w}, x a chain of as many nodes: "
                           + ", ".join(f"{n} nodes {v}" for n, v in sizes.items()) + ".")
        rows = r.get("generate", {}).get(size, [])
        if rows:
            out += ["", "| mode | k | tok/s (median) | x plain | acceptance | tokens/pass | same as plain | chosen |",
                    "|---|---:|---:|---:|---:|---:|---:|---|"]
            for row in rows:
                if row["status"] != "ok":
                    out.append(f"| {row['mode']} | {row['k'] or ''} | skipped | | | | | |")
                    continue
                chosen = ", ".join(f"{k} x{v}" for k, v in sorted(row["chosen"].items(), key=lambda kv: -kv[1])[:3])
                k = row["k"] if row["k"] is not None else "auto" if row["mode"] == "auto" else "default"
                out.append(f"| {row['mode']} | {k} | {row['tokens_per_s']} | "
                           f"{row.get('x_plain', '')} | {row['acceptance_rate']} | {row['mean_accepted_length']} | "
                           f"{row['same_as_plain']} | {chosen} |")
    g = r.get("guard")
    if g:
        out += ["", f"## Memory guard ({g['size']}; NVML {g.get('nvml')})", "",
                "| case | budget | GPU budget | plan: fits, GPU layers | predicted host / GPU | measured host | "
                "NVML process / device | exit |", "|---|---:|---:|---|---:|---:|---:|---:|"]
        for c in g.get("cases", []):
            stats = c.get("stats") or {}
            nv = c.get("nvml") or {}
            out.append(f"| {c['case']} | {_gib(c.get('budget_bytes'))} | {_gib(c.get('gpu_budget_bytes'))} | "
                       f"{c.get('plan_fits', '-')}, {c.get('target_gpu_layers', '-')} | "
                       f"{_gib(c.get('predicted_peak_bytes'))} / {_gib(c.get('predicted_gpu_peak_bytes'))} | "
                       f"{_gib(stats.get('peak_rss_bytes'))} | {_gib(nv.get('process_peak_bytes'))} / "
                       f"{_gib(nv.get('device_peak_delta_bytes'))} | {c.get('exit')} |")
    out += ["", "## Checks", ""]
    for c in r["checks"]:
        mark = {True: "ok", False: "**FAILED**", None: "n/a"}[c["ok"]]
        out.append(f"- {mark}: {c['name']}" + (f" ({c['detail']})" if c["detail"] else ""))
    return "\n".join(out) + "\n"


def phase_report(run: Run, until: float) -> str | None:
    run.results["elapsed_s"] = round(run.elapsed(), 1)
    run.results["phases"]["report"] = {"status": "ok", "seconds": 0.0, "budget_s": BUDGET_S["report"]}
    run.out.mkdir(parents=True, exist_ok=True)
    tmp_json, tmp_md = run.out / ".gpu_bench.json.partial", run.out / ".gpu_bench.md.partial"
    tmp_json.write_text(json.dumps(run.results, indent=1, default=str))
    tmp_md.write_text(markdown(run.results))
    os.replace(tmp_json, run.out / "gpu_bench.json")  # both appear complete or not at all
    os.replace(tmp_md, run.out / "gpu_bench.md")
    run.log(f"  wrote {run.out / 'gpu_bench.json'} and {run.out / 'gpu_bench.md'}")
    return None


PHASE_FUNCS = {"build": phase_build, "install": phase_install, "models": phase_models, "doctor": phase_doctor,
               "profile": phase_profile, "generate": phase_generate, "guard": phase_guard, "report": phase_report}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--sizes", default=",".join(GPU_SIZES), help="comma list of model sizes "
                    "(exporters/random_checkpoint.CONFIGS: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, tiny)")
    ap.add_argument("--work", default=str(HERE / ".work"), help="build, models and caches (git-ignored)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "out"), help="report folder [$OUT]")
    ap.add_argument("--build", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--install", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--cuda-arch", default=None, help="CMAKE_CUDA_ARCHITECTURES [default: nvidia-smi's compute_cap]")
    ap.add_argument("--target-quant", default="f16")
    ap.add_argument("--draft-quant", default="q4_k_m", help="the self-draft: the target at fewer bits")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads [default: physical cores]")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2, choices=(1, 2))
    ap.add_argument("--curve", type=int, default=17, help="profile verify passes of 1..N tokens (k = 0..N-1)")
    ap.add_argument("--guard-size", default="qwen2.5-1.5b", help="model size the memory-guard phase runs")
    ap.add_argument("--deadline-s", type=float, default=570.0, help="stop starting phases after this long")
    ap.add_argument("--fresh", action="store_true", help="forget earlier calls' results (kept in --work)")
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # a re-exec after the install
    args = ap.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    args.sizes = [s for s in args.sizes.split(",") if s]
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        ap.error(f"unknown phase(s) {', '.join(unknown)}; use {', '.join(PHASES)}")
    return args


def without_phases(argv: list[str]) -> list[str]:
    """argv less its --phases option (either spelling)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--phases":
            skip = True
        elif not a.startswith("--phases="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    ensure_library_path(argv)
    run = Run(args)
    os.environ["EDGESPEC_HOME"] = str(run.work / "home")  # profiles and calibrations of this run, in and out of process
    run.results.setdefault("machine", describe_machine())
    run.log(f"bench/gpu/run.py: phases {','.join(args.phases)}; sizes {','.join(args.sizes)}; deadline "
            f"{args.deadline_s:.0f}s; work {run.work}; out {run.out}")
    phases = list(args.phases)
    while phases:
        name = phases.pop(0)
        run.phase(name, lambda until, name=name: PHASE_FUNCS[name](run, until))
        if name == "install" and run.results["phases"]["install"]["status"] == "ok" and phases:
            # The editable install takes effect in a fresh interpreter: go on there.
            run.save_partial()
            return subprocess.call([sys.executable, __file__, *without_phases(argv), "--phases", ",".join(phases),
                                    "--resume"])
    failed = [c for c in run.results["checks"] if c["ok"] is False]
    run.log(f"done in {run.elapsed():.0f}s; {len(failed)} failed check(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
