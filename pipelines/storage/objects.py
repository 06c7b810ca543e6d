"""Releases in an object store (s3://, gs://, hdfs:// through pyarrow's filesystems, as inputs are: `storage`).

An object store has no atomic rename, so a release is published there as it is written nowhere else: staged
on the driver's local disk (or, for the parts the workers of a distributed engine write, in a staging prefix of
the run in the same store: `staging`), then uploaded (or copied inside the store) file by file with
`manifest.json` last. A
release exists in the store once its manifest does: readers (verify, report, `ReleaseResult.open`, `ledger
reconcile`) start from the manifest. Objects under a release's prefix without one (an upload that failed, or
anything else) are never removed without `--overwrite`: a rerun with the same key and `--overwrite` replaces
them and republishes at no further cost.

Reading one back (verify, report) downloads it into a private temporary directory, each object read at most
to the size its manifest states (plus one byte, so a longer object is a mismatch, not a long read); then the
local checks run on the copy unchanged.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from dprelease.accounting.errors import DPReleaseError, SpecError
from dprelease.accounting.redact import shown

from ..housekeeping import shielded
from .local import safe_relative
from .targets import MANIFEST
from .uris import Store, is_uri, open_store

MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest read (verify's bound too)."""

UNLISTED_READ = 1 << 20
"""Bytes read of an object the manifest does not list (enough for verify to name it as unlisted)."""
COPY_BLOCK = 8 << 20
COPY_THREADS = 8
"""Staged parts copied into a release (and read back) at once: each copy waits on the store, not on this process."""
COPY_REQUEST_TIMEOUT = 900.0
"""Seconds an S3 server-side copy of one staged part may go without a byte back. The AWS SDK's default (3 s, what
pyarrow uses unless the URI sets `request_timeout`) ended the copy of a 100 MB part on a busy S3-compatible server
(a 200-million-cell block release, 2026-11-28); a store copies a large object before it answers."""
COPY_DRAIN_SECONDS = 10.0
"""After a copy fails or the run is interrupted (SIGTERM, Ctrl-C), how long the copies under way get to end before
the upload's clean-up runs without them: a store that never answers (each copy may wait COPY_REQUEST_TIMEOUT, and
the SDK retries) never holds a stopping run past an orchestrator's grace period."""

LOG = logging.getLogger("dprelease")


@dataclass(frozen=True)
class RemoteRelease:
    """A release directory in a store: `path` is the store's path of the release's prefix."""

    store: Store
    path: str
    query: str = ""

    @property
    def uri(self) -> str:
        """The release's URI, with the connection settings it was named with (public: see storage)."""
        return self.store.uri(self.path) + (f"?{self.query}" if self.query else "")

    def object_path(self, relative: str) -> str:
        return f"{self.path}/{relative}"

    def exists(self) -> bool:
        """Published: its manifest is there."""
        info = self.store.filesystem.get_file_info(self.object_path(MANIFEST))
        return info.type == pafs.FileType.File

    def listing(self) -> "Listing":
        """Every object under the release's prefix (`list_prefix`)."""
        return list_prefix(self.store, self.path)


@dataclass(frozen=True)
class Listing:
    """The objects under a prefix: `files`, those with a plain relative name (relative path -> size), and `odd`,
    the names of the others (`..`, `.` or empty components, a backslash, or an object that is also the prefix of
    other objects), which a store normalises into other names: never read, written over or removed as if they
    were the names they look like."""

    files: dict[str, int]
    odd: list[str]


