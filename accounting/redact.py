"""Redaction of secrets from text that may reach a manifest, a log or a console.

Privacy/confidentiality: a published manifest records the command line (provenance). A database URL on
it (`--ledger postgresql+psycopg://user:PASSWORD@host/db`) must not publish the password, whatever
characters it holds ('/', '?', '#', '@' and spaces included: SQLAlchemy accepts them unencoded), and
pipeline options passed through to Beam (`--s3_secret_access_key=...`, `--azure_connection_string=...`)
must not publish their values: only options on an allow-list of known public options keep theirs.
"""
from __future__ import annotations

import re

REDACTED = "***"
_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>.*)$", re.DOTALL)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@\s]*)@")
_SECRET_QUERY = re.compile(r"(?i)(?P<name>[?&;](?:password|passwd|pwd|secret|token|key|sslpassword|"
                           r"access_key|secret_key|sig|signature|credential)[a-z_]*=)[^&;#\s]*")

FLAG_OPTIONS = frozenset({"--overwrite", "--no-ledger", "--strict", "-v", "--verbose", "--help", "-h", "--version",
                          "--save_main_session", "--streaming", "--dry-run", "--recompute", "--json"})
"""Options that take no value."""
PUBLIC_OPTIONS = frozenset({
    # dprelease's own
    "--key-file", "--out", "--input", "--engine", "--master", "--runner", "--workers", "--ledger", "--internal-dir",
    "--sign-key", "--max-cells", "--public-key", "--period-unit", "--per-period", "--epsilon", "--rho",
    # Beam pipeline options that name public things (runner, placement, sizes, locations)
    "--project", "--region", "--zone", "--worker_zone", "--temp_location", "--staging_location", "--job_name",
    "--num_workers", "--max_num_workers", "--machine_type", "--worker_machine_type", "--disk_size_gb",
    "--autoscaling_algorithm", "--network", "--subnetwork", "--direct_num_workers", "--direct_running_mode",
    "--flink_master", "--parallelism", "--job_endpoint", "--environment_type", "--sdk_container_image",
    "--setup_file", "--requirements_file", "--experiments", "--default_sdk_harness_log_level", "--spark_master_url",
    "--sdk_location", "--max_parallelism",
})
"""Options whose values are published (after URL credentials are removed); every other option's value is
replaced by ***."""


def redact_url(text: str) -> str:
    """`text` with any URL's user-info (user:password@) replaced by *** and secret-looking query parameters
    (password=, token=, ...) removed. Everything between the scheme and the LAST '@' is hidden: SQLAlchemy's
    URL parser takes the password as the text after the user name's ':' up to an '@', so whatever it would
    connect with (a password holding '/', '?', '#' or spaces included) lies in what is hidden (tested
    against `sqlalchemy.engine.make_url`)."""
    match = _SCHEME.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        return _SECRET_QUERY.sub(lambda m: f"{m.group('name')}{REDACTED}", _URL_CREDENTIALS.sub(
            lambda m: f"{m.group('scheme')}{REDACTED}@", text))
    if "@" in match["rest"]:
        rest = match["rest"]
        text = f"{match['scheme']}{REDACTED}@{rest[rest.rindex('@') + 1:]}"
    return _SECRET_QUERY.sub(lambda m: f"{m.group('name')}{REDACTED}", text)


def redact_command_line(arguments: list[str]) -> list[str]:
    """A command line fit for publication: positional arguments and values of PUBLIC_OPTIONS with URL
    credentials removed; the value of any other option replaced by ***."""
    out: list[str] = []
    tokens = [str(a) for a in arguments]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--" or not token.startswith("-") or token == "-":
            out.append(redact_url(token))
            continue
        name, equals, value = token.partition("=")
        follows = i < len(tokens) and not tokens[i].startswith("-")
        if name in FLAG_OPTIONS and not equals:
            out.append(token)
        elif name in PUBLIC_OPTIONS:
            if equals:
                out.append(f"{name}={redact_url(value)}")
            else:
                out.append(name)
                if follows:
                    out.append(redact_url(tokens[i]))
                    i += 1
        elif equals:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(name)
            if follows:
                out.append(REDACTED)
                i += 1
    return out
