"""Regenerate the checked-in gRPC modules from the ``.proto`` files under ``api/proto/``:
the spec's tl.kv.v1 (``tl/kv/v1/kv.proto`` -> ``kvstore/transfer/_tlkv_v1/``) and tlkv's
own service (``tlkv/v1/models.proto`` -> ``kvstore/transfer/_tlkv_models_v1/``).

Usage: python tools/gen_proto.py [--check]

Runs grpcio-tools' protoc (``--python_out``, ``--pyi_out``, ``--grpc_python_out``) into a
temporary directory, makes each service module import its messages relatively (the
modules live in packages of ``kvstore.transfer``, not in top-level ``tl`` or ``tlkv``
packages), and writes them. ``--check`` compares instead of writing and exits 1 when the
checked-in modules differ from a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "api" / "proto"


class Proto(NamedTuple):
    """One ``.proto`` file, relative to ``PROTO_ROOT``, and where its modules go."""

    path: str
    out: str  # the package directory, relative to the repository

    @property
    def stem(self) -> str:
        return Path(self.path).stem

    @property
    def modules(self) -> tuple[str, ...]:
        return (f"{self.stem}_pb2.py", f"{self.stem}_pb2.pyi", f"{self.stem}_pb2_grpc.py")


PROTOS = (
    Proto("tl/kv/v1/kv.proto", "kvstore/transfer/_tlkv_v1"),
    Proto("tlkv/v1/models.proto", "kvstore/transfer/_tlkv_models_v1"),
)


def _generate(proto: Proto, protoc: Any, include: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                proto.path,
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto.path} with exit code {code}")
        out_dir = Path(tmp) / Path(proto.path).parent
        texts = {name: (out_dir / name).read_text(encoding="utf-8") for name in proto.modules}
    package = ".".join(Path(proto.path).parent.parts)
    absolute = f"from {package} import {proto.stem}_pb2 as"
    grpc_name = f"{proto.stem}_pb2_grpc.py"
    if absolute not in texts[grpc_name]:
        raise RuntimeError(f"{grpc_name} no longer contains {absolute!r}")
    relative = f"from . import {proto.stem}_pb2 as"
    texts[grpc_name] = texts[grpc_name].replace(absolute, relative)
    return {f"{proto.out}/{name}": text for name, text in texts.items()}


def generate() -> dict[str, str]:
    """The generated modules' text, by path relative to the repository.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc  # a test/dev extra only

    include = str(Path(protoc.__file__).parent / "_proto")
    texts: dict[str, str] = {}
    for proto in PROTOS:
        texts.update(_generate(proto, protoc, include))
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    texts = generate()
    if args.check:
        stale = [
            path
            for path, text in texts.items()
            if not (REPO / path).exists() or (REPO / path).read_text(encoding="utf-8") != text
        ]
        for path in stale:
            print(f"{path} differs from a fresh generation", file=sys.stderr)
        return 1 if stale else 0
    for path, text in texts.items():
        (REPO / path).parent.mkdir(exist_ok=True)
        (REPO / path).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
