"""Input files read as exactly the bytes the release key is bound to.

Privacy: the release key is bound to a keyed fingerprint of the input's bytes, and the ledger ties the key to
that fingerprint (a free re-run must reproduce it). The engine reads the files a second time to count them. Were
the bytes it counts not the bytes fingerprinted (a file rewritten in place between the two reads, its size and
modification time put back), one key would stand for two inputs, and a free re-run over the old bytes would
publish the exact difference of the two. So every read an engine counts goes through `verified_copy`: the file
is copied whole into private memory (or, when large, into a private temporary file) while its SHA-256 is
computed, and only a copy whose digest equals the one taken with the fingerprint is parsed. Every engine reads
through it, in whichever worker reads the file (`pipelines.source.FileReader`).
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import mmap
import os
import tempfile
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from dprelease.accounting.errors import DPReleaseError
from dprelease.accounting.redact import shown

BLOCK = 8 << 20
IN_MEMORY_BYTES = 512 << 20
"""Files up to this size are copied into memory; larger ones into a private (0600) temporary file, mapped."""


CHANGED = "its bytes changed after the release key was bound to them"
"""The fixed words of every InputChanged message: an engine that gets a worker's failure back as text (Spark,
Beam) looks for them, and only them, to say the public reason instead of the exception's type."""


class InputChanged(DPReleaseError):
    """An input file's bytes differ from those the key was bound to (exit 1): nothing is published."""

    @classmethod
    def in_worker(cls, error: BaseException) -> "InputChanged | None":
        """The public error for a worker's failure that was an InputChanged (its text holds CHANGED), else None.
        The worker's text is searched, never shown."""
        return cls(f"an input file: {CHANGED}; nothing was published: run it again on an input that is not being "
                   "written") if CHANGED in str(error) else None


@dataclass(frozen=True)
class FileDigest:
    """A file's length and SHA-256, taken when the key was bound, and for a Parquet file the number of row groups
    its footer (in those bytes) declares: read tasks are planned from it, never from the live file. Internal:
    never published or logged."""

    size: int
    sha256: str
    row_groups: int | None = None
    """None: not a Parquet file, or a footer larger than the bytes kept to read it (then read whole)."""


TAIL = 2 * BLOCK
"""Bytes kept from the end of each file while it is fingerprinted, to read a Parquet footer from them."""


class _Tail:
    """The last TAIL bytes of a stream of blocks, kept as the blocks themselves (joined once, at the end)."""

    def __init__(self) -> None:
        self.blocks: collections.deque[bytes] = collections.deque()
        self.length = 0

    def add(self, block: bytes) -> None:
        self.blocks.append(block)
        self.length += len(block)
        while self.length - len(self.blocks[0]) >= TAIL:
            self.length -= len(self.blocks.popleft())

    def bytes(self) -> bytes:
        return b"".join(self.blocks)[-TAIL:]


def _row_groups(tail: bytes) -> int | None:
    """The row groups a Parquet file's footer declares, from the file's last bytes (None when it does not fit)."""
    import pyarrow.parquet as pq

    if len(tail) < 12 or tail[-4:] != b"PAR1":
        return None
    length = int.from_bytes(tail[-8:-4], "little")
    if length + 8 > len(tail):
        return None
    try:
        return pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(length + 8):])).num_row_groups
    except (pa.ArrowException, OSError, ValueError):
        return None


def _open_stream(path: str, filesystem: pafs.FileSystem | None):
    return filesystem.open_input_stream(path) if filesystem is not None else open(path, "rb")


def _size(path: str, filesystem: pafs.FileSystem | None, shown_path: str) -> int:
    if filesystem is None:
        return os.stat(path).st_size
    info = filesystem.get_file_info(path)
    if info.type != pafs.FileType.File:
        raise DPReleaseError(f"input file {shown(shown_path)}: disappeared while the run was starting; nothing was "
                             "charged")
    return info.size


def fingerprint_files(files: list[tuple[str, str]], filesystem: pafs.FileSystem | None, mac_key: bytes,
                      parquet: bool = False) -> tuple[str, dict[str, FileDigest]]:
    """(the keyed fingerprint, each file's digest) of `files` ((path in the filesystem, path as named), in
    order), read once: the fingerprint is HMAC-SHA256 under `mac_key` over the count of files, then each file's
    length and bytes; each digest is the file's length and SHA-256 (what `verified_copy` demands later) and, for
    `parquet`, the row groups the footer in those bytes declares. A store's checksum cannot stand in for the
    bytes: S3's ETag is an MD5 (two inputs differing in a record can share one), and a size and modification time
    can be put back."""
    mac = hmac.new(mac_key, digestmod=hashlib.sha256)
    mac.update(len(files).to_bytes(8, "big"))
    digests: dict[str, FileDigest] = {}
    for located, named in files:
        size = _size(located, filesystem, named)
        mac.update(size.to_bytes(8, "big"))
        digest = hashlib.sha256()
        read = 0
        tail = _Tail()
        with _open_stream(located, filesystem) as handle:
            for block in iter(lambda: handle.read(BLOCK), b""):
                mac.update(block)
                digest.update(block)
                read += len(block)
                if parquet:
                    tail.add(block)
        if read != size:
            raise InputChanged(f"input file {shown(named)}: changed while it was read; nothing was charged")
        digests[named] = FileDigest(size, digest.hexdigest(), _row_groups(tail.bytes()) if parquet else None)
    return mac.hexdigest(), digests


def verified_copy(located: str, filesystem: pafs.FileSystem | None, expected: FileDigest,
                  named: str) -> pa.NativeFile:
    """A private copy of the file, for a reader to parse, once its bytes are shown to be `expected`'s (length and
    SHA-256); InputChanged (naming the file only) otherwise. At most expected.size + 1 bytes are read."""
    digest = hashlib.sha256()
    spill = None
    blocks: list[bytes] = []
    read = 0
    try:
        with _open_stream(located, filesystem) as handle:
            while read <= expected.size:
                block = handle.read(min(BLOCK, expected.size + 1 - read))
                if not block:
                    break
                digest.update(block)
                read += len(block)
                if spill is None and expected.size > IN_MEMORY_BYTES:
                    spill = _private_spill()
                if spill is not None:
                    spill.write(block)
                else:
                    blocks.append(block)
        if read != expected.size or digest.hexdigest() != expected.sha256:
            raise InputChanged(f"input file {shown(named)}: {CHANGED}; nothing was published: run it again on an "
                               "input that is not being written")
        if spill is None:
            return pa.BufferReader(pa.py_buffer(b"".join(blocks)))
        spill.flush()
        return _mapped(spill)
    finally:
        if spill is not None:
            spill.close()  # the mapping lives on until unmapped; the file has no name, so nothing is left behind


def _mapped(spill) -> pa.NativeFile:
    """The private copy mapped read-only: by Arrow through /proc/self/fd (Linux: the file has no other name), or
    else through Python's mmap."""
    if os.path.isdir("/proc/self/fd"):
        return pa.memory_map(f"/proc/self/fd/{spill.fileno()}")
    return pa.BufferReader(pa.py_buffer(mmap.mmap(spill.fileno(), 0, access=mmap.ACCESS_READ)))


def _private_spill():
    """A new owner-only temporary file without a name (Linux: O_TMPFILE; elsewhere unlinked at once): the system
    frees it when it is closed and unmapped, even when the process is killed, so no copy of the input is left."""
    return tempfile.TemporaryFile(prefix="dprelease-input-copy-")
