"""What a GGUF file name says: its quant label and, for a split model, its shard number.

Shared by every store that holds many GGUFs side by side (a Hugging Face repo, an LM Studio folder):
`pick(names, quant)` chooses one model among them the way `llama-cli -hf REPO:QUANT` does, and returns
every shard of a split model (llama.cpp loads a split GGUF from its first shard when the others sit
beside it, named `-00001-of-0000N.gguf`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgespec.errors import ModelFileError

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default, and the usual size/quality balance
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# Quant labels as quantizers spell them in file names: Q4_K_M, IQ4_XS, Q8_0, F16, BF16, UD-Q4_K_XL.
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Za-z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class GGUFModel:
    """One model among a store's files: its quant label and its files (shards in order)."""

    quant: str | None
    files: tuple[str, ...]

    @property
    def first(self) -> str:
        return self.files[0]


def is_model_gguf(name: str) -> bool:
    """A .gguf that is a language model, not a vision projector (mmproj-*.gguf) or an imatrix."""
    base = name.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not base.startswith(("mmproj", "imatrix"))


def shard_of(name: str) -> tuple[int, int] | None:
    """(shard number, shard count) for `...-00002-of-00005.gguf`, else None."""
    m = _SHARD.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def quant_of(name: str) -> str | None:
    """The quant label of a GGUF file name, upper case ('Q4_K_M'), or None when it names none."""
    stem = _SHARD.sub("", name.rsplit("/", 1)[-1])
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def models_in(names: list[str]) -> list[GGUFModel]:
    """Group a store's file names into models: single files, and split models with all their shards.
    A split model with a shard missing is left out (llama.cpp could not load it)."""
    singles: list[GGUFModel] = []
    splits: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for name in sorted(n for n in names if is_model_gguf(n)):
        shard = shard_of(name)
        if shard is None:
            singles.append(GGUFModel(quant_of(name), (name,)))
            continue
        key = _SHARD.sub("", name)
        splits.setdefault(key, {})[shard[0]] = name
        counts[key] = shard[1]
    for key, shards in splits.items():
        if sorted(shards) == list(range(1, counts[key] + 1)):
            files = tuple(shards[i] for i in sorted(shards))
            singles.append(GGUFModel(quant_of(files[0]), files))
    return singles


def pick(names: list[str], quant: str | None, where: str) -> GGUFModel:
    """The model of `quant` (case-insensitive) among `names`; without a quant, Q4_K_M where there is one,
    else the only model. `where` names the store in error messages ('hf:owner/repo')."""
    models = models_in(names)
    if not models:
        raise ModelFileError(f"{where} holds no GGUF model file; give a repository with .gguf files "
                             "(for llama.cpp), or export this checkpoint with `edgespec export`")
    available = sorted({m.quant or m.first for m in models})
    wanted = (quant or DEFAULT_QUANT).upper()
    matching = [m for m in models if m.quant == wanted]
    if not matching and quant is None and len(models) == 1:
        return models[0]
    if not matching:
        what = f"no {quant} GGUF" if quant else f"several GGUFs and no {DEFAULT_QUANT}"
        raise ModelFileError(f"{where} has {what}; it has {', '.join(available)}: "
                             f"name one as {where}:QUANT (or {where}/FILE)")
    if len(matching) > 1:  # e.g. a quant in a subfolder and at the top: name the file
        raise ModelFileError(f"{where} has {len(matching)} {wanted} GGUFs ({', '.join(m.first for m in matching)}); "
                             f"name one as {where}/FILE")
    return matching[0]


def with_shards(names: list[str], file: str, where: str) -> GGUFModel:
    """The model `file` names among `names` (a first shard brings its other shards)."""
    if file not in names:
        listed = [m.first for m in models_in(names)]
        raise ModelFileError(f"{where} has no file {file}; its GGUF files: {', '.join(listed) or 'none'}")
    if shard_of(file) is None:
        return GGUFModel(quant_of(file), (file,))
    for model in models_in(names):
        if file in model.files:
            if model.first != file:
                raise ModelFileError(f"{file} is shard {shard_of(file)[0]} of a split model; name its first "
                                     f"shard, {model.first}")
            return model
    raise ModelFileError(f"{where} lacks some shards of {file}; llama.cpp needs all of them")
