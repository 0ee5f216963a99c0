"""Archives of a store's KV state: create, restore, verify, list and extract.

The format (ARCHIVE.md beside this package) keeps the store's single-block envelopes
verbatim in a tar stream cut into independent zstd frames, with a seek index at the end.
"""

from .importer import RestoreReport
from .manifest import (
    ARCHIVE_FORMAT,
    ARCHIVE_VERSION,
    ARCHIVE_VERSION_MODELS,
    ARCHIVE_VERSION_OWN,
    Manifest,
    Section,
)
from .operations import (
    CreateSummary,
    Listing,
    Progress,
    VerifyReport,
    create,
    extract,
    extract_all,
    iter_blocks,
    list_archive,
    restore,
    verify,
)
from .reader import ArchiveReader
from .scan import ArchiveBlock, ArchiveSequence, Problem
from .sequences import SequenceRecord
from .writer import ModelContent, write_archive, write_models

__all__ = [
    "ARCHIVE_FORMAT",
    "ARCHIVE_VERSION",
    "ARCHIVE_VERSION_MODELS",
    "ARCHIVE_VERSION_OWN",
    "ArchiveBlock",
    "ArchiveReader",
    "ArchiveSequence",
    "CreateSummary",
    "Listing",
    "Manifest",
    "ModelContent",
    "Problem",
    "Progress",
    "RestoreReport",
    "Section",
    "SequenceRecord",
    "VerifyReport",
    "create",
    "extract",
    "extract_all",
    "iter_blocks",
    "list_archive",
    "restore",
    "verify",
    "write_archive",
    "write_models",
]
