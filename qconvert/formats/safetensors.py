"""The safetensors format's dtype tags and their element sizes: the one table, read by the
converter's reader and writer (`qconvert/convert/safetensors_io.py`, which pairs each tag it reads
with its torch dtype) and by the staging-area contract (`qconvert/formats/staging.py`). Pure data."""

from __future__ import annotations

#: safetensors dtype tag -> bytes per element
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
