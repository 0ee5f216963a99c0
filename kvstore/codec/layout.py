"""Every struct format, magic, code and size of the export envelope, declared once.

Spec: ../shared/spec/kv-blocks-hash-and-envelope.txt, section "Export envelope".
No other module spells a format string for the wire format.
"""

from __future__ import annotations

import struct

# "magic "TLKV" (54 4c 4b 56)"
MAGIC = b"TLKV"

# Header: magic, u16 version, u16 dtype, u32 n_blocks, u32 block_tokens, u32 n_layers,
# u32 n_kv_heads, u32 head_dim -- "The header is 28 bytes".
HEADER = struct.Struct("<4sHHIIIII")
HEADER_SIZE = HEADER.size  # 28
# "u16 version" at offset 4, read alone from envelopes already validated once.
HEADER_VERSION = struct.Struct("<H")
HEADER_VERSION_OFFSET = 4

# Block record prefix: u64 block_hash, u32 n_tokens -- "each block record 12 + P bytes".
RECORD = struct.Struct("<QI")
RECORD_SIZE = RECORD.size  # 12
RECORD_HASH_OFFSET = 0  # u64 block_hash
RECORD_HASH_DTYPE = "<u8"
RECORD_NTOKENS_OFFSET = 8  # u32 n_tokens
RECORD_NTOKENS_DTYPE = "<u4"

# Trailer: u32 crc32c -- "CRC-32C of every byte before it".
TRAILER = struct.Struct("<I")
TRAILER_SIZE = TRAILER.size  # 4

# "The length is at least 32": an envelope with zero blocks.
MIN_ENVELOPE_SIZE = HEADER_SIZE + TRAILER_SIZE

# Format versions and their tl_dtype codes: "1 = TL_F16 (v1), 3 = TL_F8_E4M3 (v2)".
VERSION_V1 = 1
VERSION_V2 = 2
DTYPE_F16 = 1
DTYPE_F8_E4M3 = 3
DTYPE_FOR_VERSION = {VERSION_V1: DTYPE_F16, VERSION_V2: DTYPE_F8_E4M3}
SUPPORTED_VERSIONS = (VERSION_V1, VERSION_V2)

# v2 per-slab scale: little-endian f32 "[L][2][Hkv]" after the element bytes.
SCALE_DTYPE = "<f4"
SCALE_SIZE = 4
F16_DTYPE = "<f2"
F16_SIZE = 2

# Largest u32 field value (n_blocks, geometry dimensions, token ids).
U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF

# Hash of "no hash" (a partial tail block): "The value 0 is reserved for "no hash"".
NO_HASH = 0
