"""Archives of a store's KV state: create, restore, verify, list and extract.

The format (ARCHIVE.md beside this package) keeps the store's single-block envelopes
verbatim in a tar stream cut into independent zstd frames, with a seek index in a zstd
skippable frame at the end: ``zstd -dc FILE | tar -x`` yields the envelopes as files.

Layers: ``tar`` (member headers), ``frames`` (zstd frames + seek index), ``manifest``
(names, manifest, sequence records, member rules), ``writer`` and ``reader`` (streaming
writer and validator, no store), ``importer`` (restore's batched import), and the
operations, which tie them to the store, one module each: ``creation``, ``restoration``,
``inspection`` (verify, iterate, list) and ``extraction``; ``progress`` is what they report
to. This module gathers the operations' names in one place:

- ``create`` reads one consistent snapshot of each model it archives (one LMDB read
  transaction each, all open together) and writes a sibling temp file that is fsynced and
  renamed into place: format version 2 for one model, 3 for several.
- ``restore`` validates and imports in one pass: each block is checked by every reader
  rule and committed in durable batches of bounded size as the archive streams by (one
  batch committing while the next is decompressed and checked); sequences, which replace
  and pin, are imported only once the whole archive has passed every rule. If anything
  fails -- a member, a count, the disk -- the blocks and sequences it added are removed
  before the error propagates; if the process dies, the store's restore journal has the
  next process to open the store remove them. When committing could evict (a store with
  a capacity the archive might exceed), a refused archive could not give evicted blocks
  back: restore then validates the whole archive first, writing nothing, and imports in a
  second pass. Each of an archive's models goes to its own model of the store (one
  importer and journal each), and one commit keeps them all.
  Memory stays bounded whatever the archive's size.
- ``verify``, ``iter_blocks``, ``list_archive``, ``extract``, ``extract_all`` read only.
"""

from .creation import MAX_CORRUPT_RETRIES, CorruptBlock, CreateSummary, create
from .extraction import Extracted, extract, extract_all, extract_checked
from .importer import RestoreReport
from .inspection import Listing, SequenceInfo, VerifyReport, iter_blocks, list_archive, verify
from .progress import Progress
from .restoration import restore

__all__ = [
    "MAX_CORRUPT_RETRIES",
    "CorruptBlock",
    "CreateSummary",
    "Extracted",
    "Listing",
    "Progress",
    "RestoreReport",
    "SequenceInfo",
    "VerifyReport",
    "create",
    "extract",
    "extract_all",
    "extract_checked",
    "iter_blocks",
    "list_archive",
    "restore",
    "verify",
]
