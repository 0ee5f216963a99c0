"""tlkv's own gRPC service beside tl.kv.v1: ``tlkv.v1.Models`` (``api/proto/tlkv/v1/
models.proto``), what an operator does to a store's models over the same port.

``DeleteModel`` removes a model with every block and sequence of it (``Store.delete_model``,
in the thread pool), for a token that may write it, under the access rules of every other
call (``api.access.check_access``: NOT_FOUND-kind for a model the token may not see or
that does not exist, PERMISSION_DENIED for one it may only read). Authentication, the
status of each error and the call's ``/metrics`` series are KvTransfer's
(``api.grpc_service``).
"""

from __future__ import annotations

import asyncio

import grpc

from kvstore import Store
from kvstore.transfer import MODELS_SERVICE_NAME
from kvstore.transfer._tlkv_models_v1 import models_pb2, models_pb2_grpc

from .access import Access, check_access, model_not_found
from .grpc_service import KvTransferService


class ModelsService(models_pb2_grpc.ModelsServicer):
    """``tlkv.v1.Models`` on the store, tokens and metrics of ``transfer``."""

    def __init__(self, transfer: KvTransferService) -> None:
        self.transfer = transfer

    async def DeleteModel(  # the generated servicer names the RPCs
        self, request: models_pb2.DeleteModelRequest, context: grpc.aio.ServicerContext
    ) -> models_pb2.DeleteModelResponse:
        """Delete ``request.model``: what it held."""
        model = request.model

        def select(access: Access) -> Store:
            store = self.transfer.store
            check_access(access, model, True, lambda m: m in store.models())
            return store

        frame = self.transfer._call(  # KvTransfer's tokens, statuses and metrics
            "DeleteModel", context, service=MODELS_SERVICE_NAME, select=select
        )
        async with frame as store:
            loop = asyncio.get_running_loop()
            held = await loop.run_in_executor(None, store.delete_model, model)
            if held is None:
                raise model_not_found(model)
            return models_pb2.DeleteModelResponse(**held)
        raise AssertionError("unreachable: _call re-raises")  # for type checkers


def add_models_service(service: ModelsService, server: grpc.aio.Server) -> None:
    """Register ``tlkv.v1.Models`` on ``server``."""
    models_pb2_grpc.add_ModelsServicer_to_server(service, server)
