"""The client commands of ``tlkv``: ``put``, ``get`` and ``has`` against a server, over HTTP
(``http://``) or tl.kv.v1 gRPC (``grpc://``), and ``stats`` and ``delete-model`` (of a
server, or of a store directory).

The HTTP client and the gRPC stubs are imported only inside the commands, so the codec
commands run without them. The token comes from ``--token-file`` or ``TLKV_TOKEN``.
(``tlkv serve`` belongs to the service: ``api.serve`` registers it.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..protocol import hash_hex, is_hash_hex, read_token_file
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, model_arg, positive_int

DEFAULT_URL_HELP = "server: http://127.0.0.1:8000, or grpc://127.0.0.1:50051 for tl.kv.v1"


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        return read_token_file(args.token_file)
    return os.environ.get("TLKV_TOKEN") or None


def _is_grpc(args: argparse.Namespace) -> bool:
    return str(args.url).startswith("grpc://")


def _client(args: argparse.Namespace) -> Any:
    if _is_grpc(args):
        from ..transfer import TransferClient

        return TransferClient(args.url, token=_token(args), model=args.model)
    from ..client import Client

    return Client(args.url, token=_token(args), model=args.model)


def _run_client(args: argparse.Namespace, action: Any) -> int:
    import httpx

    try:
        with _client(args) as client:
            return int(action(client))
    except httpx.HTTPError as exc:
        print(f"tlkv {args.command}: {args.url}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _cmd_put(args: argparse.Namespace) -> int:
    data = Path(args.file).read_bytes()

    def action(client: Any) -> int:
        if _is_grpc(args):
            json.dump(client.push(data)._asdict(), sys.stdout)
            sys.stdout.write("\n")
            return EXIT_OK
        result = client.put(data)
        reply = {
            "stored": [hash_hex(h) for h in result.stored],
            "duplicate": [hash_hex(h) for h in result.duplicate],
            "partial": result.partial,
        }
        json.dump(reply, sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK

    return _run_client(args, action)


def _cmd_get(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        if _is_grpc(args):
            data = client.fetch(hashes=[args.hash], kv_format=args.format or 0) or None
        else:
            data = client.get(args.hash, format=args.format)
        if data is None:
            print(f"tlkv get: block {args.hash} not found", file=sys.stderr)
            return EXIT_FAILURE
        if args.output == "-":
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            Path(args.output).write_bytes(data)
        return EXIT_OK

    return _run_client(args, action)


def _cmd_has(args: argparse.Namespace) -> int:
    if args.tokens is None and not args.hashes:
        print("tlkv has: give --tokens ... or one or more hashes", file=sys.stderr)
        return 2
    if args.tokens is not None and args.hashes:
        print("tlkv has: give --tokens or hashes, not both", file=sys.stderr)
        return 2

    def action(client: Any) -> int:
        if args.tokens is not None and _is_grpc(args):
            from ..codec.hashing import chain_hashes

            # HasBlocks takes hashes: they are computed here, with --block-tokens.
            result = client.has_blocks(chain_hashes(args.tokens, args.block_tokens))
            names = [f"block {i}" for i in range(len(result.present))]
        elif args.tokens is not None:
            result = client.has_blocks(tokens=args.tokens)
            names = [f"block {i}" for i in range(len(result.present))]
        else:
            result = client.has_blocks(hashes=args.hashes)
            names = list(args.hashes)
        if args.json:
            json.dump({"present": result.present, "prefix": result.prefix}, sys.stdout)
            sys.stdout.write("\n")
            return EXIT_OK
        for name, here in zip(names, result.present):
            print(f"{name} {'present' if here else 'absent'}")
        if args.tokens is not None and not result.present:
            # Only full blocks are hashed: a prompt shorter than one has nothing to look up.
            n = len(args.tokens)
            print(
                f"prefix 0/0: the prompt ({n} tokens) is shorter than a block, nothing to look up"
            )
        else:
            print(f"prefix {result.prefix}/{len(result.present)}")
        return EXIT_OK

    return _run_client(args, action)


def _print_stats(stats: dict[str, Any], as_json: bool) -> int:
    if as_json:
        json.dump(stats, sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK
    for key, value in stats.items():
        print(f"{key:<16} {'-' if value is None else value}")
    return EXIT_OK


def _target_refused(args: argparse.Namespace) -> int | None:
    """The exit code of a command given neither or both of a server URL and ``--data``, or
    a ``--data`` that is no directory (after one line on stderr); None: it may go on."""
    if (args.url is None) == (args.data is None):
        print(
            f"tlkv {args.command}: give a server URL or --data DIR (one of them)", file=sys.stderr
        )
        return EXIT_USAGE
    if args.data is not None and not Path(args.data).is_dir():
        print(f"tlkv {args.command}: {args.data}: no store there", file=sys.stderr)
        return EXIT_FAILURE
    return None


def _cmd_stats(args: argparse.Namespace) -> int:
    refused = _target_refused(args)
    if refused is not None:
        return refused
    if args.data is not None:
        from ..store.store import Store

        with Store(args.data) as root:
            store = root if args.model is None else root.model(args.model)
            stats: dict[str, Any] = dict(store.stats())
            g = store.geometry
        stats.pop("hits", None)  # this process's reads: none
        stats.pop("misses", None)
        stats = {"geometry": None if g is None else g.as_dict(), **stats}
        return _print_stats(stats, args.json)
    if _is_grpc(args):
        print(
            f"tlkv stats: tl.kv.v1 (grpc://) has no stats call; ask the server's HTTP port "
            f"(tlkv stats http://HOST:PORT) or its store (tlkv stats --data DIR), not {args.url}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return _run_client(args, lambda client: _print_stats(client.info(), args.json))


def _cmd_delete_model(args: argparse.Namespace) -> int:
    refused = _target_refused(args)
    if refused is not None:
        return refused
    if args.data is not None:
        from ..store.store import Store

        with Store(args.data) as store:
            held = store.delete_model(args.model_id)
        return _print_deleted(args.model_id, held)
    args.model = None  # the call names its model itself
    return _run_client(
        args, lambda client: _print_deleted(args.model_id, client.delete_model(args.model_id))
    )


def _print_deleted(model: str, held: dict[str, int] | None) -> int:
    if held is None:
        print(f"tlkv delete-model: no model {model!r}", file=sys.stderr)
        return EXIT_FAILURE
    json.dump({"model": model, **held}, sys.stdout)
    sys.stdout.write("\n")
    return EXIT_OK


def _add_token(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="file holding the bearer token (else $TLKV_TOKEN)")
    p.add_argument(
        "--model", type=model_arg, default=None, help="the model (namespace); default: default"
    )


def _hash_arg(text: str) -> str:
    if not is_hash_hex(text):
        raise argparse.ArgumentTypeError(f"a block hash is 16 lowercase hex digits: {text!r}")
    return text


def register(sub: Any) -> None:
    """Add ``stats``, ``delete-model``, ``put``, ``get`` and ``has`` to the ``tlkv``
    subcommands."""
    p = sub.add_parser(
        "stats", help="a store's counts, quarantined (corrupt) blocks included: server or --data"
    )
    p.add_argument("url", nargs="?", default=None, help=DEFAULT_URL_HELP)
    p.add_argument("--data", default=None, help="a store directory instead of a server")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_token(p)
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser(
        "delete-model",
        help="delete a model with its blocks and sequences: on a server (a token that may "
        "write it) or --data DIR",
    )
    p.add_argument("url", nargs="?", default=None, help=DEFAULT_URL_HELP)
    p.add_argument("model_id", metavar="MODEL", help="the model id ('default' is not deleted)")
    p.add_argument("--data", default=None, help="a store directory instead of a server")
    p.add_argument("--token-file", help="file holding the bearer token (else $TLKV_TOKEN)")
    p.set_defaults(func=_cmd_delete_model)

    p = sub.add_parser("put", help="send an envelope's blocks to a server")
    p.add_argument("url", help=DEFAULT_URL_HELP)
    p.add_argument("file", help="envelope file")
    _add_token(p)
    p.set_defaults(func=_cmd_put)

    p = sub.add_parser("get", help="fetch one block's envelope from a server")
    p.add_argument("url", help=DEFAULT_URL_HELP)
    p.add_argument("hash", type=_hash_arg, help="16 lowercase hex digits")
    p.add_argument("-o", "--output", required=True, help="output file ('-' for stdout)")
    p.add_argument("--format", type=int, choices=[1, 2], default=None, help="transcode to")
    _add_token(p)
    p.set_defaults(func=_cmd_get)

    p = sub.add_parser("has", help="ask a server which blocks it holds")
    p.add_argument("url", help=DEFAULT_URL_HELP)
    p.add_argument("hashes", nargs="*", type=_hash_arg, help="block hashes")
    p.add_argument("--tokens", nargs="+", type=int, default=None, help="token ids instead")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--block-tokens",
        type=positive_int,
        default=16,
        help="B for hashing --tokens on a grpc:// server (default 16)",
    )
    _add_token(p)
    p.set_defaults(func=_cmd_has)
