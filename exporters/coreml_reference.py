"""The Core ML runtime's calls run on torch, on any OS: a check of the plan without a Mac.

`TorchReferenceRuntime` makes the very calls `edgespec.runtimes.coreml.CoreMLRuntime` makes (plan,
masks, rollback) on the torch decoder the exporter converts, built from the package's source
checkpoint. It lives with the exporter because it needs the exporter's decoder (and torch); the
runtimes never import it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from edgespec.errors import ModelFileError
from edgespec.exporters.checkpoint import load_checkpoint
from edgespec.exporters.coreml_export import build_decoder
from edgespec.runtimes.coreml import Call, _PlannedRuntime, read_package  # the runtime's plan, run on torch
from edgespec.runtimes.hf_vocab import HFVocab


class TorchReferenceRuntime(_PlannedRuntime):
    """The very calls CoreMLRuntime makes (plan, masks, rollback), run on the torch decoder the exporter
    converts, built from the package's source checkpoint. Any OS; fp32 cache by default, so its logits
    equal transformers' to about 1e-5 and any error in the plan shows."""

    name = "coreml-reference"

    def __init__(self, checkpoint: str | os.PathLike, package: str | os.PathLike,
                 tokenizer_dir: str | os.PathLike | None = None, *, n_ctx: int | None = None,
                 cache_dtype: str = "float32"):
        import torch

        info = read_package(package)
        ckpt = load_checkpoint(checkpoint)
        try:
            self._decoder = build_decoder(ckpt, info.max_context, cache_dtype=getattr(torch, cache_dtype))
        finally:
            ckpt.close()
        shape = tuple(self._decoder.k_cache.shape)
        if shape != info.state_shape or self._decoder.lm_head.out_features != info.n_vocab:
            raise ModelFileError(f"{Path(checkpoint).name} is not the source of {info.path.name}: KV {list(shape)} "
                                 f"and {self._decoder.lm_head.out_features} logits vs the package's "
                                 f"{list(info.state_shape)} and {info.n_vocab}")
        super().__init__(info, HFVocab(tokenizer_dir or checkpoint, info.n_vocab), n_ctx)
        self._torch = torch

    def _run(self, call: Call, ids: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.no_grad():  # the float16 mask Core ML gets, widened: same 0 / -inf values
            return self._decoder(torch.from_numpy(ids[None, :].copy()),
                                 torch.from_numpy(call.mask().astype(np.float32)))[0].numpy()