def list_prefix(store: Store, path: str) -> Listing:
    """Every object below `path` (a prefix; the objects `path/...`), each shown to lie under it with a plain,
    distinct name, or set aside as odd (see `Listing`): also an object that is the prefix of any other (`a` and
    `a/b`), and a "directory" entry that holds no listed object (a key ending in '/', which may carry content)."""
    selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
    infos = store.filesystem.get_file_info(selector)
    named = sorted((info.path, info.size) for info in infos if info.type == pafs.FileType.File)
    names = [name for name, _ in named]
    ancestors = {parent for name in names for parent in _parents(name, path)}
    files, odd = {}, []
    for i, (name, size) in enumerate(named):
        relative = name[len(path) + 1:] if name.startswith(path + "/") else None
        repeated = (i > 0 and names[i - 1] == name) or (i + 1 < len(names) and names[i + 1] == name)
        if relative is None or safe_relative(relative) is None or name in ancestors or repeated:
            odd.append(relative if relative is not None else name)
        else:
            files[relative] = size
    for info in infos:
        if info.type == pafs.FileType.Directory and info.path.rstrip("/") not in ancestors:
            odd.append(info.path[len(path) + 1:] + "/" if info.path.startswith(path + "/") else info.path + "/")
    return Listing(files, sorted(set(odd)))


def _parents(name: str, root: str) -> list[str]:
    """The prefixes of an object's name below `root` (`root/a/b/c` -> `root/a`, `root/a/b`)."""
    parts = name[len(root) + 1:].split("/") if name.startswith(root + "/") else []
    return [f"{root}/{'/'.join(parts[:i])}" for i in range(1, len(parts))]


def open_release(uri: str, field: str) -> RemoteRelease:
    """The release at `uri` (SpecError, exit 2, for a URI the storage rules refuse, a path with `..` among them)."""
    store, path = open_store(uri, field)
    return RemoteRelease(store, path.rstrip("/"), uri.split("?", 1)[1] if "?" in uri else "")


def release_under(root_uri: str, release_id: str, field: str) -> RemoteRelease:
    """The release `release_id` under the output URI `root_uri`."""
    root = open_release(root_uri, field)
    return RemoteRelease(root.store, f"{root.path}/{release_id}", root.query)


def check_remote_target(release: RemoteRelease, overwrite: bool) -> dict[str, int]:
    """Refuse to publish where the store holds anything under the release's prefix (a release, the leftovers of
    a failed upload, or other objects) without `overwrite`, as a local run refuses an existing directory; and
    always where it holds an object with an odd name (`Listing`): removing it would remove another object (a
    store normalises `a/../b` to `b`), so it is named for its owner to remove. Also refused: a release prefix
    inside another published release (a manifest at any prefix above it). Returns what the prefix holds (the
    plain-named objects, `Listing.files`)."""
    try:
        listing = release.listing()
        holder = release_above(release)
    except (pa.ArrowException, OSError) as error:
        raise SpecError(f"output: {shown(release.uri)}: cannot be reached ({type(error).__name__})") from None
    if holder is not None:
        raise SpecError(f"output: {shown(release.uri)} lies inside the published release {shown(holder)}; "
                        "publish beside it, never into it")
    if listing.odd:
        names = ", ".join(repr(shown(n)) for n in listing.odd[:5])
        raise SpecError(f"output: {shown(release.uri)} holds object(s) whose names are not plain ({names}); a "
                        "store reads them as other names, so nothing is written or removed there: remove them")
    held = listing.files
    if held and not overwrite:
        what = "a release" if MANIFEST in held else f"{len(held)} object(s) but no manifest (a failed upload?)"
        raise SpecError(f"output: {shown(release.uri)} already holds {what}; pass --overwrite to replace it")
    return held


def release_above(release: RemoteRelease) -> str | None:
    """The URI of a published release whose prefix holds `release`'s (a manifest at a prefix above it)."""
    parts = release.path.split("/")
    first = 1 if release.store.holds_objects else 0  # the bucket itself holds no manifest of ours
    for end in range(len(parts) - 1, first, -1):
        above = "/".join(parts[:end])
        info = release.store.filesystem.get_file_info(f"{above}/{MANIFEST}")
        if info.type == pafs.FileType.File:
            return release.store.uri(above)
    return None


