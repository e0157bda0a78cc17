"""The on-disk formats the runtimes read: names, schema numbers and conventions, in one place.

The exporters (edgespec.exporters) write these formats and import their constants from here, so a
runtime never imports an exporter (which would pull torch and the export toolchain into every run):
the runtimes are the ground floor, and everything else builds on them.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

# --- a bundle (`edgespec export --out DIR`): one manifest naming every format's files ------------

BUNDLE_MANIFEST = "edgespec.json"

# --- an ONNX export directory (exporters/onnx_export.py) -----------------------------------------

ONNX_QUANTS = ("fp32", "int8", "int4")  # the preference order of quant="auto"
ONNX_FILES = {"fp32": "model.onnx", "int8": "model_int8.onnx", "int4": "model_q4.onnx"}

# --- an ONNX layer-graph export (exporters/onnx_layers.py, runtimes/onnx_layered.py) --------------

LAYERS_MANIFEST = "layers.json"
LAYERS_FORMAT = "edgespec-onnx-layers"
LAYERS_SCHEMA = 1

# --- a Core ML package (exporters/coreml_export.py, runtimes/coreml.py) ---------------------------

COREML_FUNCTIONS = ("prefill", "decode", "verify")


def causal_mask(n_past: int, n_new: int, dtype=np.float16) -> np.ndarray:
    """The Core ML package's additive mask for `n_new` tokens after `n_past` cached ones: shape
    (1, 1, n_new, n_past+n_new); its length says where the new tokens go."""
    rows = np.arange(n_new)[:, None]
    cols = np.arange(n_past + n_new)[None, :]
    return np.where(cols > n_past + rows, -np.inf, 0.0).astype(dtype)[None, None]


def describe_feature(f) -> dict:
    """One input, output or state of a package's spec: name, kind, shape (with flexible ranges), dtype."""
    if f.type.WhichOneof("Type") == "stateType":
        arr = f.type.stateType.arrayType
        return {"name": f.name, "kind": "state", "shape": list(arr.shape), "dtype": _array_dtype(arr.dataType)}
    arr = f.type.multiArrayType
    ranges = [[r.lowerBound, r.upperBound] for r in arr.shapeRange.sizeRanges] if arr.HasField("shapeRange") else None
    return {"name": f.name, "kind": "tensor", "shape": list(arr.shape), "ranges": ranges,
            "dtype": _array_dtype(arr.dataType)}


def _array_dtype(code: int) -> str:
    from coremltools.proto import FeatureTypes_pb2 as ft

    names = {ft.ArrayFeatureType.FLOAT16: "float16", ft.ArrayFeatureType.FLOAT32: "float32",
             ft.ArrayFeatureType.INT32: "int32", ft.ArrayFeatureType.DOUBLE: "float64"}
    return names.get(code, str(code))


# --- checksums the manifests list ----------------------------------------------------------------

def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- GGUF metadata read without a load: whether a model carries NextN (MTP) layers ---------------

_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type id -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_nextn_layers(path: str | os.PathLike) -> int:
    """`{arch}.nextn_predict_layers` of a GGUF (0 when absent or unreadable): the NextN (MTP) blocks
    the model carries, which `--mode mtp` drafts through. Scans the header's key/values only (the
    tokenizer arrays are skipped, not parsed), so it is cheap on any model size."""
    import struct

    def skip(f, vtype: int) -> None:
        if vtype == _GGUF_STRING:
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(n, 1)
        elif vtype == _GGUF_ARRAY:
            etype, count = struct.unpack("<IQ", f.read(12))
            if etype in _GGUF_SCALARS:
                f.seek(_GGUF_SCALARS[etype] * count, 1)
            else:
                for _ in range(count):
                    skip(f, etype)
        else:
            f.seek(_GGUF_SCALARS[vtype], 1)

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return 0
            _version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            for _ in range(n_kv):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode("utf-8", "replace")
                (vtype,) = struct.unpack("<I", f.read(4))
                if key.endswith(".nextn_predict_layers") and vtype in _GGUF_SCALARS:
                    raw = f.read(_GGUF_SCALARS[vtype])
                    return int.from_bytes(raw, "little", signed=vtype in (1, 3, 5, 11))
                skip(f, vtype)
    except (OSError, struct.error, KeyError):
        return 0
    return 0
