"""The one guarded layer for every read and write, local and remote. Every entry point (each CLI command, the
Python API, the Beam composite, `ledger reconcile`) and the workers of every engine go through it; none writes
checks of its own.

    uris      locations by URI (s3://, gs://, hdfs://, file://): credentials never in a URI, paths plain,
              every listed object under its prefix with a plain, distinct name (`list_files`)
    local     files inside a root opened component by component, links never followed, regular files only,
              reads bounded (`read_inside`, `tree_entries`); files a user names read without blocking and
              bounded (`read_named`); private directories and files, owner-only, never by a chmod of
              something that existed (`private_directory`, `write_private`)
    targets   outputs: never inside a published release, never over a link, an existing target only with
              overwrite, written whole (`check_output_file`, `check_release_target`, `write_atomically`)
    objects   releases in object stores: odd object names never read, written over or removed as the names they
              look like (`list_prefix`), staged parts copied and read back by the workers where the engine has
              them (`copy_checked`), manifest last, bounded downloads (`downloaded`)
    staging   a run's staging prefix in a store: workers write parts only under the driver's marker, the driver
              checks exactly what they reported before anything is copied into the release (`new_remote_staging`)
    counted   input files parsed only from a private copy whose bytes are those the release key is bound to
              (`fingerprint_files`, `verified_copy`)

Every message renders locations with `dprelease.accounting.redact.shown` (no user info, query or control
characters).
"""
from .counted import FileDigest, InputChanged, fingerprint_files, verified_copy
from .local import (UnsafeFile, buffer_inside, inside, open_file, open_inside, private_directory, read_inside,
                    read_named, read_regular, read_regular_start, regular_directory, safe_relative, tree_entries,
                    write_private)
from .objects import (Listing, LocalCopy, PartCopier, RemoteRelease, check_remote_target, copy_checked, downloaded,
                      list_prefix, open_release, read_manifest_bytes, release_under, upload_release)
from .staging import (STAGING_MARKER, RemoteStaging, StagedPartsLeft, check_remote_staged, new_remote_staging,
                      open_remote_staging, put_part, remove_remote_staging, remove_stale_remote)
from .targets import (MANIFEST, check_outside_releases, check_output_file, check_release_target, release_holding,
                      write_atomically)
from .uris import PUBLIC_OPTIONS, Store, as_location, file_info, is_uri, list_files, local_path, open_store

__all__ = ["FileDigest", "InputChanged", "fingerprint_files", "verified_copy", "UnsafeFile", "buffer_inside",
           "inside", "open_file", "open_inside", "private_directory", "read_inside", "read_named", "read_regular",
           "read_regular_start", "regular_directory", "safe_relative", "tree_entries", "write_private", "Listing", "LocalCopy",
           "PartCopier", "RemoteRelease", "check_remote_target", "copy_checked", "downloaded", "list_prefix",
           "open_release", "read_manifest_bytes", "release_under", "upload_release", "STAGING_MARKER", "RemoteStaging",
           "StagedPartsLeft",
           "check_remote_staged", "new_remote_staging", "open_remote_staging", "put_part", "remove_remote_staging",
           "remove_stale_remote", "MANIFEST", "check_outside_releases", "check_output_file", "check_release_target",
           "release_holding", "write_atomically", "PUBLIC_OPTIONS", "Store", "as_location", "file_info", "is_uri",
           "list_files", "local_path", "open_store"]
