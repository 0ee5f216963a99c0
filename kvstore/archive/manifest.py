"""The tlkv archive format's names and records (ARCHIVE.md 1): member names, the manifest
(version 2 names the one model of the members, version 3 lists several models whose members
sit under ``models/<n>/``; a version-1 archive is the model ``default``), the keys of a
sequence record (``sequences`` reads and writes the records), and the rules a member
envelope must meet, shared by the writer and the reader. Sans-IO: bytes and values in,
checked values or ArchiveError out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..codec.envelope import decode
from ..codec.geometry import Geometry
from ..codec.layout import NO_HASH, SUPPORTED_VERSIONS, U32_MAX
from ..errors import (
    ArchiveError,
    EnvelopeError,
    FormatError,
    UnsafeArchiveError,
    UnsupportedVersionError,
)
from ..protocol import (
    DEFAULT_MODEL,
    HASH_HEX_REGEX,
    SEQUENCE_NAME_REGEX,
    check_model_id,
)

ARCHIVE_FORMAT = "tlkv-archive"
ARCHIVE_VERSION = 2  # what the writer writes for one model
ARCHIVE_VERSION_MODELS = 3  # what the writer writes for several models
# What the writer writes when a sequence keeps blocks of its own (ARCHIVE.md 1.6): the
# manifest of version 2 or 3 with ``own_blocks`` counts, and sequence block members.
ARCHIVE_VERSION_OWN = 4
# What the writer writes when blocks carry their token ids (ARCHIVE.md 1.7): version 4's
# manifest (``own_blocks`` may be 0), and a token member after each such block member.
ARCHIVE_VERSION_TOKENS = 5
ARCHIVE_VERSIONS = (1, 2, 3, 4, 5)  # what the reader reads
MANIFEST_NAME = "manifest.json"
BLOCK_NAME = re.compile(rf"blocks/({HASH_HEX_REGEX})\.tlkv")
TOKENS_NAME = re.compile(rf"blocks/({HASH_HEX_REGEX})\.tokens")  # version 5
SEQUENCE_JSON_NAME = re.compile(rf"sequences/({SEQUENCE_NAME_REGEX})\.json")
SEQUENCE_TAIL_NAME = re.compile(rf"sequences/({SEQUENCE_NAME_REGEX})\.tail\.tlkv")
# Version 4: a block a sequence keeps of its own, at a position of its record's hashes.
SEQUENCE_BLOCK_NAME = re.compile(rf"sequences/({SEQUENCE_NAME_REGEX})\.(0|[1-9][0-9]{{0,9}})\.tlkv")
MANIFEST_KEYS_V1 = ("archive_version", "blocks", "format", "geometry", "sequences", "tool")
MANIFEST_KEYS = ("archive_version", "blocks", "format", "geometry", "model", "sequences", "tool")
MANIFEST_KEYS_V3 = ("archive_version", "blocks", "format", "models", "sequences", "tool")
MODEL_KEYS = ("blocks", "geometry", "model", "sequences")
OWN_KEY = "own_blocks"  # version 4: the manifest's (and each model's) own-block count
# Version 3: the members of the n-th model of the manifest's "models" sit under this
# directory (n in decimal without leading zeros): a model id may hold "/" or "..", a
# number never does.
MODEL_DIR = "models/{}/"
MODEL_DIR_NAME = re.compile(r"models/(0|[1-9][0-9]{0,5})/(.+)", re.DOTALL)
MAX_MODELS = 1024  # the 64 KiB manifest holds no more entries anyway
GEOMETRY_KEYS = tuple(sorted(Geometry.FIELDS))
SEQUENCE_KEYS = ("hashes", "name", "tail")
SEQUENCE_KEYS_OWN = ("hashes", "name", "own", "tail")  # version 4, a sequence keeping blocks
TOOL_NAME = re.compile(r"[ -~]{1,64}")

MAX_MANIFEST_BYTES = 1 << 16
MAX_SEQUENCE_BYTES = 1 << 24  # about 880,000 hashes: far beyond any context length
MAX_SEQUENCE_HASHES = MAX_SEQUENCE_BYTES // 19  # '"<16 hex>",' each: more never fit a record
MAX_BLOCK_BYTES = 1 << 26  # the largest single-block envelope an archive may hold
FRAME_TARGET = 4 << 20  # the writer starts a new frame rather than grow one past this
DEFAULT_LEVEL = 3


def tool_version() -> str:
    """The ``tool`` string of the manifest: ``tlkv <version>``."""
    from .._version import __version__

    return f"tlkv {__version__}"


def canonical_json(obj: Any) -> bytes:
    """The one serialization a manifest or sequence record may have (ARCHIVE.md 1.2)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (text + "\n").encode("ascii")


