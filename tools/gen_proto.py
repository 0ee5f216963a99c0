"""Regenerate the checked-in tl.kv.v1 modules from ``api/proto/tl/kv/v1/kv.proto``.

Usage: python tools/gen_proto.py [--check]

Runs grpcio-tools' protoc (``--python_out``, ``--pyi_out``, ``--grpc_python_out``) into a
temporary directory, makes the service module import its messages relatively (the
modules live in the package ``kvstore.transfer._tlkv_v1``, not in a top-level ``tl`` package), and
writes them to ``kvstore/transfer/_tlkv_v1/``. ``--check`` compares instead of writing and exits 1
when the checked-in modules differ from a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "api" / "proto"
PROTO = "tl/kv/v1/kv.proto"
OUT = REPO / "kvstore" / "transfer" / "_tlkv_v1"
MODULES = ("kv_pb2.py", "kv_pb2.pyi", "kv_pb2_grpc.py")
_ABSOLUTE_IMPORT = "from tl.kv.v1 import kv_pb2 as"
_RELATIVE_IMPORT = "from . import kv_pb2 as"


def generate() -> dict[str, str]:
    """The generated modules' text, by file name.

    Raises:
        RuntimeError: protoc failed.
    """
    from grpc_tools import protoc  # a test/dev extra only

    with tempfile.TemporaryDirectory() as tmp:
        include = str(Path(protoc.__file__).parent / "_proto")
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                PROTO,
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out_dir = Path(tmp) / Path(PROTO).parent
        texts = {name: (out_dir / name).read_text(encoding="utf-8") for name in MODULES}
    grpc_module = texts["kv_pb2_grpc.py"]
    if _ABSOLUTE_IMPORT not in grpc_module:
        raise RuntimeError(f"kv_pb2_grpc.py no longer contains {_ABSOLUTE_IMPORT!r}")
    texts["kv_pb2_grpc.py"] = grpc_module.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT)
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    texts = generate()
    if args.check:
        stale = [
            name
            for name, text in texts.items()
            if not (OUT / name).exists() or (OUT / name).read_text(encoding="utf-8") != text
        ]
        for name in stale:
            print(
                f"kvstore/transfer/_tlkv_v1/{name} differs from a fresh generation", file=sys.stderr
            )
        return 1 if stale else 0
    OUT.mkdir(exist_ok=True)
    for name, text in texts.items():
        (OUT / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
