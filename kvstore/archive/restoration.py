"""``restore``: import an archive into a store, all or nothing across its models.

Each of the archive's models goes to a model of the store (its own id, or a new one),
its geometry checked first; ``importer`` commits the blocks in durable batches as they
pass, and the sequences once the whole archive has; one ``Store.keep_restores`` commit
keeps every model, and anything failing undoes what was added.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..protocol import check_model_id
from ..store.protocols import RestoreTarget
from .importer import Importer, RestoreReport
from .inspection import check_geometry
from .progress import Progress
from .reader import ArchiveReader
from .scan import ArchiveBlock, ArchiveSequence, ArchiveTokens


def _fits_without_eviction(store: RestoreTarget, ar: ArchiveReader) -> bool:
    """Whether importing all of ``ar`` cannot make ``store`` evict (its tar stream's size
    bounds the envelope bytes it adds)."""
    capacity = store.capacity_bytes
    if capacity is None:
        return True
    return int(store.total_bytes()) + int(ar.index.data_bytes) <= capacity


def _targets(
    ar: ArchiveReader, store: RestoreTarget, model: str | None, renames: Mapping[str, str] | None
) -> list[Any]:
    """The store handle each of the archive's models goes to: its own id, or the new id
    ``renames`` gives it (``model``: the new id of an archive's only model)."""
    ids = [x.model for x in ar.sections]
    names = dict(renames or {})
    if model is not None:
        if len(ids) != 1:
            raise ValueError(f"the archive holds {len(ids)} models {ids}; rename one with OLD=NEW")
        names[ids[0]] = model
    for old, new in names.items():
        if old not in ids:
            raise KeyError(f"the archive holds no model {old!r} (it holds {ids})")
        check_model_id(new)
    chosen = [names.get(m, m) for m in ids]
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"two of the archive's models would restore into one: {chosen}")
    return [store.model(m) for m in chosen]


def restore(
    path: str | os.PathLike[str],
    store: RestoreTarget,
    *,
    partial: bool = False,
    threads: int = 0,
    progress: Progress | None = None,
    model: str | None = None,
    renames: Mapping[str, str] | None = None,
) -> RestoreReport:
    """Import an archive into ``store``: blocks (deduplicated) and sequences (pinned).

    All or nothing by default: every envelope is checked by every reader rule against
    the geometry of the model it goes to, and blocks are committed in bounded durable
    batches as they pass (the archive is read and decompressed once); sequences are
    imported only after the whole archive has passed. If anything fails, the blocks and
    sequences this restore added, in every model, are removed again (and the sequences it
    replaced put back) before the error propagates, so the store ends as it was. (Blocks
    of an archive later refused are visible to concurrent readers until then.) The
    restore becomes whole in one commit for all its models; if the process is killed
    before it, the next process to open the store undoes it (``Store.begin_restore``). If
    the archive might not fit the store's capacity without evicting, the whole archive
    is validated first, writing nothing, then imported in a second pass. A sequence that
    already exists under the same name is replaced. With ``partial=True`` the valid
    members are imported in one pass and the refused ones are listed in
    ``RestoreReport.problems``.

    Each of the archive's models goes to the model of the same id in ``store``'s
    environment (a version-1 archive is ``default``), or to ``renames[id]``; ``model``
    renames the model of a one-model archive (a ``Store`` handle of another model than
    the archive's is not used as is).

    Raises:
        ShapeError: one of the archive's geometries differs from its model's in the store.
        KeyError: ``renames`` names a model the archive does not hold.
        ValueError: ``model`` for an archive of several models, or two models renamed
            into one.
        ArchiveError, EnvelopeError: (``partial=False``) the first invalid member.
    """
    report = RestoreReport()
    with ArchiveReader(path, threads=threads) as ar:
        targets = _targets(ar, store, model, renames)
        for section, target in zip(ar.sections, targets):
            check_geometry(section.geometry, target.geometry, f"the model {target.model_id!r}")
        done = [0, 0]  # blocks and envelope bytes in this pass

        def tick(item: Any) -> None:
            if progress is not None and isinstance(item, ArchiveBlock):
                done[0] += 1
                done[1] += len(item.envelope)
                progress.update(done[0], done[1])

        def phase(name: str) -> None:
            done[:] = [0, 0]
            if progress is not None:
                progress.start(ar.manifest.blocks, name)

        one_pass = not partial and _fits_without_eviction(store, ar)
        if not partial and not one_pass:
            phase("validating")
            for item in ar.scan():  # pass 1: validate everything, write nothing
                tick(item)
        phase("validating and importing" if one_pass else "importing")
        importers: list[Importer] = []
        try:
            for n, target in enumerate(targets):
                importers.append(Importer(target, ar, report, defer_sequences=one_pass, section=n))
            current = 0
            # The store checks every CRC again while it writes: a second pass need not.
            for item in ar.scan(partial=partial, verify_crc=partial or one_pass):
                tick(item)
                if isinstance(item, ArchiveBlock | ArchiveTokens | ArchiveSequence):
                    if item.section != current:  # one model's commits at a time
                        importers[current].flush_blocks()
                        current = item.section
                    if isinstance(item, ArchiveBlock):
                        importers[current].add_block(item)
                    elif isinstance(item, ArchiveTokens):
                        importers[current].add_tokens(item)
                    else:
                        importers[current].add_sequence(item)
                else:
                    report.problems.append(item)
            for importer in importers:
                importer.complete()
            store.keep_restores([importer.journal for importer in importers])
        except BaseException:
            for importer in importers:
                if partial:
                    importer.abort()
                else:
                    importer.undo()
            raise
    return report
