"""How a release was made, as the manifest publishes it: structured and allow-listed, never a command line.

Confidentiality: a command line holds whatever its user typed (a ledger URL with a password in its query, a
presigned URL as a Beam option, a token inside `--experiments`), and no denylist of secret-looking names can be
complete. So the manifest records the entry point and the options of an allow-list, each value only where its
type is known to be public: numbers, booleans, enumerations, identifiers, and paths or URIs without user info,
query or fragment. Any other value is recorded as WITHHELD; options off the allow-list are counted, not named.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

WITHHELD = "(withheld)"
IDENTIFIER = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
"""Runner names, regions, zones, projects, machine types, host:port."""
PATH_CHARACTERS = re.compile(r"^[A-Za-z0-9_.,/~+=:-]{1,1024}$")
IMAGE = re.compile(r"^[A-Za-z0-9_./:+-]{1,300}(@sha256:[0-9a-f]{64})?$")
"""A container image reference: registry/name:tag, optionally pinned by digest (an '@' only as '@sha256:')."""
SPARK_MASTER = re.compile(r"^(local(\[([0-9]{1,4}|\*)(,[0-9]{1,3})?\])?|yarn|"
                          r"(spark|mesos)://[A-Za-z0-9_.:,-]{1,512}|k8s://https?://[A-Za-z0-9_.:-]{1,512})$")


def location(value: object) -> str:
    """A path or URI as published: itself when it holds no user info, query or fragment and only plain path
    characters; WITHHELD otherwise (it could carry a credential)."""
    text = str(value)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        parts = urlsplit(text)
        if not IDENTIFIER.fullmatch(scheme) or "@" in rest or parts.query or parts.fragment or "?" in rest or "#" in rest:
            return WITHHELD
        text_to_check = rest
    else:
        text_to_check = text
    return text if not text_to_check or PATH_CHARACTERS.fullmatch(text_to_check) else WITHHELD


def identifier(value: object) -> str:
    text = str(value)
    return text if IDENTIFIER.fullmatch(text) else WITHHELD


def image(value: object) -> str:
    text = str(value)
    return text if IMAGE.fullmatch(text) and "://" not in text else WITHHELD


def integer(value: object) -> int | str:
    text = str(value)
    return int(text) if re.fullmatch(r"-?[0-9]{1,12}", text) else WITHHELD


KNOWN_EXPERIMENTS = frozenset({
    "use_runner_v2", "disable_runner_v2", "use_portable_job_submission", "beam_fn_api", "use_unified_worker",
    "shuffle_mode", "use_sibling_sdk_workers", "pre_optimize", "enable_stackdriver_agent_metrics",
    "disable_prime_runner_v2", "upload_graph", "use_multiple_sdk_containers", "no_use_multiple_sdk_containers"})
"""Beam / Dataflow experiment names published as they are; any other item (it could be a token) is withheld."""


def identifiers(value: object) -> list[str]:
    """Beam's --experiments, item by item: a known experiment name is published, anything else withheld."""
    return [item if item in KNOWN_EXPERIMENTS else WITHHELD for item in str(value).split(",")]


def spark_master(value: object) -> str:
    text = str(value)
    return text if SPARK_MASTER.fullmatch(text) else WITHHELD


BEAM_OPTIONS = {
    **dict.fromkeys(("num_workers", "max_num_workers", "disk_size_gb", "direct_num_workers", "parallelism",
                     "max_parallelism"), integer),
    **dict.fromkeys(("project", "region", "zone", "worker_zone", "job_name", "machine_type", "worker_machine_type",
                     "autoscaling_algorithm", "direct_running_mode", "environment_type", "network",
                     "default_sdk_harness_log_level", "flink_master", "job_endpoint", "runner"), identifier),
    **dict.fromkeys(("temp_location", "staging_location", "sdk_location", "setup_file", "requirements_file",
                     "subnetwork", "spark_master_url"), location),
    "sdk_container_image": image,
    "experiments": identifiers,
}
"""Beam pipeline options whose values can be published, each with the type its value must have."""
BEAM_FLAGS = frozenset({"save_main_session", "streaming"})


def beam_options(tokens: list[str]) -> dict:
    """Beam pipeline options (`--name=value`, `--name value`, `--flag`) as published: allow-listed names with
    typed values; the rest counted in `other_options`."""
    published: dict = {}
    other = 0
    i = 0
    while i < len(tokens):
        token = str(tokens[i])
        i += 1
        if not token.startswith("--"):
            other += 1
            continue
        name, equals, value = token[2:].partition("=")
        if name in BEAM_FLAGS and not equals:
            published[name] = True
            continue
        if not equals and i < len(tokens) and not str(tokens[i]).startswith("--"):
            value = str(tokens[i])
            i += 1
        render = BEAM_OPTIONS.get(name)
        if render is None:
            other += 1
            continue
        published[name] = render(value)
    if other:
        published["other_options"] = other
    return published


def ledger_kind(ledger: object) -> str:
    """The ledger as published: its database kind only (sqlite, postgresql+psycopg, ...), never its URL."""
    if ledger is None:
        return "none"
    text = str(ledger)
    if "://" not in text:
        return "sqlite"
    scheme = text.split(":", 1)[0]
    return scheme if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,40}", scheme) else WITHHELD


@dataclass(frozen=True)
class Invocation:
    """An entry point and the options it was called with, as the manifest publishes them (`record`)."""

    entry: str
    """'cli run', 'python Release.run', ..."""
    options: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"entry": self.entry, "options": dict(sorted(self.options.items()))}


def run_invocation(entry: str, *, engine: str, workers=None, overwrite: bool = False, master=None, runner=None,
                   beam_options_given=None, ledger=None, out_dir=None, input_path=None, input_kind: str = "path",
                   sign_key=None, internal_dir=None, strict: bool = False, max_cells=None) -> Invocation:
    """The published options of a run (see the module's docstring for what is withheld)."""
    options: dict = {"engine": identifier(engine), "overwrite": bool(overwrite), "ledger": ledger_kind(ledger),
                     "signed": sign_key is not None, "validated": internal_dir is not None, "strict": bool(strict)}
    if workers is not None:
        options["workers"] = integer(workers)
    if max_cells is not None:
        options["max_cells"] = integer(max_cells)
    if master is not None:
        options["master"] = spark_master(master)
    if runner is not None:
        options["runner"] = identifier(runner)
    if beam_options_given:
        options["pipeline_options"] = beam_options(list(beam_options_given))
    if out_dir is not None:
        options["out"] = location(out_dir)
    if input_kind != "path":
        options["input"] = f"({input_kind})"
    elif input_path is not None:
        options["input"] = location(input_path)
    return Invocation(entry, options)
