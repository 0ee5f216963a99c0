from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HasBlocksRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class HasBlocksResponse(_message.Message):
    __slots__ = ("present", "prefix_blocks")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    prefix_blocks: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., prefix_blocks: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("block_hash", "n_tokens", "kv_format", "payload", "crc32c", "sequence", "parent_hash", "token_ids")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    n_tokens: int
    kv_format: int
    payload: bytes
    crc32c: int
    sequence: str
    parent_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hash: _Optional[int] = ..., n_tokens: _Optional[int] = ..., kv_format: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., sequence: _Optional[str] = ..., parent_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("blocks", "referenced", "stored", "duplicate", "payload_bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFERENCED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    referenced: int
    stored: int
    duplicate: int
    payload_bytes: int
    def __init__(self, blocks: _Optional[int] = ..., referenced: _Optional[int] = ..., stored: _Optional[int] = ..., duplicate: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class FetchKvRequest(_message.Message):
    __slots__ = ("block_hashes", "tokens", "kv_format")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    kv_format: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., kv_format: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_hashes", "tokens", "models")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelPrefix(_message.Message):
    __slots__ = ("model", "block_tokens", "local_blocks", "local_tokens", "tier_blocks", "tier_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_tokens: int
    local_blocks: int
    local_tokens: int
    tier_blocks: int
    tier_tokens: int
    def __init__(self, model: _Optional[str] = ..., block_tokens: _Optional[int] = ..., local_blocks: _Optional[int] = ..., local_tokens: _Optional[int] = ..., tier_blocks: _Optional[int] = ..., tier_tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelPrefix]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelPrefix, _Mapping]]] = ...) -> None: ...
