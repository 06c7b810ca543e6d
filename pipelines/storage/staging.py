"""A run's staging prefix in an object store: where the workers of a distributed engine write a release's parts
when the release is published to a store (`s3://`, `gs://`, `hdfs://`), so that no directory shared between the
driver and the workers is needed.

    driver   new_remote_staging   a fresh prefix beside the release's, `.<release-id>.staging+<owner>+...`, holding a
                                  marker object with a random token of this run
    workers  open_remote_staging  refuse to write unless the marker holds the run's token (a worker that reaches
                                  another store, or a stale prefix, writes nothing)
             put_part             one object per part file, streamed and whole (an object store's PUT is atomic; a
                                  file system's file is renamed into place); its entry (name, SHA-256, size) goes
                                  back to the driver
    driver   check_remote_staged  the prefix holds exactly the reported parts with their sizes (and the marker):
                                  a missing, short, extra or odd-named object refuses the release
             upload_release       (`objects`) each part copied inside the store into the release's prefix, the
                                  driver's own files uploaded, `manifest.json` last
             remove_remote_staging  the prefix removed after a commit or a failure; what cannot be removed is named
                                  (`StagedPartsLeft`)

The parts are noisy values in the store from the moment a worker writes them, so the run that stages them is
charged before its workers start and never refunded (`pipelines.run`): a killed driver, a task attempt still
writing after the prefix was removed, or a versioned bucket can leave them readable.

A driver killed before it could remove its prefix leaves it behind: the next run of the same release on the same
host removes the prefixes of runs whose process is gone (`remove_stale_remote`), as it does local staging
directories (`pipelines.housekeeping`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Collection

import pyarrow as pa
import pyarrow.fs as pafs

from dprelease.accounting.errors import DPReleaseError
from dprelease.accounting.redact import shown

from .local import safe_relative
from .objects import RemoteRelease, list_prefix, open_release
from .uris import Store

LOG = logging.getLogger("dprelease")

STAGING_MARKER = ".dprelease-staging"
"""An object (or a file, in a local staging directory) holding a random token of its run: a worker writes a part
only where the marker holds its run's token. Removed before the manifest is written."""
MAX_MARKER_BYTES = 64
OWNER_TOKEN = re.compile(r"^[0-9]+\.[0-9]+$")
"""The `pid.start` of a staging prefix's owner: a prefix whose name holds anything else is never removed."""


class StagedPartsLeft(DPReleaseError):
    """A failed run's staged parts (noisy values) could not all be removed from the store (the run was charged
    before they were written)."""


@dataclass(frozen=True)
class RemoteStaging:
    """A run's staging prefix in a store (`path`, the store's path) and its run's token."""

    store: Store
    path: str
    query: str
    token: str

    @property
    def uri(self) -> str:
        """The prefix's URI with its connection settings (what the workers open)."""
        return self.store.uri(self.path) + (f"?{self.query}" if self.query else "")

    def object_path(self, relative: str) -> str:
        return f"{self.path}/{relative}"


def new_remote_staging(release: RemoteRelease, name_prefix: str, owner_tag: str) -> RemoteStaging:
    """A fresh staging prefix beside `release`'s (`<parent>/<name_prefix><owner_tag><random>`, never inside a
    release; no '@' in it, which a URI would read as user info), its marker written first."""
    parent = release.path.rsplit("/", 1)[0]
    staging = RemoteStaging(release.store, f"{parent}/{name_prefix}{owner_tag}{os.urandom(4).hex()}",
                            release.query, os.urandom(16).hex())
    with release.store.filesystem.open_output_stream(staging.object_path(STAGING_MARKER)) as out:
        out.write(staging.token.encode())
    return staging


def open_remote_staging(uri: str, token: str) -> RemoteStaging:
    """In a worker: the staging prefix at `uri`, once its marker is seen to hold `token`; DPReleaseError (nothing
    written) otherwise."""
    prefix = open_release(uri, "staging")  # the store, its path and connection settings, as any release's
    staging = RemoteStaging(prefix.store, prefix.path, prefix.query, token)
    try:
        with staging.store.filesystem.open_input_stream(staging.object_path(STAGING_MARKER)) as handle:
            found = handle.read(MAX_MARKER_BYTES).decode("ascii", "replace")
    except (pa.ArrowException, OSError):
        found = None
    if found != token:
        raise DPReleaseError(f"the staging prefix {shown(staging.uri)} is not this run's as the driver made it "
                             "(another store, or a prefix of an earlier run); nothing was written")
    return staging