def upload_release(local_dir: Path, release: RemoteRelease, overwrite: bool,
                   staged_parts: Sequence[tuple[str, str, str]] = (), copier: PartCopier | None = None) -> None:
    """Publish the staged release at `local_dir` to the store: with `overwrite`, what the prefix holds is removed
    first (a manifest first, so it stops being a release); then every part the workers staged in the same store
    (`staged_parts`: (its path in the store, its name in the release, the SHA-256 its worker reported)) is copied
    inside the store and read back (by `copier` in the engine's workers, `copy_checked` on each of their shares,
    or else here, COPY_THREADS at once; DPReleaseError unless its bytes are those reported, which the manifest
    lists), every local file uploaded, the manifest last: a reader never sees a manifest whose files are not all
    there, nor one that lists other bytes than the release holds."""
    old = check_remote_target(release, overwrite)  # no odd names: every object removed is the one listed
    filesystem = release.store.filesystem
    if MANIFEST in old:
        filesystem.delete_file(release.object_path(MANIFEST))
    if old:  # plain names only (checked): the prefix emptied whole, with the directory markers a client leaves
        filesystem.delete_dir_contents(release.path, missing_dir_ok=True)
    for _, relative, _ in staged_parts:
        if safe_relative(relative) is None or relative == MANIFEST:
            raise ValueError(f"{relative!r}: not a part's name")

    copying = _copying(filesystem) if copier is None else filesystem
    written: list[str] = []  # every object this upload writes (or may have begun to write), by name

    def copy(part: tuple[str, str, str]) -> None:
        source, relative, sha256 = part
        written.append(release.object_path(relative))
        _check_copied(release, [part], [(relative, _copy_and_digest(copying, filesystem, source,
                                                                    release.object_path(relative)))])

    copies = _Copies(copy, staged_parts if copier is None else ())
    in_workers = False  # while the engine's workers copy: what they began may land after a failure here
    try:
        copies.run()
        if copier is not None and staged_parts:
            written.extend(release.object_path(relative) for _, relative, _ in staged_parts)  # any may have begun
            in_workers = True
            digests = copier(release.uri, release.path, staged_parts)
            in_workers = False
            _check_copied(release, staged_parts, digests)
            _check_landed(release, staged_parts)
        files = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
        for relative in [f for f in files if f != MANIFEST] + [MANIFEST]:
            written.append(release.object_path(relative))
            _upload_file(local_dir / relative, filesystem, release.object_path(relative))
    except BaseException:
        running = 0
        with shielded():  # a later SIGTERM never cuts the clean-up short; a second Ctrl-C never skips it
            try:
                running = copies.stop()
            finally:
                _remove_unpublished(release, written, local_dir / MANIFEST)
        if running:
            LOG.warning("%d cop%s into %s still under way after %.0f s when the upload stopped: what %s may be "
                        "left under the release's prefix (no manifest; a re-run needs --overwrite)", running,
                        "y" if running == 1 else "ies", shown(release.uri), COPY_DRAIN_SECONDS,
                        "it writes" if running == 1 else "they write")
        elif in_workers:
            LOG.warning("the upload to %s stopped while the engine's workers copied parts into it: a copy the store "
                        "had already received may still land under the release's prefix (no manifest; a re-run "
                        "needs --overwrite)", shown(release.uri))
        raise


PartCopier = Callable[[str, str, Sequence[tuple[str, str, str]]], Sequence[tuple[str, str]]]
"""An engine's copy of staged parts into a release (`Engine.copy_parts`): (the release's URI, its path in the store,
the parts as `upload_release` takes them) -> (name in the release, SHA-256 of the copy read back) for each, made
by `copy_checked` in its workers."""


def copy_checked(release_uri: str, release_path: str, parts: Sequence[tuple[str, str, str]]
                 ) -> list[tuple[str, str]]:
    """In a worker: each staged part copied inside the store into the release at `release_uri` (credentials from
    the worker's environment, as for its staging writes), COPY_THREADS at once, and read back: (name in the
    release, SHA-256 of the copy) for each. The driver compares them with what the writing workers reported
    (`upload_release`); the bytes never pass through the driver, so the commit scales with the workers. Nothing
    is copied unless the URI opens here at the driver's `release_path` (a URI whose path does not read back the
    same, '%41' decoded twice, would copy into another prefix)."""
    release = open_release(release_uri, "--out")
    if release.path != release_path:
        raise DPReleaseError(f"the release's URI {shown(release_uri)} names another path in the workers than on "
                             "the driver: nothing copied")
    filesystem = release.store.filesystem
    copying = _copying(filesystem)
    digests: list[tuple[str, str]] = []

    def copy(part: tuple[str, str, str]) -> None:
        source, relative, _ = part
        digest = _copy_and_digest(copying, filesystem, source, release.object_path(relative))
        with lock:
            digests.append((relative, digest))

    lock = threading.Lock()
    _Copies(copy, parts).run()
    return digests


