"""Where edgespec keeps what it downloads and checks: $EDGESPEC_HOME/models, else the user cache dir.

Its own module so that every store (the catalog's, the Hugging Face cache's sha256 marks) finds it
without importing another store.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def models_dir() -> Path:
    """Where pulled models live: $EDGESPEC_HOME/models, else the user cache dir."""
    home = os.environ.get("EDGESPEC_HOME")
    if home:
        return Path(home).expanduser() / "models"
    return Path(platformdirs.user_cache_dir("edgespec")) / "models"
