"""Recommended target + draft pairs (pairs.json), their expected memory, and `--draft auto`.

Expected memory is the memory planner's own prediction (`edgespec.machine.memory.predict`) for a setup of
4096 tokens of context, f16 KV, 4 drafted tokens per round, on the CPU, run on model facts built
from each model's architecture numbers (pairs.json says where they come from) instead of a file's
tensor table: the weights as one span of the estimated file size, the KV cache, compute buffers,
logits rows and vocabulary from the same formulas the planner applies to a real GGUF. Gemma 3's
sliding-window layers hold less KV than counted here, so its figures are upper bounds.

`auto_draft(target)` picks, among the models installed in any store (models.store.installed), one
whose vocabulary passes `edgespec.vocab.vocab_difference` against the target: names only order the
candidates (the pair's recommended draft first, then the smallest), the check decides.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from edgespec.errors import EdgespecError

CONTEXT = 4096
MAX_DRAFT = 4
# A draft that costs more than about half a target step rarely pays (FACTS: a 0.5B draft costs 0.6 of a
# 1.5B step here and loses); candidates above this share of the target's size are not tried.
MAX_DRAFT_SHARE = 0.5


@dataclass(frozen=True)
class PairModel:
    name: str
    hub: str                 # hf:OWNER/REPO:QUANT
    parameters: int
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_merges: int
    tied_embeddings: bool
    file_bytes: int          # exact where pairs.json lists it, else parameters x bits per weight
    catalog: str | None = None
    mtp_heads: int = 0       # NextN (MTP) blocks in the hub file: `--mode mtp` drafts through them
    unverified: tuple[str, ...] = ()  # fields that are estimates, not read from a source (2026 families)
    sources: str = ""        # where the architecture numbers come from

    @property
    def quant(self) -> str:
        return self.hub.rsplit(":", 1)[-1]

    @property
    def source(self) -> str:
        """The name to give --target/--draft: the catalog's where it has the model, else the hub's."""
        return self.catalog or self.hub


@dataclass(frozen=True)
class Pair:
    family: str
    target: PairModel
    draft: PairModel
    vocab_checked: bool
    draft_kind: str = "model"  # "assistant": the target's own MTP drafter model (Gemma 4), not run as a draft here

    @property
    def usable(self) -> bool:
        """Whether edgespec runs this pair (an assistant drafter needs llama.cpp's shared-KV context)."""
        return self.draft_kind == "model"

    @property
    def name(self) -> str:
        return f"{self.target.name} + {self.draft.name}"

    def pull_command(self) -> str:
        return f"edgespec models pull {self.target.source} {self.draft.source}"

    def run_command(self) -> str:
        return f'edgespec generate "..." --target {self.target.source} --draft {self.draft.source}'

    def expected_bytes(self) -> int:
        return expected_memory(self)["peak_bytes"]


@lru_cache(maxsize=1)
def _load() -> tuple[tuple[Pair, ...], dict[str, PairModel]]:
    raw = json.loads(resources.files("edgespec.models").joinpath("pairs.json").read_text(encoding="utf-8"))
    bpw = raw["bits_per_weight"]
    models = {}
    for m in raw["models"]:
        quant = m["hub"].rsplit(":", 1)[-1]
        size = m.get("file_bytes") or int(m["parameters"] * bpw[quant] / 8)
        fields = {k: v for k, v in m.items() if k not in ("file_bytes", "unverified")}
        models[m["name"]] = PairModel(**fields, unverified=tuple(m.get("unverified", ())), file_bytes=int(size))
    pairs = tuple(Pair(p["family"], models[p["target"]], models[p["draft"]], bool(p["vocab_checked"]),
                       p.get("draft_kind", "model")) for p in raw["pairs"])
    return pairs, models


def pairs() -> tuple[Pair, ...]:
    """Every recommended pair, in pairs.json order."""
    return _load()[0]


# --- expected memory, from the planner's formulas ------------------------------------------------

def model_facts(m: PairModel):
    """`edgespec.machine.memory.ModelFacts` from architecture numbers: token embeddings, one span per layer and
    (untied) the output matrix, sized so they add up to the file size. Their type names match no
    repacked layout, so weights count once (the planner's no-mmap case)."""
    from edgespec.machine.memory import ModelFacts, TensorInfo

    embd = int(m.n_vocab * m.n_embd * 4.5 / 8)  # Q4_K-like token embeddings
    output = 0 if m.tied_embeddings else int(m.n_vocab * m.n_embd * 6.56 / 8)  # Q6_K output, as Q4_K_M keeps it
    per_layer = max(1, (m.file_bytes - embd - output) // m.n_layer)
    tensors, offset = [], 0
    for name, nbytes, ne0, ne1 in ([("token_embd.weight", embd, m.n_embd, m.n_vocab)]
                                   + [(f"blk.{i}.weights", per_layer, m.n_embd, m.n_ff) for i in range(m.n_layer)]
                                   + ([("output.weight", output, m.n_embd, m.n_vocab)] if output else [])):
        tensors.append(TensorInfo(name, "MIXED", ne0, ne1, nbytes, offset))
        offset += nbytes
    return ModelFacts(path=m.hub, identity={"name": m.name}, file_bytes=m.file_bytes, arch=m.arch,
                      n_layer=m.n_layer, n_embd=m.n_embd, n_ff=m.n_ff, n_head=m.n_head, n_head_kv=m.n_head_kv,
                      head_k=m.head_dim, head_v=m.head_dim, n_vocab=m.n_vocab, n_merges=m.n_merges,
                      n_ctx_train=0, tensors=tuple(tensors))


def predict_facts(target_facts, draft_facts, n_ctx: int = CONTEXT, max_draft: int = MAX_DRAFT):
    """The planner's prediction for target + draft at f16 KV on the CPU, with default calibration."""
    from edgespec.machine.memory import Calibration, Hardware, ModelSettings, Setup, predict

    setup = Setup(target=target_facts, target_settings=ModelSettings(n_ctx=n_ctx, n_outputs_max=max_draft + 1),
                  draft=draft_facts, draft_settings=ModelSettings(n_ctx=n_ctx) if draft_facts else None,
                  max_draft=max_draft if draft_facts else 0, sampling=True, hardware=Hardware("cpu"))
    return predict(setup, Calibration(build="defaults", repack=False))


def expected_memory(pair: Pair) -> dict:
    """{"peak_bytes", "weights_bytes", "kv_bytes", "breakdown"} for the pair at CONTEXT tokens."""
    t, d = model_facts(pair.target), model_facts(pair.draft)
    pred = predict_facts(t, d)
    return {"peak_bytes": pred.peak_bytes, "weights_bytes": t.file_bytes + d.file_bytes,
            "kv_bytes": t.kv_bytes(CONTEXT) + d.kv_bytes(CONTEXT), "breakdown": pred.breakdown()}


def largest_fitting(budget_bytes: int) -> Pair | None:
    """The pair with the largest expected memory that stays within `budget_bytes`."""
    fitting = [p for p in pairs() if p.usable and p.expected_bytes() <= budget_bytes]
    return max(fitting, key=Pair.expected_bytes, default=None)


# --- which draft goes with a target ----------------------------------------------------------------

def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower())


def _model_key(name: str) -> str:
    """'qwen2.5-coder-7b-instruct' -> 'qwen2.5-coder-7b': how Ollama tags and file names spell it too."""
    return re.sub(r"-(instruct|it)(-awq)?$", "", _norm(name))


def recommended_for(target: str) -> Pair | None:
    """The pair whose target this name or path looks like (by model name, else by family); None if none."""
    text = _norm(str(target))
    for p in (p for p in pairs() if p.usable):
        if _model_key(p.target.name) in text or (p.target.catalog and p.target.catalog == str(target)):
            return p
    for p in sorted((p for p in pairs() if p.usable), key=lambda p: -len(p.family)):  # qwen2.5-coder before qwen2.5
        family = _norm(p.family)
        is_draft = _model_key(p.draft.name) in text or p.draft.catalog == str(target)
        if not is_draft and (family in text or family.replace("-", "") in text.replace("-", "")):
            return p
    return None


def _model_bytes(path: Path) -> int:
    """A model's size: all its shards for a split GGUF (they sit beside the first)."""
    from edgespec.models.gguf_names import shard_of

    shard = shard_of(path.name)
    if shard is None:
        return path.stat().st_size
    stem = path.name[: -len("-00001-of-00000.gguf")]
    return sum(path.with_name(f"{stem}-{i:05d}-of-{shard[1]:05d}.gguf").stat().st_size
               for i in range(1, shard[1] + 1))


def auto_draft(target: str | None) -> tuple[str, Path]:
    """(name, path) of an installed model that can draft for `target`, by the vocabulary check.

    Raises EdgespecError naming the recommended draft and its pull command when none is installed."""
    from edgespec.models import catalog, store
    from edgespec.runtimes.llamacpp import VocabOnly
    from edgespec.vocab import vocab_difference

    target = target or catalog.DEFAULT_MODEL
    target_path = store.resolve(target)
    size = _model_bytes(target_path)
    pair = recommended_for(target) or recommended_for(target_path.name)
    preferred = {pair.draft.source, pair.draft.hub} if pair else set()
    seen = {target_path.resolve()}
    candidates = []
    for m in store.installed():
        real = Path(m["path"]).resolve()
        if real in seen or m["bytes"] > size * MAX_DRAFT_SHARE:
            continue
        seen.add(real)
        candidates.append(m)
    candidates.sort(key=lambda m: (m["name"] not in preferred, m["bytes"]))
    rejected = []
    with VocabOnly(target_path) as tv:
        for m in candidates:
            try:
                with VocabOnly(m["path"]) as dv:
                    why = vocab_difference(tv, dv)
            except EdgespecError as exc:
                why = str(exc)
            if why is None:
                return m["name"], Path(m["path"])
            rejected.append(m["name"])
    checked = (f"{len(rejected)} smaller installed model{'s' if len(rejected) != 1 else ''} checked, none shares "
               "its vocabulary" if rejected else "no installed model is small enough to draft for it")
    if pair:
        hint = (f"the recommended draft is {pair.draft.source}: run `edgespec models pull {pair.draft.source}` "
                f"then `--draft {pair.draft.source}` (or --draft auto)")
    else:
        hint = "pull a small model of the target's family (see `edgespec models list` and docs/models.md)"
    raise EdgespecError(f"--draft auto found no draft for {target} ({checked}); {hint}")
