"""The tlkv HTTP service: a FastAPI app over ``kvstore.store.store.Store`` (see ``api.app``)."""
