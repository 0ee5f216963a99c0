"""Non-finite data (``codec.envelope.check_finite``): refused on put, sequence and restore
with a message naming block, layer, K/V and head; stored verbatim with ``allow_nonfinite``,
and then a transcoding read is ``unconvertible`` (409 over HTTP), never ``invalid_request``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, make_envelope
from http_server import ServerProcess, assert_error

from kvstore import crc32c, decode
from kvstore.codec.envelope import check_finite
from kvstore.codec.layout import HEADER_SIZE, RECORD_SIZE, TRAILER
from kvstore.errors import FormatError, UnconvertibleError
from kvstore.store.store import Store

G = SMALL  # B=4, L=2, Hkv=2, D=8
ENVELOPE = {"content-type": "application/vnd.tlkv"}


def _index(layer: int, kv: int, head: int, t: int = 1, d: int = 3) -> int:
    return (((layer * 2 + kv) * G.n_kv_heads + head) * G.block_tokens + t) * G.head_dim + d


def _patched(data: bytes, offset: int, raw: bytes) -> bytes:
    out = bytearray(data)
    out[offset : offset + len(raw)] = raw
    body = bytes(out[:-4])
    return body + TRAILER.pack(crc32c(body))


def v1_with(bits: int, block: int = 1, where: tuple[int, int, int] = (1, 1, 0)) -> bytes:
    data = make_envelope(G, 12, version=1, seed=4)  # 3 full blocks
    rec = HEADER_SIZE + block * G.record_bytes(1) + RECORD_SIZE
    return _patched(data, rec + 2 * _index(*where), struct.pack("<H", bits))


def v2_code(code: int, where: tuple[int, int, int] = (0, 1, 1)) -> bytes:
    data = make_envelope(G, 12, version=2, seed=5)
    rec = HEADER_SIZE + RECORD_SIZE
    return _patched(data, rec + _index(*where), bytes([code]))


def v2_scale(value: float, where: tuple[int, int, int] = (1, 0, 1)) -> bytes:
    data = make_envelope(G, 12, version=2, seed=6)
    layer, kv, head = where
    slab = (layer * 2 + kv) * G.n_kv_heads + head
    rec = HEADER_SIZE + RECORD_SIZE + G.elements + 4 * slab
    return _patched(data, rec, struct.pack("<f", value))


REFUSED: list[tuple[str, Callable[[], bytes], str]] = [
    ("f16 NaN", lambda: v1_with(0x7E00), "block 1 .* layer 1, V, head 0"),
    ("f16 +Inf", lambda: v1_with(0x7C00, 2, (0, 0, 1)), "block 2 .* layer 0, K, head 1"),
    ("f16 -Inf", lambda: v1_with(0xFC00, 0), "block 0 .* layer 1, V, head 0"),
    ("e4m3 NaN 0x7f", lambda: v2_code(0x7F), "E4M3 NaN code in layer 0, V, head 1"),
    ("e4m3 NaN 0xff", lambda: v2_code(0xFF, (1, 0, 0)), "NaN code in layer 1, K, head 0"),
    ("scale NaN", lambda: v2_scale(float("nan")), "scale nan .* layer 1, K, head 1"),
    ("scale +Inf", lambda: v2_scale(float("inf")), "scale inf"),
    ("scale -Inf", lambda: v2_scale(float("-inf")), "scale -inf"),
    ("scale < 0", lambda: v2_scale(-0.5), "scale -0.5"),
    ("scale 0", lambda: v2_scale(0.0), "scale 0.0"),
    ("scale 3.4e38", lambda: v2_scale(3.4e38), "layer 1, K, head 1"),
]


@pytest.mark.parametrize(("name", "make", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_check_finite_refuses(name: str, make: Callable[[], bytes], message: str) -> None:
    data = make()
    env = decode(data)  # valid by the spec's reader rules
    with pytest.raises(FormatError, match=message):
        check_finite(env)


def test_check_finite_accepts_what_encode_writes_and_ignores_past_the_fill() -> None:
    for version in (1, 2):
        check_finite(decode(make_envelope(G, 14, version=version, seed=9)))  # with a tail
    # A partial tail (2 of 4 tokens) with NaN past its fill: never read, not refused.
    data = make_envelope(G, 10, version=1, seed=3)
    tail = HEADER_SIZE + 2 * G.record_bytes(1) + RECORD_SIZE
    check_finite(decode(_patched(data, tail + 2 * _index(0, 0, 0, t=3), b"\x00\x7e")))
    with pytest.raises(FormatError):
        check_finite(decode(_patched(data, tail + 2 * _index(0, 0, 0, t=1), b"\x00\x7e")))


def test_store_refuses_unless_allowed(tmp_path: Path) -> None:
    bad = v1_with(0x7E00)
    with Store(tmp_path / "s") as s:
        with pytest.raises(FormatError, match="finite"):
            s.put(bad)
        with pytest.raises(FormatError, match="finite"):
            s.put_sequence("x", bad)
        with pytest.raises(FormatError, match="finite"):
            s.import_batch([decode(bad).single(1)])
        assert s.stats()["blocks"] == 0 and s.sequences() == []
        # A bad CRC is still reported as such first.
        crc = bytearray(bad)
        crc[-1] ^= 1
        with pytest.raises(FormatError, match="CRC"):
            s.put(bytes(crc))
    with Store(tmp_path / "t", allow_nonfinite=True) as s:
        s.put(bad)
        h = int(decode(bad).hashes[1])
        assert s.get(h) == decode(bad).single(1)  # verbatim
        with pytest.raises(UnconvertibleError, match=f"{h:016x}"):
            s.get(h, version=2)
    with Store(tmp_path / "u", allow_nonfinite=True) as s:
        s.put(v2_scale(3.4e38))
        h = int(decode(v2_scale(3.4e38)).hashes[0])
        with pytest.raises(UnconvertibleError):
            s.get(h, version=1)


def test_store_refuses_a_decoded_envelope_unless_allowed(tmp_path: Path) -> None:
    """An ``Envelope`` that ``decode`` returned is not decoded again by the store, but the
    finite rule still applies to it, on every write."""
    bad = v1_with(0x7E00)
    one = decode(bad).single(1)  # the non-finite block alone
    with Store(tmp_path / "s") as s:
        for write in (
            lambda: s.put(decode(bad)),
            lambda: s.put_report(decode(bad)),
            lambda: s.put_sequence("x", decode(bad)),
            lambda: s.import_batch([decode(one)]),
            lambda: s.import_batch(sequences=[("x", decode(bad))]),
        ):
            with pytest.raises(FormatError, match=r"finite.* layer 1, V, head 0"):
                write()
        assert s.stats()["blocks"] == 0 and s.sequences() == []
    with Store(tmp_path / "t", allow_nonfinite=True) as s:
        s.import_batch([decode(one)])
        assert s.get(int(decode(bad).hashes[1])) == one  # verbatim


@pytest.mark.slow
def test_http_refuses_or_answers_unconvertible(tmp_path: Path) -> None:
    bad = v1_with(0x7C00, 2, (0, 0, 1))
    h = f"{int(decode(bad).hashes[2]):016x}"
    geometry = ",".join(map(str, G.as_tuple()))
    with ServerProcess(tmp_path / "a", "--geometry", geometry) as srv, srv.client() as http:
        r = http.put("/v1/blocks", content=bad, headers=ENVELOPE)
        assert "layer 0, K, head 1" in assert_error(r, 422, "format")
        assert_error(http.get(f"/v1/blocks/{h}"), 404, "not_found")
    args = ("--geometry", geometry, "--allow-nonfinite")
    with ServerProcess(tmp_path / "b", *args) as srv, srv.client() as http:
        assert http.put("/v1/blocks", content=bad, headers=ENVELOPE).status_code == 200
        assert http.get(f"/v1/blocks/{h}").content == decode(bad).single(2)
        assert_error(http.get(f"/v1/blocks/{h}", params={"format": 2}), 409, "unconvertible")
        r = http.post("/v1/prefix", json={"hashes": [h]}, params={"format": 2})
        assert_error(r, 409, "unconvertible")
        assert "Traceback" not in srv.log()


def test_scale_max_is_the_writers_bound() -> None:
    from kvstore.codec.numerics import SCALE_MAX, quantize_e4m3

    big = np.full((1, 8), np.finfo(np.float32).max, dtype=np.float32)
    _, scales = quantize_e4m3(big, 8)
    assert scales[0] <= SCALE_MAX


def test_restore_refuses_nonfinite_unless_allowed(tmp_path: Path) -> None:
    from kvstore import archive as ar

    bad = v2_scale(float("nan"))
    archive = tmp_path / "a.tar.zst"
    with Store(tmp_path / "src", allow_nonfinite=True) as src:
        src.put(bad)
        ar.create(src, archive)
    with Store(tmp_path / "dst") as dst:
        dst.put(make_envelope(G, 8, seed=1))
        before = dst.stats()["blocks"]
        with pytest.raises(FormatError, match="finite"):
            ar.restore(archive, dst)
        assert dst.stats()["blocks"] == before  # all or nothing
    with Store(tmp_path / "ok", allow_nonfinite=True) as ok:
        ar.restore(archive, ok)
        assert ok.stats()["blocks"] == len(decode(bad))


def test_verify_applies_the_rule_restore_applies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``archive verify`` refuses what ``restore`` would (naming the member), and
    ``--allow-nonfinite`` accepts it, as on restore; a sequence's tail is checked too."""
    from conftest import make_blocks

    from kvstore import archive as ar
    from kvstore import encode
    from kvstore.cli import main
    from kvstore.cli.common import EXIT_FORMAT, EXIT_OK

    seq = encode(G, make_blocks(G, 4 * 2 + 3, seed=8), 1)  # a partial tail (fill 3)
    tail = HEADER_SIZE + 2 * G.record_bytes(1) + RECORD_SIZE
    seq = _patched(seq, tail + 2 * _index(1, 0, 1), struct.pack("<H", 0x7C00))  # +Inf
    with Store(tmp_path / "src", allow_nonfinite=True) as src:
        src.put(v2_scale(float("inf")))
        src.put_sequence("s", seq)
        archive = tmp_path / "a.tar.zst"
        ar.create(src, archive, sequences=["s"])
        ar.create(src, tmp_path / "all.tar.zst")
    with pytest.raises(FormatError, match=r"sequences/s\.tail.*layer 1, K, head 1"):
        ar.verify(archive)
    with pytest.raises(FormatError, match=r"blocks/[0-9a-f]{16}.*scale inf"):
        ar.verify(tmp_path / "all.tar.zst")
    for path in (archive, tmp_path / "all.tar.zst"):
        assert ar.verify(path, allow_nonfinite=True).blocks >= 2
        assert main(["archive", "verify", str(path), "--quiet"]) == EXIT_FORMAT
        assert "finite" in capsys.readouterr().err
        assert main(["archive", "verify", str(path), "--quiet", "--allow-nonfinite"]) == EXIT_OK
    with Store(tmp_path / "good") as src:  # finite data passes by default
        src.put(make_envelope(G, 8, seed=3))
        ar.create(src, tmp_path / "good.tar.zst")
    assert ar.verify(tmp_path / "good.tar.zst").blocks == 2