class _Hashed:
    """A writable file that hashes and counts what passes through it into `target` (a store's output stream)."""

    def __init__(self, target):
        self.target, self.sha256, self.size, self.closed = target, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        data = memoryview(data)
        self.sha256.update(data)
        self.size += data.nbytes
        self.target.write(data)
        return data.nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def put_part(staging: RemoteStaging, relative: str, write: Callable) -> dict:
    """Write one part file, streamed by `write(sink)` (a writable file), as one object; its manifest entry (name,
    SHA-256, bytes). Whole when a reader sees it: an object store's PUT is atomic (a retried task attempt puts the
    same bytes again); in a file system (hdfs://) it is written under a temporary name and renamed into place."""
    if safe_relative(relative) is None or relative == STAGING_MARKER:
        raise ValueError(f"{relative!r}: not a plain relative name")
    filesystem = staging.store.filesystem
    target = staging.object_path(relative)
    written = target if staging.store.holds_objects else \
        f"{target.rsplit('/', 1)[0]}/.{target.rsplit('/', 1)[1]}.{os.urandom(6).hex()}.tmp"
    with filesystem.open_output_stream(written) as out:
        hashed = _Hashed(out)
        write(pa.PythonFile(hashed, mode="w"))
    if written != target:
        filesystem.move(written, target)
    return {"path": relative, "sha256": hashed.sha256.hexdigest(), "bytes": hashed.size}


def check_remote_staged(staging: RemoteStaging, entries: list[dict], folders: Collection[str]) -> None:
    """The staging prefix holds exactly the parts the workers reported, each with its size and in one of the
    release's `folders` for parts (never where the driver writes its own files), and the marker: DPReleaseError
    (public: names and counts only) otherwise."""
    paths = [e["path"] for e in entries]
    if len(set(paths)) != len(paths):
        raise DPReleaseError("the workers reported a release file twice")
    outside = [p for p in paths if safe_relative(p) is None or p.split("/", 1)[0] not in folders or "/" not in p]
    if outside:
        raise DPReleaseError(f"the workers reported {len(outside)} file(s) outside the release's folders for parts "
                             f"({', '.join(sorted(folders))}); nothing is published")
    listing = list_prefix(staging.store, staging.path)
    if listing.odd:
        raise DPReleaseError(f"the staging prefix {shown(staging.uri)} holds {len(listing.odd)} object(s) whose names "
                             "are not plain; nothing is published from it")
    held = dict(listing.files)
    held.pop(STAGING_MARKER, None)
    for entry in entries:
        if held.pop(entry["path"], None) != entry["bytes"]:
            raise DPReleaseError(f"release file {entry['path']}: reported by a worker but not found in "
                                 f"{shown(staging.uri)} with its size")
    if held:
        raise DPReleaseError(f"the staging prefix {shown(staging.uri)} holds {len(held)} object(s) no worker "
                             "reported (e.g. " + repr(sorted(held)[0]) + "); nothing is published from it")


def remove_remote_staging(staging: RemoteStaging) -> list[str]:
    """Remove every object under the staging prefix, each by the plain name it was listed under (`list_prefix`: an
    odd name is never removed, since a store could read it as another object's); the names still there afterwards
    (empty when all went)."""
    filesystem = staging.store.filesystem
    try:
        listing = list_prefix(staging.store, staging.path)
        if listing.odd:
            for relative in listing.files:
                filesystem.delete_file(staging.object_path(relative))
        else:  # plain names only: the prefix goes whole (with any directory markers a store's client made)
            filesystem.delete_dir(staging.path)
        left = list_prefix(staging.store, staging.path)
    except (pa.ArrowException, OSError):
        return [staging.path]  # cannot be told: counted as left
    return sorted(left.files) + left.odd


def remove_stale_remote(store: Store, parent: str, name_prefix: str, process_alive) -> list[str]:
    """Remove the prefixes `<parent>/<name_prefix><pid.start>+<host~boot~pidns>+...` (a run's staging prefix beside
    its release, a Beam launcher's result directory under its --temp_location) whose process (`process_alive(host,
    token)`) is known to be gone; a prefix of another host, a live run's, or one whose name does not parse is left
    alone. One listing of `parent`, not recursive, through pyarrow (no client-side backoff on an empty listing); a
    store that cannot be listed removes nothing and says so (a warning naming the location and the kind of error).
    Returns the URIs removed."""
    try:
        infos = store.filesystem.get_file_info(pafs.FileSelector(parent, recursive=False, allow_not_found=True))
    except (pa.ArrowException, OSError) as error:
        LOG.warning("could not list %s to remove what killed runs left there (%s); nothing removed",
                    shown(store.uri(parent)), type(error).__name__)
        return []
    removed = []
    for info in infos:
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        if info.type != pafs.FileType.Directory or not name.startswith(name_prefix) or safe_relative(name) is None:
            continue
        token, _, rest = name[len(name_prefix):].partition("+")
        if OWNER_TOKEN.fullmatch(token) and process_alive(rest.partition("+")[0], token) is False:
            if not remove_remote_staging(RemoteStaging(store, f"{parent}/{name}", "", "")):
                removed.append(store.uri(f"{parent}/{name}"))
    return removed
