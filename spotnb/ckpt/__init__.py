"""Checkpoint data at model scale: spotnb's on-store format, streamed, in bounded memory.

(Described in full below, once it settles.)
"""

from __future__ import annotations

__all__ = ["ALIGN", "DATA_SUFFIX", "FILE_MIN_BYTES", "MAX_FILES", "METADATA_FILE",
           "PIECE_BYTES"]

#: DCP's name for the pickled ``Metadata`` of a checkpoint.
METADATA_FILE = ".metadata"
#: Data files of a rank's items: ``__<rank>_<i>.distcp``, as DCP names them.
DATA_SUFFIX = ".distcp"
#: A file per this many bytes of a rank's data: small checkpoints stay one file (one
#: object to create and fsync), large ones are written by several threads at once.
FILE_MIN_BYTES = 256 * 2**20
#: At most this many files (threads) per rank: each hashes on its own core while the
#: store writes; more would only contend for the disk or the link.
MAX_FILES = 4
#: Items start at offsets aligned to this many bytes, so that a tensor read back can
#: be a view of a memory-mapped file (any dtype's alignment, and a cache line).
ALIGN = 64
#: Tensor bytes go to the store in pieces of this size: hashing one piece and writing
#: the previous overlap, and a GPU tensor needs a staging buffer of this size only.
PIECE_BYTES = 8 * 2**20
