"""Every struct format, magic, code and size of the export envelope, declared once.

Spec: FORMAT.md (the project's specification of the block hash and the envelope); each
constant cites its section there. No other module spells a format string for the wire
format.
"""

from __future__ import annotations

import struct

# FORMAT.md 2.1: magic `TLKV` (54 4c 4b 56) at offset 0.
MAGIC = b"TLKV"

# FORMAT.md 2.1, the header table: magic, u16 version, u16 dtype, u32 n_blocks,
# u32 block_tokens, u32 n_layers, u32 n_kv_heads, u32 head_dim; 28 bytes.
HEADER = struct.Struct("<4sHHIIIII")
HEADER_SIZE = HEADER.size  # 28
# u16 version at offset 4 (2.1), read alone from envelopes already validated once.
HEADER_VERSION = struct.Struct("<H")
HEADER_VERSION_OFFSET = 4

# FORMAT.md 2.1, the record table: u64 block_hash, u32 n_tokens, then P payload bytes.
RECORD = struct.Struct("<QI")
RECORD_SIZE = RECORD.size  # 12
RECORD_HASH_OFFSET = 0  # u64 block_hash
RECORD_HASH_DTYPE = "<u8"
RECORD_NTOKENS_OFFSET = 8  # u32 n_tokens
RECORD_NTOKENS_DTYPE = "<u4"

# FORMAT.md 2.1-2.2: the trailer, u32 CRC-32C of every byte before it.
TRAILER = struct.Struct("<I")
TRAILER_SIZE = TRAILER.size  # 4

# FORMAT.md 3, rule 1: the length is at least 32 (an envelope with zero blocks).
MIN_ENVELOPE_SIZE = HEADER_SIZE + TRAILER_SIZE

# FORMAT.md 2.1: version 1 has dtype 1 (f16), version 2 dtype 3 (E4M3).
VERSION_V1 = 1
VERSION_V2 = 2
DTYPE_F16 = 1
DTYPE_F8_E4M3 = 3
DTYPE_FOR_VERSION = {VERSION_V1: DTYPE_F16, VERSION_V2: DTYPE_F8_E4M3}
SUPPORTED_VERSIONS = (VERSION_V1, VERSION_V2)

# FORMAT.md 2.3: v2's per-slab scales, little-endian f32 [L][2][Hkv] after the codes.
SCALE_DTYPE = "<f4"
SCALE_SIZE = 4
F16_DTYPE = "<f2"
F16_SIZE = 2

# Largest u32 field value (n_blocks, geometry dimensions, token ids).
U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF

# FORMAT.md 1: 0 means "no hash" (a partial block); a computed 0 becomes 1.
NO_HASH = 0
