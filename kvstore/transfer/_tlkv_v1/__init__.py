"""Generated tl.kv.v1 messages and stubs (``api/proto/tl/kv/v1/kv.proto``).

Do not edit: ``python tools/gen_proto.py`` regenerates ``kv_pb2`` and ``kv_pb2_grpc``, and
a test checks them against a fresh generation.
"""
