"""The archive format without a store: golden bytes from ARCHIVE.md, the pure writer and
streaming reader, and the writer's refusals."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from archive_helpers import frame_bounds
from conftest import SMALL, make_envelope

from kvstore import decode, split
from kvstore.archive.frames import encode_index
from kvstore.archive.manifest import Manifest, Section
from kvstore.archive.reader import ArchiveReader
from kvstore.archive.scan import ArchiveBlock, ArchiveSequence
from kvstore.archive.sequences import SequenceRecord, parse_sequence_json
from kvstore.archive.tar import member_prefix, ustar_header
from kvstore.archive.writer import write_archive
from kvstore.codec.checksum import crc32c
from kvstore.errors import ArchiveError


def test_golden_manifest_and_record() -> None:
    manifest = Manifest(SMALL, 3, 1, tool="tlkv 0.1.0", archive_version=1).to_json()
    assert manifest == (
        b'{"archive_version":1,"blocks":3,"format":"tlkv-archive","geometry":{"block_tokens":4,'
        b'"head_dim":8,"n_kv_heads":2,"n_layers":2},"sequences":1,"tool":"tlkv 0.1.0"}\n'
    )
    assert len(manifest) == 162
    assert Manifest.from_json(manifest) == Manifest(SMALL, 3, 1, "tlkv 0.1.0", archive_version=1)
    record = SequenceRecord("agent-7", [0xA91AB0C1027B9366, 0x03DF829571605C60], b"tail")
    assert record.to_json() == (
        b'{"hashes":["a91ab0c1027b9366","03df829571605c60"],"name":"agent-7","tail":true}\n'
    )


def test_golden_version_4_manifest_and_record() -> None:
    """The version-4 examples of ARCHIVE.md 1.2 and 1.4, byte for byte."""
    m = Manifest(SMALL, 3, 1, "tlkv 0.1.0", archive_version=4, own_blocks=2)
    assert m.to_json() == (
        b'{"archive_version":4,"blocks":3,"format":"tlkv-archive","geometry":{"block_tokens":4,'
        b'"head_dim":8,"n_kv_heads":2,"n_layers":2},"model":"default","own_blocks":2,'
        b'"sequences":1,"tool":"tlkv 0.1.0"}\n'
    )
    assert Manifest.from_json(m.to_json()) == m
    record = SequenceRecord(
        "agent-7", [0xA91AB0C1027B9366, 0x03DF829571605C60], b"tail", [(1, b"own")]
    )
    assert record.to_json() == (
        b'{"hashes":["a91ab0c1027b9366","03df829571605c60"],"name":"agent-7","own":[1],'
        b'"tail":true}\n'
    )
    assert parse_sequence_json(record.to_json(), "agent-7", own=True) == (
        [0xA91AB0C1027B9366, 0x03DF829571605C60],
        True,
        [1],
    )
    with pytest.raises(ArchiveError):  # versions 1-3 have no own key
        parse_sequence_json(record.to_json(), "agent-7")


def test_golden_ustar_header() -> None:
    h = ustar_header("manifest.json", 162)
    assert len(h) == 512
    assert h[0:100] == b"manifest.json".ljust(100, b"\0")
    assert h[100:148] == b"0000644\x000000000\x000000000\x0000000000242\x0000000000000\x00"
    assert h[148:156] == b"%06o\0 " % (sum(h[:148]) + 8 * 32 + sum(h[156:]))
    assert h[156:157] == b"0" and h[157:257] == bytes(100)
    assert h[257:265] == b"ustar\x0000" and h[265:329] == bytes(64)
    assert h[329:345] == b"0000000\x000000000\x00" and h[345:] == bytes(167)
    long_name = "sequences/" + "x" * 120 + ".json"
    prefix = member_prefix(long_name, 10)
    assert len(prefix) == 3 * 512 and prefix[156:157] == b"x"
    assert prefix[:14] == b"././@PaxHeader"
    record = f"145 path={long_name}\n".encode()
    assert len(record) == 145 and prefix[512 : 512 + 145] == record
    assert prefix[1024:1124] == long_name[:100].encode()


def test_golden_index_frame() -> None:
    frame = encode_index([(100, 512), (200, 1024), (30, 1024)], [(0x1234, 1, 0)])
    assert frame[:20].hex(" ") == ("5b 2a 4d 18 44 00 00 00 01 00 00 00 03 00 00 00 01 00 00 00")
    assert frame[44:60].hex(" ") == "34 12 00 00 00 00 00 00 01 00 00 00 00 00 00 00"
    assert frame[-12:].hex(" ") == "44 00 00 00 54 4c 4b 56 53 45 45 4b"
    assert int.from_bytes(frame[-16:-12], "little") == crc32c(frame[:-16])
    assert len(frame) == 8 + 0x44


def _members() -> tuple[list[tuple[int, bytes]], list[SequenceRecord]]:
    parts = split(make_envelope(SMALL, 4 * 9 + 1, seed=4))
    blocks = sorted((int(decode(p).hashes[0]), p) for p in parts[:-1])
    v2 = split(make_envelope(SMALL, 4 * 2 + 3, version=2, seed=5))
    blocks2 = sorted((int(decode(p).hashes[0]), p) for p in v2[:-1])
    seqs = [
        SequenceRecord("a", [h for h, _ in blocks[:4]], parts[-1]),
        SequenceRecord("b", [h for h, _ in blocks[2:3]]),
        SequenceRecord("c", [h for h, _ in blocks2], v2[-1]),
    ]
    return sorted(blocks + blocks2), seqs


@pytest.mark.parametrize("frame_target", [4 << 20, 600])
def test_pure_round_trip(
    tmp_path: Path, buffer_type: type, frame_target: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.archive import writer as archive_writer

    monkeypatch.setattr(archive_writer, "FRAME_TARGET", frame_target)
    blocks, seqs = _members()
    path = tmp_path / "p.tar.zst"
    with open(path, "wb") as f:
        summary = write_archive(
            f,
            SMALL,
            [(h, buffer_type(e)) for h, e in blocks],
            seqs,
            n_blocks=len(blocks),
            n_sequences=len(seqs),
            threads=2,
        )
    assert summary.frames == len(frame_bounds(path)) - 1
    assert (summary.frames > 10) == (frame_target == 600)
    with ArchiveReader(path) as ar:
        items = list(ar.scan())
        got = [(i.hash, bytes(i.envelope)) for i in items if isinstance(i, ArchiveBlock)]
        assert got == blocks
        out = [i for i in items if isinstance(i, ArchiveSequence)]
        assert [(s.name, s.hashes, s.version) for s in out] == [
            ("a", seqs[0].hashes, 1),
            ("b", seqs[1].hashes, 1),
            ("c", seqs[2].hashes, 2),
        ]
        assert out[0].tail is not None and bytes(out[0].tail) == seqs[0].tail
        assert out[1].tail is None
        for h, e in blocks:
            assert ar.read_block(h) == e
        assert list(ar.sequence_records()) == [
            ("a", seqs[0].hashes, True),
            ("b", seqs[1].hashes, False),
            ("c", seqs[2].hashes, True),
        ]


def test_writer_refuses_bad_input() -> None:
    blocks, seqs = _members()
    n = len(blocks)

    def write(b: object, s: object, nb: int = n, ns: int = len(seqs)) -> None:
        write_archive(io.BytesIO(), SMALL, b, s, n_blocks=nb, n_sequences=ns)  # type: ignore[arg-type]

    write(blocks, seqs)
    with pytest.raises(ValueError, match="ascending"):
        write(list(reversed(blocks)), seqs)
    with pytest.raises(ValueError, match="n_blocks"):
        write(blocks, seqs, nb=n + 1)
    with pytest.raises(ValueError, match="not archived"):
        write(blocks[1:], seqs, nb=n - 1)
    with pytest.raises(ValueError, match="ascending"):
        write(blocks, list(reversed(seqs)))
    with pytest.raises(ValueError, match="sequence name"):
        write(blocks, [SequenceRecord("../x", [blocks[0][0]])], ns=1)
    mixed = SequenceRecord("m", [blocks[0][0]], seqs[2].tail)
    versions = {decode(blocks[0][1]).version, decode(seqs[2].tail).version}
    if len(versions) == 2:
        with pytest.raises(Exception, match="mix format versions"):
            write(blocks, [mixed], ns=1)
    bad = bytearray(blocks[0][1])
    bad[40] ^= 1
    with pytest.raises(Exception, match="CRC"):
        write([(blocks[0][0], bytes(bad)), *blocks[1:]], seqs)


def test_golden_manifest_v2_records_the_model() -> None:
    model = "meta-llama/Llama-3.1-8B@5206a32/bf16"
    manifest = Manifest(SMALL, 3, 1, tool="tlkv 0.1.0", model=model).to_json()
    assert manifest == (
        b'{"archive_version":2,"blocks":3,"format":"tlkv-archive","geometry":{"block_tokens":4,'
        b'"head_dim":8,"n_kv_heads":2,"n_layers":2},"model":"meta-llama/Llama-3.1-8B@5206a32/'
        b'bf16","sequences":1,"tool":"tlkv 0.1.0"}\n'
    )
    assert Manifest.from_json(manifest).model == model
    for bad in (b'"model":"a b"', b'"model":7'):
        with pytest.raises(ArchiveError, match="model"):
            Manifest.from_json(manifest.replace(b'"model":"' + model.encode() + b'"', bad))
    v1_with_model = manifest.replace(b'"archive_version":2', b'"archive_version":1')
    with pytest.raises(ArchiveError, match="keys"):
        Manifest.from_json(v1_with_model)


def test_golden_manifest_v3_lists_the_models() -> None:
    sections = [Section("base", SMALL, 3, 1), Section("ft", SMALL, 2, 0)]
    manifest = Manifest.of_models(sections, tool="tlkv 0.1.0")
    g = b'{"block_tokens":4,"head_dim":8,"n_kv_heads":2,"n_layers":2}'
    assert manifest.to_json() == (
        b'{"archive_version":3,"blocks":5,"format":"tlkv-archive","models":[{"blocks":3,'
        b'"geometry":'
        + g
        + b',"model":"base","sequences":1},{"blocks":2,"geometry":'
        + g
        + b',"model":"ft","sequences":0}],"sequences":1,"tool":"tlkv 0.1.0"}\n'
    )
    parsed = Manifest.from_json(manifest.to_json())
    assert [(x.model, x.prefix) for x in parsed.sections()] == [
        ("base", "models/0/"),
        ("ft", "models/1/"),
    ]
    assert Manifest.of_models(sections[:1]).archive_version == 2  # one model: version 2
