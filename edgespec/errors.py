"""Errors a user can cause. The CLI prints them as one line and exits with status 2."""

from __future__ import annotations


class EdgespecError(Exception):
    """A problem the user can fix: the message says what is wrong and what to do."""

    exit_code = 2


class ModelFileError(EdgespecError):
    """A model file is missing, truncated or not a model llama.cpp can load."""


class VocabMismatchError(EdgespecError):
    """The draft's vocabulary does not match the target's."""


class ContextOverflowError(EdgespecError):
    """Prompt plus generation budget does not fit in the context."""


class CatalogError(EdgespecError):
    """Unknown catalog name, failed download or checksum mismatch."""