def _copy_and_digest(copying: pafs.FileSystem, filesystem: pafs.FileSystem, source: str, target: str) -> str:
    """`source` copied inside the store to `target`, and the SHA-256 of the copy as read back."""
    copying.copy_file(source, target)
    return _object_sha256(filesystem, target)


def _check_copied(release: RemoteRelease, parts: Sequence[tuple[str, str, str]],
                  digests: Sequence[tuple[str, str]]) -> None:
    """DPReleaseError unless every part's copy was read back with the SHA-256 its writing worker reported, each
    reported once and nothing else reported."""
    names = [relative for relative, _ in digests]
    if len(set(names)) != len(names) or not set(names) <= {relative for _, relative, _ in parts}:
        raise DPReleaseError(f"the copies into {shown(release.uri)}: {len(names)} digests reported for "
                             f"{len(parts)} parts, some twice or for parts never asked for")
    found = dict(digests)
    for _, relative, sha256 in parts:
        if found.get(relative) != sha256:
            raise DPReleaseError(f"release file {relative}: copied into {shown(release.uri)} with other bytes than "
                                 "its worker wrote (rewritten while the run published?)" if relative in found else
                                 f"release file {relative}: its copy into {shown(release.uri)} was not reported")


def _check_landed(release: RemoteRelease, parts: Sequence[tuple[str, str, str]]) -> None:
    """After an engine's workers copied the parts: each is under the release's prefix with its staged object's
    size (listings only, no byte read; DPReleaseError otherwise), so no digest stands for an object that is not
    where the manifest will say."""
    landed = release.listing().files
    folders = {str(PurePosixPath(source).parent) for source, _, _ in parts}
    staged = {}
    for folder in folders:
        for info in release.store.filesystem.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
            if info.type == pafs.FileType.File:
                staged[info.path] = info.size
    for source, relative, _ in parts:
        if relative not in landed or landed[relative] != staged.get(source):
            raise DPReleaseError(f"release file {relative}: not in {shown(release.uri)} with its staged size after "
                                 "the workers copied it")


