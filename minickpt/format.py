# ruff: noqa: F401  (this module re-exports the names of the modules below)
"""The on-disk format of one item: a data file and a JSON manifest. No pickle, ever.

An item is a pytree saved in its own directory::

    params/
      data.bin        every array's raw little-endian bytes, each starting on a 64-byte boundary
      manifest.json   format version, the tree's container skeleton, and one line per leaf:
                      key path, kind, dtype, shape, byte offset, byte length, CRC-32
      data.p<i>.bin, manifest.p<i>.json
                      only when several processes saved it (format 2): the shards process
                      i wrote, see :mod:`minickpt.shard_layout`

Reading trusts nothing: every field of the manifest is checked (types, dtype names against an
allow-list, sizes against the data file) before a single byte is allocated, files are opened
without following symlinks, and every leaf's checksum is verified unless asked not to.

This module is the format's front door: it re-exports every public name of the modules that
implement it, one concept each, so that ``from minickpt.format import ...`` keeps working.
Read them in this order:

* :mod:`minickpt.format_spec` — versions, file names, alignment, limits, checksum, dtypes
* :mod:`minickpt.item_encode` — planning an item (tree -> entries + bytes) and writing it
* :mod:`minickpt.item_manifest` — reading and validating a manifest (and its shard manifests)
* :mod:`minickpt.item_read` — reading the leaves of a validated item, checksums verified
* :mod:`minickpt.host_buffers` — aligned host buffers, the memory check before a read
* :mod:`minickpt.shard_layout` — sharded leaves: index boxes, coverage, writing one process's shards
* :mod:`minickpt.shard_read` — reading any region of a leaf, whole or sharded (another mesh)
"""

from __future__ import annotations

from .format_spec import (
    ALIGN,
    CRC_IMPL,
    DATA_FILE,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MAX_FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    SHARD_MANIFEST_FORMAT,
    SHARDED_FORMAT_VERSION,
    check_name,
    crc32,
    dtype_name,
    key_data_shape,
)
from .host_buffers import (
    aligned_empty,
    host_memory_bytes,
)
from .item_encode import (
    ItemData,
    ItemPlan,
    ItemWriteResult,
    _as_bytes,
    decode_value,
    encode_value,
    manifest_bytes,
    plan_item,
    plan_leaf,
    write_item,
    write_item_data,
    write_item_manifest,
)
from .item_manifest import (
    Manifest,
    parse_json,
    read_manifest,
    validate_manifest,
)
from .item_read import (
    decode_leaf,
    read_leaves,
)
from .shard_layout import (
    Box,
    ShardFile,
    ShardRef,
    box_of,
    box_shape,
    box_slices,
    coverage_problems,
    intersect,
    plan_shards,
    shard_data_name,
    shard_manifest_name,
    sharded_entry,
    write_shards,
)
from .shard_read import (
    check_shards,
    read_region,
    region_from_pieces,
)
