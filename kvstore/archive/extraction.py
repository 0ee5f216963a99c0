"""Extracting members of an archive into files: one block (``extract``,
``extract_checked``: reading only the frame that holds it) or every member, validated
(``extract_all``: into a new directory, never outside it).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codec.tokens import BlockTokens, pack_records
from ..errors import UnsafeArchiveError
from ..fileio import atomic_file, current_umask
from .manifest import (
    MANIFEST_NAME,
    block_member,
    sequence_block_member,
    sequence_member,
    tail_member,
    tokens_member,
)
from .reader import ArchiveReader
from .scan import ArchiveBlock, ArchiveSequence, ArchiveTokens
from .sequences import SequenceRecord


def extract(
    path: str | os.PathLike[str],
    block_hash: int,
    out: str | os.PathLike[str],
    *,
    model: str | None = None,
) -> int:
    """Write one block's verbatim envelope to ``out`` (a file path, an existing directory,
    or ``-`` for stdout), reading only the frame that holds it. Returns the bytes written.
    ``model``: the model the block belongs to (needed when the archive holds several).

    Raises:
        KeyError: the archive holds no such block (or no such model).
        ValueError: no ``model`` for an archive of several models.
    """
    return extract_checked(path, block_hash, out, model=model).size


@dataclass(frozen=True)
class Extracted:
    """What :func:`extract_checked` wrote, and what it found inconsistent where it looked."""

    size: int
    findings: list[str]


def extract_checked(
    path: str | os.PathLike[str],
    block_hash: int,
    out: str | os.PathLike[str],
    *,
    model: str | None = None,
) -> Extracted:
    """:func:`extract`, also when the block is valid but the archive's index or manifest
    disagrees with it or with the frame it sits in (``findings``, empty when consistent);
    only a block that is itself invalid, or cannot be found, raises."""
    with ArchiveReader(path, threads=1, strict=False) as ar:
        if model is not None:
            section = ar.section_of(model)
        elif len(ar.sections) == 1:
            section = 0
        else:
            ids = [x.model for x in ar.sections]
            raise ValueError(f"the archive holds {len(ids)} models {ids}; name one (--model)")
        data, findings = ar.read_block_checked(block_hash, section)
    target = os.fspath(out)
    if target == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return Extracted(len(data), findings)
    if os.path.isdir(target):
        target = os.path.join(target, f"{block_hash:016x}.tlkv")
    with atomic_file(target) as f:
        f.write(data)
    return Extracted(len(data), findings)


def _inside(root: str, name: str) -> str:
    """``root/name``, refusing any name that would resolve outside ``root``."""
    target = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, target]) != root or os.path.isabs(name):
        raise UnsafeArchiveError(f"member name {name!r} would escape {root!r}")
    return target


def extract_all(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> int:
    """Extract every member, validated, into the new directory ``directory``; returns the
    number of files. Written into a sibling temp directory renamed at the end: on any
    error nothing is left behind, and no file is ever written outside ``directory``."""
    final = os.path.abspath(os.fspath(directory))
    if os.path.lexists(final):
        raise FileExistsError(f"{final} exists; extract --all writes a new directory")
    parent = os.path.dirname(final)
    tmp = os.path.realpath(tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", dir=parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # what mkdir would give, not mkdtemp's 0700
    count = 0
    try:
        with ArchiveReader(path) as ar:

            def put(name: str, data: Any) -> None:
                nonlocal count
                target = _inside(tmp, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "xb") as f:
                    f.write(data)
                count += 1

            def prefix(item: ArchiveBlock | ArchiveTokens | ArchiveSequence) -> str:
                return ar.sections[item.section].prefix

            put(MANIFEST_NAME, ar.manifest.to_json())
            for item in ar.scan():
                if isinstance(item, ArchiveBlock):
                    put(block_member(item.hash, prefix(item)), item.envelope)
                elif isinstance(item, ArchiveTokens):
                    row = BlockTokens(np.array([item.parent], "<u8"), item.ids.reshape(1, -1))
                    put(tokens_member(item.hash, prefix(item)), pack_records(row))
                elif isinstance(item, ArchiveSequence):
                    record = SequenceRecord(item.name, item.hashes, item.tail, item.own)
                    put(sequence_member(item.name, prefix(item)), record.to_json())
                    for p, envelope in item.own:
                        put(sequence_block_member(item.name, p, prefix(item)), envelope)
                    if item.tail is not None:
                        put(tail_member(item.name, prefix(item)), item.tail)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return count
