"""The on-disk format of one item: a data file and a JSON manifest. No pickle, ever.

An item is a pytree saved in its own directory::

    params/
      data.bin        every array's raw little-endian bytes, each starting on a 64-byte boundary
      manifest.json   format version, the tree's container skeleton, and one line per leaf:
                      key path, kind, dtype, shape, byte offset, byte length, CRC-32
      data.p<i>.bin, manifest.p<i>.json
                      only when several processes saved it (format 2): the shards process
                      i wrote, see :mod:`minickpt.format.shards`

Reading trusts nothing: every field of the manifest is checked (types, dtype names against an
allow-list, sizes against the data file) before a single byte is allocated, files are opened
without following symlinks, and every leaf's checksum is verified unless asked not to.

The format has one module per concept, and every import names the module where the code lives
(``from minickpt.format.encode import plan_item``). Read them in this order:

* :mod:`minickpt.format.spec` — versions, file names, alignment, limits, checksum, dtypes
* :mod:`minickpt.format.encode` — planning an item (tree -> entries + bytes) and writing it
* :mod:`minickpt.format.manifest` — reading and validating a manifest (and its shard manifests)
* :mod:`minickpt.format.read` — reading the leaves of a validated item, checksums verified
* :mod:`minickpt.format.buffers` — aligned host buffers, the memory check before a read, the restore pool
* :mod:`minickpt.format.shards` — sharded leaves: index boxes, coverage, writing one process's shards
* :mod:`minickpt.format.regions` — reading any region of a leaf, whole or sharded (another mesh)
"""
