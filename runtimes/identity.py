"""What names a model file in saved KV state and cached cost profiles (a runtime's compatibility key).

A runtime is given its model's identity by whoever resolved the name (edgespec.loader passes
`edgespec.models.store.model_identity`: a pulled catalog model or a checked store blob by its
sha256). Without one it names the file by what it can see without hashing it (a 1 GB hash costs
seconds): name, size, mtime and inode.
"""

from __future__ import annotations

import os
from pathlib import Path


def file_identity(path: str | os.PathLike) -> dict:
    path = Path(path)
    st = path.stat()
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
