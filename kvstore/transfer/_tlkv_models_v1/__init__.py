"""Generated messages and stubs of tlkv's own gRPC service (``api/proto/tlkv/v1/models.proto``).

Do not edit: ``python tools/gen_proto.py`` regenerates ``models_pb2`` and
``models_pb2_grpc``, and a test checks them against a fresh generation.
"""
