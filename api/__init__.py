"""The tlkv HTTP service: a FastAPI app over ``kvstore.store.Store`` (see ``api.app``)."""