def strict_json(data: Any, what: str, limit: int) -> Any:
    """The JSON object ``data`` holds, refused unless within ``limit`` bytes and canonical."""
    raw = bytes(data)
    if len(raw) > limit:
        raise UnsafeArchiveError(f"{what}: {len(raw)} bytes exceeds the limit of {limit}")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArchiveError(f"{what}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ArchiveError(f"{what}: expected a JSON object")
    try:
        canonical = canonical_json(obj)
    except (TypeError, ValueError):
        canonical = b""
    if canonical != raw:
        raise ArchiveError(f"{what}: not in canonical form (sorted keys, no spaces, one \\n)")
    return obj


def is_int_in(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def block_member(block_hash: int, prefix: str = "") -> str:
    """Member name of a block: ``[prefix]blocks/<16 lowercase hex>.tlkv``."""
    return f"{prefix}blocks/{block_hash:016x}.tlkv"


def tokens_member(block_hash: int, prefix: str = "") -> str:
    """Member name of a block's token record (version 5): ``[prefix]blocks/<hex>.tokens``."""
    return f"{prefix}blocks/{block_hash:016x}.tokens"


def sequence_member(name: str, prefix: str = "") -> str:
    """Member name of a sequence record."""
    return f"{prefix}sequences/{name}.json"


def tail_member(name: str, prefix: str = "") -> str:
    """Member name of a sequence's tail envelope."""
    return f"{prefix}sequences/{name}.tail.tlkv"


def sequence_block_member(name: str, position: int, prefix: str = "") -> str:
    """Member name of the block a sequence keeps of its own at ``position`` (version 4)."""
    return f"{prefix}sequences/{name}.{position}.tlkv"


def escapes(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or ":" in name


@dataclass(frozen=True)
class Section:
    """One model's part of an archive: its id, geometry, member counts and the directory
    its members sit in (``""`` in versions 1 and 2, ``models/<n>/`` in version 3)."""

    model: str
    geometry: Geometry | None
    blocks: int
    sequences: int
    prefix: str = ""
    own_blocks: int = 0  # blocks its sequences keep of their own (version 4)

    def to_dict(self, own: bool = False) -> dict[str, Any]:
        """The section's entry in a version-3 (``own``: version-4) manifest's ``models``."""
        g = self.geometry
        out = {
            "blocks": self.blocks,
            "geometry": None if g is None else g.as_dict(),
            "model": self.model,
            "sequences": self.sequences,
        }
        if own:
            out[OWN_KEY] = self.own_blocks
        return out

    def max_envelope(self) -> int:
        """The largest single-block envelope the geometry allows (either version)."""
        if self.geometry is None:
            return 0
        return max(self.geometry.envelope_bytes(1, v) for v in SUPPORTED_VERSIONS)


@dataclass(frozen=True)
class Manifest:
    """The first member: format version, geometry, member counts, the writing tool and
    (version 2) the model the members belong to, or (version 3, ``parts``) several
    models, each with its geometry and counts (``blocks``/``sequences`` are the totals).
    Version 4 is either shape (``parts`` empty or not) plus ``own_blocks`` counts."""

    geometry: Geometry | None
    blocks: int
    sequences: int
    tool: str = field(default_factory=tool_version)
    archive_version: int = ARCHIVE_VERSION
    model: str = DEFAULT_MODEL
    parts: tuple[Section, ...] = ()
    own_blocks: int = 0

    @classmethod
    def of_models(
        cls, sections: Sequence[Section], tool: str | None = None, tokens: bool = False
    ) -> Manifest:
        """The manifest of an archive of ``sections`` (ascending model ids): version 2 for
        one model, version 3 (members under ``models/<n>/``) for several; version 4 in
        either shape when a sequence keeps blocks of its own, 5 when ``tokens`` (token
        members follow blocks)."""
        own = sum(x.own_blocks for x in sections)
        tool = tool or tool_version()
        with_own = ARCHIVE_VERSION_TOKENS if tokens else ARCHIVE_VERSION_OWN
        if len(sections) == 1:
            one = sections[0]
            version = with_own if own or tokens else ARCHIVE_VERSION
            return cls(
                one.geometry, one.blocks, one.sequences, tool, version, one.model, own_blocks=own
            )
        parts = tuple(
            Section(x.model, x.geometry, x.blocks, x.sequences, MODEL_DIR.format(n), x.own_blocks)
            for n, x in enumerate(sections)
        )
        blocks = sum(x.blocks for x in parts)
        sequences = sum(x.sequences for x in parts)
        version = with_own if own or tokens else ARCHIVE_VERSION_MODELS
        return cls(None, blocks, sequences, tool, version, parts=parts, own_blocks=own)

    def sections(self) -> tuple[Section, ...]:
        """The archive's models in member order (one for versions 1 and 2)."""
        if self.parts:
            return self.parts
        x = Section(self.model, self.geometry, self.blocks, self.sequences, "", self.own_blocks)
        return (x,)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict."""
        own = self.archive_version >= ARCHIVE_VERSION_OWN
        out: dict[str, Any] = {
            "archive_version": self.archive_version,
            "blocks": self.blocks,
            "format": ARCHIVE_FORMAT,
            "sequences": self.sequences,
            "tool": self.tool,
        }
        if own:
            out[OWN_KEY] = self.own_blocks
        if self.parts:
            out["models"] = [x.to_dict(own) for x in self.parts]
            return out
        g = self.geometry
        out["geometry"] = None if g is None else g.as_dict()
        if self.archive_version >= 2:
            out["model"] = self.model
        return out

    def to_json(self) -> bytes:
        """The canonical bytes of ``manifest.json``."""
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and check ``manifest.json`` (ARCHIVE.md 1.2).

        Raises:
            UnsupportedVersionError: another archive_version.
            ArchiveError: anything else malformed.
        """
        obj = strict_json(data, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if obj.get("format") != ARCHIVE_FORMAT:
            raise ArchiveError(f"manifest: format must be {ARCHIVE_FORMAT!r}")
        version = obj.get("archive_version")
        if isinstance(version, bool) or version not in ARCHIVE_VERSIONS:
            raise UnsupportedVersionError(
                f"manifest: archive_version {version!r}; this reader reads {ARCHIVE_VERSIONS}"
            )
        own = version >= ARCHIVE_VERSION_OWN
        several = version == ARCHIVE_VERSION_MODELS or (own and "models" in obj)
        keys = {1: MANIFEST_KEYS_V1, 2: MANIFEST_KEYS}.get(version, MANIFEST_KEYS_V3)
        if own:
            keys = tuple(sorted((*(MANIFEST_KEYS_V3 if several else MANIFEST_KEYS), OWN_KEY)))
        if tuple(sorted(obj)) != keys:
            raise ArchiveError(f"manifest: keys must be {keys}, found {sorted(obj)}")
        for key in ("blocks", "sequences", *((OWN_KEY,) if own else ())):
            if not is_int_in(obj[key], 0, U32_MAX):
                raise ArchiveError(f"manifest: {key} must be an integer in 0..{U32_MAX}")
        if version == ARCHIVE_VERSION_OWN and not obj[OWN_KEY]:
            raise ArchiveError(f"manifest: version {version} has {OWN_KEY} of at least 1")
        if not isinstance(obj["tool"], str) or not TOOL_NAME.fullmatch(obj["tool"]):
            raise ArchiveError("manifest: tool must be 1-64 printable ASCII characters")
        if several:
            return cls._from_v3(obj, version)
        one = _section(obj, "manifest", obj.get("model", DEFAULT_MODEL), own)
        return cls(
            one.geometry,
            one.blocks,
            one.sequences,
            obj["tool"],
            version,
            one.model,
            own_blocks=one.own_blocks,
        )

    @classmethod
    def _from_v3(cls, obj: dict[str, Any], version: int) -> Manifest:
        models = obj["models"]
        if not isinstance(models, list) or not 2 <= len(models) <= MAX_MODELS:
            raise ArchiveError(f"manifest: models must be a list of 2..{MAX_MODELS} entries")
        own = version >= ARCHIVE_VERSION_OWN
        model_keys = tuple(sorted((*MODEL_KEYS, OWN_KEY))) if own else MODEL_KEYS
        parts: list[Section] = []
        for n, entry in enumerate(models):
            what = f"manifest: models[{n}]"
            if not isinstance(entry, dict) or tuple(sorted(entry)) != model_keys:
                raise ArchiveError(f"{what}: keys must be {model_keys}")
            x = _section(entry, what, entry["model"], own)
            if parts and x.model <= parts[-1].model:
                raise ArchiveError(f"{what}: model ids must be strictly ascending")
            parts.append(
                Section(
                    x.model, x.geometry, x.blocks, x.sequences, MODEL_DIR.format(n), x.own_blocks
                )
            )
        if (
            sum(x.blocks for x in parts) != obj["blocks"]
            or sum(x.sequences for x in parts) != obj["sequences"]
            or sum(x.own_blocks for x in parts) != obj.get(OWN_KEY, 0)
        ):
            raise ArchiveError("manifest: the counts must be the models' totals")
        return cls(
            None,
            obj["blocks"],
            obj["sequences"],
            obj["tool"],
            version,
            parts=tuple(parts),
            own_blocks=obj.get(OWN_KEY, 0),
        )

    def max_envelope(self) -> int:
        """The largest single-block envelope any of its geometries allows (either version)."""
        return max(x.max_envelope() for x in self.sections())


def _section(obj: dict[str, Any], what: str, model: Any, own: bool = False) -> Section:
    """The model, geometry and counts of a manifest (or of one of its ``models``);
    ``own``: with its ``own_blocks`` (version 4)."""
    try:
        check_model_id(model)
    except ValueError as exc:
        raise ArchiveError(f"{what}: {exc}") from None
    for key in ("blocks", "sequences", *((OWN_KEY,) if own else ())):
        if not is_int_in(obj[key], 0, U32_MAX):
            raise ArchiveError(f"{what}: {key} must be an integer in 0..{U32_MAX}")
    own_blocks = obj[OWN_KEY] if own else 0
    if own_blocks > obj["sequences"] * MAX_SEQUENCE_HASHES:
        raise ArchiveError(f"{what}: {own_blocks} own blocks for {obj['sequences']} sequences")
    g = obj["geometry"]
    geometry = None
    if g is None:
        if obj["blocks"] or obj["sequences"]:
            raise ArchiveError(f"{what}: geometry is null but the archive is not empty")
    else:
        if not isinstance(g, dict) or tuple(sorted(g)) != GEOMETRY_KEYS:
            raise ArchiveError(f"{what}: geometry must have the keys {GEOMETRY_KEYS}")
        if not all(is_int_in(g[k], 1, U32_MAX) for k in GEOMETRY_KEYS):
            raise ArchiveError(f"{what}: geometry values must be in 1..{U32_MAX}")
        geometry = Geometry.from_dict(g)
    return Section(model, geometry, obj["blocks"], obj["sequences"], "", own_blocks)


def split_member(name: str, sections: Sequence[Section]) -> tuple[int, str]:
    """``(model number, name inside its model's directory)`` of a member name.

    Raises:
        UnsafeArchiveError: a version-3 name outside ``models/<n>/`` of a listed model.
    """
    if not sections or not sections[0].prefix:
        return 0, name
    found = MODEL_DIR_NAME.fullmatch(name)
    if found is None:
        if escapes(name):
            raise UnsafeArchiveError(f"member name {name!r} would escape the destination")
        raise UnsafeArchiveError(f"unexpected member name {name!r} (not under models/<n>/)")
    n = int(found.group(1))
    if n >= len(sections):
        raise UnsafeArchiveError(
            f"member {name!r} claims model {n}; the manifest lists {len(sections)} models"
        )
    return n, found.group(2)


def check_member_envelope(
    env_bytes: Any, geometry: Geometry, what: str, want_hash: int | None, verify_crc: bool = True
) -> Any:
    """Decode a single-block envelope by every reader rule; its hash must be ``want_hash``
    (or 0 for a tail, ``want_hash=None``)."""
    try:
        env = decode(env_bytes, geometry, verify_crc=verify_crc)
    except EnvelopeError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    if len(env) != 1:
        raise FormatError(f"{what}: holds {len(env)} blocks; a member holds exactly one")
    found = int(env.hashes[0])
    if want_hash is None:
        if found != NO_HASH:
            raise ArchiveError(f"{what}: a tail's block hash must be 0, found {found:016x}")
    elif found != want_hash:
        raise ArchiveError(f"{what}: the envelope's block hash is {found:016x}")
    return env
