"""Where an input lives: a local path, or a URI read through pyarrow's filesystems (s3:// and S3-compatible
stores, gs://, hdfs://, file://, where their client libraries are present).

A URI is public (it is in the spec, which the manifest publishes, or on the command line, which provenance
records): it must never carry credentials. Those come from the environment or the store's usual configuration
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, an instance role, GOOGLE_APPLICATION_CREDENTIALS, Kerberos).
Connection settings that are not secret (`endpoint_override`, `scheme`, `region`) may be given as the URI's
query, as pyarrow reads them: `s3://bucket/persons/?endpoint_override=minio.internal:9000&scheme=http`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from dprelease.accounting.errors import SpecError
from dprelease.accounting.redact import shown

URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
PUBLIC_OPTIONS = {
    "s3": frozenset({"region", "scheme", "endpoint_override", "allow_bucket_creation", "allow_bucket_deletion",
                     "tls_ca_file_path"}),
    "gs": frozenset({"scheme", "endpoint_override", "retry_limit_seconds", "project_id"}),
    "hdfs": frozenset({"replication", "buffer_size", "default_block_size", "user"}),
}
"""The stores an input URI may name, and the query options of each that are connection settings, not secrets.
An allow-list: pyarrow passes other options on as credentials (s3 secret_key, gs access_token, Azure
client_secret, SAS signatures) or, for HDFS, into Hadoop's configuration (hdfs_token), and a URI is published. Only
options pyarrow's `from_uri` takes (it refuses an s3 URI's connect_timeout or request_timeout)."""
PUBLIC_OPTIONS["gcs"] = PUBLIC_OPTIONS["gs"]


def is_uri(text: str) -> bool:
    """A URI read through a store (file:// is a local path: `local_path`)."""
    return bool(URI.match(text)) and not text.startswith("file://")


def as_location(value: str | Path | None, base: Path | None = None) -> str | Path | None:
    """A directory named by a user: an object-store URI as given (text), else a path (from `base` when given)."""
    if value is None or (isinstance(value, str) and is_uri(value)):
        return value
    return Path(base) / value if base is not None else Path(value)


def local_path(text: str, field: str = "input.path") -> str:
    """A file:// URI as the local path it names (read like any local path, links checked); other text unchanged."""
    if not text.startswith("file://"):
        return text
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost") or parts.query:
        raise SpecError(f"{field} = {shown(text)!r}: a file:// URI names a local path (file:///path), "
                        "without host or options")
    return unquote(parts.path)


URI_PATH_SAFE = "/+=,;:@!$&'()*~"
"""Characters of a store path written as they are in its URI (RFC 3986's path characters); any other is
percent-quoted."""


@dataclass(frozen=True)
class Store:
    """A filesystem and the text that turns one of its paths back into the URI a user reads (`prefix` + path)."""

    filesystem: pafs.FileSystem
    prefix: str

    def uri(self, path: str) -> str:
        """The URI of `path`, percent-quoted so that it opens at `path` again (`open_store`, in a worker too):
        '%', '#', '?', spaces and non-ASCII characters of a name never change its meaning on the way."""
        return self.prefix + quote(path, safe=URI_PATH_SAFE)

    def path(self, uri: str) -> str:
        """`uri`'s path (`uri`'s inverse); text that is not one of this store's URIs unchanged."""
        return unquote(uri[len(self.prefix):]) if uri.startswith(self.prefix) else uri

    @property
    def holds_objects(self) -> bool:
        """An object store (s3, gs: paths start with the bucket), where one name can be both an object and the
        prefix of other objects; a file system (hdfs) cannot have both."""
        return self.prefix.endswith("://")


def check_uri(uri: str, field: str) -> None:
    """The checks of a URI that need no store (SpecError, exit 2, naming `field`): a scheme a store reads, no user
    info, only connection options (no credentials), and a plain path. Run on the spec's URIs when it is parsed, so
    `plan` refuses what `run` would."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in PUBLIC_OPTIONS:
        raise SpecError(f"{field} = {shown(uri)!r}: allowed: a local path, or an s3://, gs:// or hdfs:// URI")
    unknown = sorted({name for name, _ in parse_qsl(parts.query, keep_blank_values=True)} - PUBLIC_OPTIONS[scheme])
    if unknown or "@" in parts.netloc:
        what = "options other than connection settings" if unknown else "user info"
        raise SpecError(f"{field} = {shown(uri)!r}: the URI holds {what}, which could be credentials; give "
                        f"credentials through the environment or the store's configuration (allowed options for "
                        f"{scheme}://: {', '.join(sorted(PUBLIC_OPTIONS[scheme]))})")
    if not plain_store_path(unquote(parts.netloc + parts.path)):
        raise SpecError(f"{field} = {shown(uri)!r}: the path is not plain (no '..', '.' or empty components): a "
                        "store reads such a name as another one")


def open_store(uri: str, field: str) -> tuple[Store, str]:
    """(the store, the path of `uri` in it). SpecError (exit 2) naming `field` for a URI with credentials in it,
    a scheme no installed filesystem reads, or a store that cannot be reached."""
    check_uri(uri, field)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as error:
        raise SpecError(f"{field} = {shown(uri)!r}: cannot be opened ({type(error).__name__}: no installed "
                        "filesystem reads it, or its store cannot be reached)") from None
    if not plain_store_path(path):
        raise SpecError(f"{field} = {shown(uri)!r}: the path {shown(path)!r} is not plain (no '..', '.' or empty "
                        "components): a store reads such a name as another one")
    bucket_first = scheme in ("s3", "gs", "gcs")  # their paths start with the bucket
    return Store(filesystem, f"{scheme}://" if bucket_first else f"{scheme}://{parts.netloc}"), path


def plain_store_path(path: str) -> bool:
    """Whether a store path (bucket/prefix..., a trailing '/' allowed) has only plain components."""
    from .local import safe_relative

    trimmed = path.rstrip("/")
    return bool(trimmed) and safe_relative(trimmed.lstrip("/")) is not None


def file_info(store: Store, path: str, field: str) -> pafs.FileInfo:
    try:
        info = store.filesystem.get_file_info(path)
    except (pa.ArrowException, OSError) as error:
        raise SpecError(f"{field} = {shown(store.uri(path))!r}: cannot be read ({type(error).__name__})") from None
    if info.type == pafs.FileType.NotFound:
        raise SpecError(f"{field} = {shown(store.uri(path))!r}: no such file or directory")
    return info


def list_files(store: Store, path: str, field: str) -> list[str]:
    """Every file at or below `path` in the store, sorted, each shown to lie below `path` under a plain name that
    no other listed object shares once normalised (object stores have no links, but a key such as
    `in/../in/a.parquet` is read by the store as `in/a.parquet`, a second time, and `in6/../in/a.parquet` is
    outside `in6/`). An odd name, or an object that is also the prefix of other objects (which one was meant
    cannot be told), is a SpecError naming it (exit 2), before anything is read."""
    from .objects import list_prefix

    path = path.rstrip("/")
    info = file_info(store, path, field)
    if info.type == pafs.FileType.File and not store.holds_objects:
        return [info.path]
    try:
        listing = list_prefix(store, path)
    except (pa.ArrowException, OSError):
        listing = None  # a plain object: nothing below it
    if listing is not None and listing.odd:
        names = ", ".join(repr(shown(n)) for n in listing.odd[:5])
        raise SpecError(f"{field} = {shown(store.uri(path))!r}: holds object(s) whose names are not plain or are "
                        f"also prefixes of other objects ({names}{', ...' if len(listing.odd) > 5 else ''}); a "
                        "store reads such a name as another one (the same records twice, or records outside the "
                        "prefix): remove or rename them")
    files = sorted(f"{path}/{relative}" for relative in (listing.files if listing else {}))
    if info.type == pafs.FileType.File:
        if files:
            raise SpecError(f"{field} = {shown(store.uri(path))!r}: is an object and the prefix of {len(files)} "
                            "other objects; name one of them or remove the ambiguity")
        return [info.path]
    return files
