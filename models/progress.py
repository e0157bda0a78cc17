"""The byte progress bar model downloads show (catalog pulls, the Hugging Face Hub)."""

from __future__ import annotations

from contextlib import nullcontext


def progress_bar(enabled: bool):
    """A rich byte progress bar on stderr (stdout stays clean for paths and JSON), or nothing."""
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