class _Copies:
    """`copy(part)` for every part, COPY_THREADS at once on daemon threads (each waits on the store, not on this
    process). The first failure stops parts not yet started and is raised once the copies under way end; so is an
    interruption of the waiting thread (SIGTERM, Ctrl-C), after `stop`. A copy that never ends holds neither: the
    threads are daemons, never joined at exit (a thread pool's are, for as long as the store keeps them)."""

    def __init__(self, copy, parts: Sequence[tuple[str, str, str]]):
        self._copy = copy
        self._parts = list(parts)
        self._pending = iter(self._parts)
        self._changed = threading.Condition()
        self._stopped = False
        self._failure: BaseException | None = None
        self._running = 0
        self._deadline: float | None = None

    def run(self) -> None:
        """Every copy, or the first failure raised (the others under way ended or drained: `stop`)."""
        for i in range(min(COPY_THREADS, len(self._parts))):
            thread = threading.Thread(target=self._work, name=f"dprelease-copy-{i}", daemon=True)
            with self._changed:
                self._running += 1  # counted before it starts: its `_work` counts it down however it ends
            try:
                thread.start()
            except BaseException:  # not started (no thread left), or a signal while it started
                with self._changed:
                    self._stopped = True
                    if thread.ident is None:
                        self._running -= 1
                raise
        with self._changed:
            while self._running > 0 and self._failure is None:
                self._changed.wait()
        if self._failure is not None:
            self.stop()
            raise self._failure

    def stop(self) -> int:
        """Start no further copy; wait up to COPY_DRAIN_SECONDS for those under way. Returns how many still run."""
        with self._changed:
            self._stopped = True
            if self._deadline is None:
                self._deadline = time.monotonic() + COPY_DRAIN_SECONDS
            while self._running > 0 and (left := self._deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return max(self._running, 0)

    def _next(self) -> tuple[str, str, str] | None:
        with self._changed:
            return None if self._stopped else next(self._pending, None)

    def _work(self) -> None:
        try:
            while (part := self._next()) is not None:
                try:
                    self._copy(part)
                except BaseException as error:  # noqa: BLE001 - raised in the waiting thread
                    with self._changed:
                        self._stopped = True
                        self._failure = self._failure or error
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()


def _copying(filesystem: pafs.FileSystem) -> pafs.FileSystem:
    """The store's filesystem for server-side copies: an S3 one with a request timeout of at least
    COPY_REQUEST_TIMEOUT (its other options, credentials included, as they are); any other as it is."""
    if not isinstance(filesystem, pafs.S3FileSystem):
        return filesystem
    rebuild, (options,) = filesystem.__reduce__()  # pyarrow's own pickling: every option the filesystem holds
    if options.get("request_timeout", -1.0) >= COPY_REQUEST_TIMEOUT:
        return filesystem
    return rebuild({**options, "request_timeout": COPY_REQUEST_TIMEOUT})


def _remove_unpublished(release: RemoteRelease, written: Sequence[str], own_manifest: Path) -> None:
    """After a failed upload, the objects it wrote, by name, and then the directory markers a client leaves for
    them below the release's prefix, deepest first, each only while it holds nothing (a listing reads an empty
    marker as an odd name): a failure leaves no partial release. Never the prefix whole: objects another run
    wrote under it meanwhile (a release inside it) stay. Nothing at all when the prefix holds a manifest other
    than this run's: another run published this release while this one copied (its parts bear the same names).
    A store that cannot be reached keeps what it holds (the run's error says a re-run needs --overwrite)."""
    filesystem = release.store.filesystem
    with contextlib.suppress(pa.ArrowException, OSError):
        if filesystem.get_file_info(release.object_path(MANIFEST)).type == pafs.FileType.File and \
                _read_bounded(release, MANIFEST, MAX_MANIFEST_BYTES) != own_manifest.read_bytes():
            return
        for path in written:
            with contextlib.suppress(FileNotFoundError):
                filesystem.delete_file(path)
        markers = {parent for path in written for parent in _parents(path, release.path)}
        for marker in sorted(markers, key=lambda m: -m.count("/")):
            held = pafs.FileSelector(marker, recursive=True, allow_not_found=True)
            if not filesystem.get_file_info(held):
                filesystem.delete_dir(marker)


def _object_sha256(filesystem: pafs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as handle:
        while block := handle.read(COPY_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _upload_file(local: Path, filesystem: pafs.FileSystem, path: str) -> None:
    with open(local, "rb") as source, filesystem.open_output_stream(path) as target:
        shutil.copyfileobj(source, target, COPY_BLOCK)


def _read_bounded(release: RemoteRelease, relative: str, limit: int) -> bytes:
    with release.store.filesystem.open_input_stream(release.object_path(relative)) as handle:
        return handle.read(limit)


def copy_bounded(release: RemoteRelease, relative: str, limit: int, target: Path) -> None:
    """At most `limit` bytes of an object into `target`, a block at a time."""
    with release.store.filesystem.open_input_stream(release.object_path(relative)) as handle, \
            open(target, "wb") as out:
        while limit > 0:
            block = handle.read(min(COPY_BLOCK, limit))
            if not block:
                break
            out.write(block)
            limit -= len(block)


MAX_LISTED_BYTES = 1 << 50
"""A manifest's claimed file size above this is not a size (verify reports the file as mismatched)."""
MAX_UNLISTED_OBJECTS = 100
"""Unlisted objects read (UNLISTED_READ bytes each) before the rest are named only (empty local files)."""


def _listed_sizes(manifest_bytes: bytes) -> dict[str, int]:
    """The files the manifest lists and their sizes ({} for a manifest that does not parse: verify says why)."""
    try:
        manifest = json.loads(manifest_bytes)
        files = manifest["files"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return {}
    sizes = {}
    for entry in files if isinstance(files, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("bytes"), int) \
                and 0 <= entry["bytes"] <= MAX_LISTED_BYTES:
            sizes[entry["path"]] = entry["bytes"]
    return sizes


@dataclass(frozen=True)
class LocalCopy:
    """A release downloaded from a store: `path`, the private local copy, and `odd`, the names of objects under
    its prefix that could not be copied as themselves (`Listing`): each one a mismatch for verify."""

    path: Path
    odd: tuple[str, ...] = ()


@contextlib.contextmanager
def downloaded(uri: str, field: str = "RELEASE") -> Iterator[LocalCopy]:
    """A local, private copy of the release at `uri`, removed afterwards. Each object is read at most to the
    smaller of its size and its listed size plus one byte (so a longer object is a mismatch, not a long read);
    unlisted objects to UNLISTED_READ bytes, the first MAX_UNLISTED_OBJECTS of them (the rest named by empty
    files); objects with odd names are never read and are named in `odd`, and so is an object that cannot be read
    under the name it is listed by (a key ending in '/', say): each a mismatch for verify."""
    release = open_release(uri, field)
    where = shown(uri)
    try:
        listing = release.listing()
    except (pa.ArrowException, OSError) as error:
        raise DPReleaseError(f"{field} = {where!r}: cannot be listed ({type(error).__name__})") from None
    objects = listing.files
    if MANIFEST in listing.odd:
        raise DPReleaseError(f"{field} = {where!r}: {MANIFEST} is also the prefix of other objects, so which object "
                             "is the manifest cannot be told: not a release as dprelease publishes one")
    if MANIFEST not in objects:
        raise DPReleaseError(f"{field} = {where!r}: no {MANIFEST} there: not a published release")
    holder = Path(tempfile.mkdtemp(prefix="dprelease-download-"))
    try:
        copy = holder / PurePosixPath(release.path).name
        copy.mkdir(mode=0o700)
        try:
            manifest_bytes = _read_bounded(release, MANIFEST, MAX_MANIFEST_BYTES + 1)
        except (pa.ArrowException, OSError) as error:
            raise DPReleaseError(f"{field} = {where!r}: {MANIFEST} cannot be read ({type(error).__name__})") \
                from None
        (copy / MANIFEST).write_bytes(manifest_bytes)
        listed = _listed_sizes(manifest_bytes)
        unlisted = 0
        unreadable: list[str] = []
        for relative, size in sorted(objects.items()):
            if relative == MANIFEST:
                continue
            target = copy / relative
            if relative in listed:
                limit = min(size, listed[relative] + 1)
            else:
                unlisted += 1
                limit = UNLISTED_READ if unlisted <= MAX_UNLISTED_OBJECTS else 0
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                copy_bounded(release, relative, limit, target)
            except (pa.ArrowException, OSError):  # listed, but not readable under that name: a mismatch
                unreadable.append(relative)
                with contextlib.suppress(OSError):
                    target.unlink(missing_ok=True)
        yield LocalCopy(copy, tuple(listing.odd) + tuple(unreadable))
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def read_manifest_bytes(uri: str) -> bytes | None:
    """The manifest object of the release at `uri` (bounded), or None when there is none (for reconcile)."""
    try:
        release = open_release(uri, "release_dir")
        if not release.exists():
            return None
        data = _read_bounded(release, MANIFEST, MAX_MANIFEST_BYTES + 1)
    except (DPReleaseError, pa.ArrowException, OSError):
        return None
    return data if len(data) <= MAX_MANIFEST_BYTES else None


__all__ = ["Listing", "LocalCopy", "PartCopier", "RemoteRelease", "check_remote_target", "copy_checked", "downloaded",
           "is_uri", "list_prefix", "open_release", "read_manifest_bytes", "release_under", "upload_release"]
