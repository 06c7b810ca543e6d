"""The `dprelease` command line: a shell over the Python API (`pipelines.api`, `pipelines.commands`), which does
every check and raises every error; the CLI parses options, calls one API function, and prints. Exit codes: 0 ok,
2 bad spec/arguments, 3 budget refused, 1 other."""
from __future__ import annotations

import json
import logging
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from dprelease.accounting.errors import DPReleaseError
from dprelease.accounting.redact import printable

console = Console(width=None if sys.stdout.isatty() else 200, markup=False, highlight=False)
"""On a terminal: its width (plan tables fold their cells to fit); piped or redirected: 200 columns, nothing folded."""
errors = Console(stderr=True, markup=False, highlight=False)
"""Markup is off on both consoles: text that comes from data, specs, manifests or messages (a release id
holding '[/]', a version holding '[bold green]OK[/]', '[lo, hi]' in an error) prints as it is; styles are
given as Text spans."""


class PrintableFormatter(logging.Formatter):
    """Log lines with control characters escaped: a file name or a value holding terminal escape sequences can
    never rewrite the console or print a line of its own."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def styled(label: str, style: str, rest: str = "") -> Text:
    """A styled label followed by plain text (never parsed as markup)."""
    return Text.assemble((label, style), rest)


ENGINES = ["embedded", "spark", "beam"]
STAGES = {"read": "Reading and encoding input files", "noise": "Drawing noise (cell ranges)",
          "write": "Writing tables", "beam": "Beam pipeline (read, bound, count, noise)",
          "post-process": "Post-processing and writing in the workers (stages)",
          "beam-release": "Beam pipeline (read, bound, count, noise, post-process, write)",
          "select": "Choosing tables (1-way tables released, candidates scored)"}


def _fail(error: DPReleaseError) -> None:
    kind = {2: "spec error", 3: "budget refused"}.get(error.exit_code, "error")
    messages = getattr(error, "messages", None) or [str(error)]
    for message in messages:
        errors.print(styled(f"{kind}:", "bold red", " " + printable(message)), soft_wrap=True)
    sys.exit(error.exit_code)


@contextmanager
def _handled():
    """Every error the API raises (always a DPReleaseError: `api.public_errors`) as one line each, with its exit
    code."""
    try:
        yield
    except DPReleaseError as error:
        _fail(error)


BASE_DIR_OPTION = click.option(
    "--base-dir", type=click.Path(file_okay=False, path_type=Path),
    help="Where the spec's relative paths (input, domain files, output) start; default: the spec file's directory "
         "(a scheduler can fill a template into a private work directory and keep the template's paths).")

MAX_CELLS_OPTION = click.option(
    "--max-cells", type=click.IntRange(1), envvar="DPRELEASE_MAX_CELLS",
    help="Refuse a release with more public cells than this (env DPRELEASE_MAX_CELLS; default 20,000,000, "
         "about 4 GiB of memory): the embedded engine holds every table's cells on one machine, and so do spark "
         "and beam unless the count tables form a tree of geographic units (then their workers post-process and "
         "write it group by group, without this limit).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dprelease")
@click.option("-v", "--verbose", is_flag=True, help="Log each stage to stderr (public facts only).")
def main(verbose: bool) -> None:
    """Differentially private statistical releases: plan, run and verify.

    Exit codes: 0 ok, 2 bad spec or arguments, 3 budget refused, 1 anything else.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    if verbose:  # our stages only: libraries' INFO logs (runner ports, temp paths) stay off
        logging.getLogger("dprelease").setLevel(logging.INFO)


@main.command()
@click.option("--manifest", is_flag=True, help="Print the release manifest's JSON Schema instead.")
def schema(manifest: bool) -> None:
    """Print the JSON Schema of the release spec (or, with --manifest, of the release manifest)."""
    if manifest:
        from dprelease.accounting.manifest_model import manifest_json_schema

        click.echo(json.dumps(manifest_json_schema(), indent=2))
        return
    from .spec import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


def _plan_table(plan, estimate=None) -> Table:
    """The plan as a table; `estimate`: its GLS variances (computed when not given). Columns fold rather than
    cut on a narrow terminal (no value is ever shown as an ellipsis)."""
    from .plan_table import plan_records
    from .postprocessing import estimate_variances

    if estimate is None:
        estimate = estimate_variances(plan)
    unit = "epsilon" if plan.definition == "pure" else "rho"
    table = Table(title=f"Plan of release {plan.spec.release_id} ({plan.definition})",
                  caption="L1/L2: sensitivity (quantiles: of the scores); noise: DLap scale b, DGauss variance s2 or "
                          "exponential mechanism (EM) epsilon per selection; std and 95% margin per cell (quantiles: "
                          "rank error in records; a mean: at most X/n at n records in the cell, from its sum's and "
                          "count's budgets); GLS std: largest over the cells of the count tables' least-squares "
                          f"estimate from all measurements, before rounding ({'exact' if estimate.exact else 'upper bound'})")
    headers = ("table", "statistic", "cells", "L1", "L2", unit, "noise", "std", "95%", "GLS std")
    for header in headers:
        table.add_column(header, justify="left" if header == "table" else "right", no_wrap=True)
    rows = [_plan_row(r) for r in plan_records(plan, estimate)]
    for row in rows:
        table.add_row(*row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    if sum(widths) + 3 * len(widths) + 1 <= console.width:
        return table
    return Group(table.title, *(", ".join(f"{h} {v}" if i else v for i, (h, v) in enumerate(zip(headers, row)))
                                for row in rows), table.caption)  # too narrow for the table: one line per table


def _plan_row(r: dict) -> tuple[str, ...]:
    if r["mechanism"] == "ratio":  # a mean: its error at n records in the cell
        return (r["table"], r["statistic"], f"{r['cells']:,}", "-", "-", "-", r["noise"],
                f"≤{r['mean_std_at_n']:.4g}/n", "-", "-")
    cells = "-" if r["cells"] is None else f"{r['cells']:,}" + (f" x {r['quantiles']} q" if r.get("quantiles") else "")
    margin = "-" if r["margin_95"] is None else \
        (f"±{r['margin_95']} ranks" if r["mechanism"] == "exponential" else f"±{r['margin_95']}")
    return (r["table"], r["statistic"], cells, _dash(r["l1"], str), _dash(r["l2"], "{:.3g}".format),
            "0" if r["mechanism"] == "invariant" else f"{r['budget']:.4g}", r["noise"],
            _dash(r["noise_std"], "{:.3f}".format), margin, _dash(r["gls_std"], "{:.3f}".format))


def _dash(value, form) -> str:
    return "-" if value is None else form(value)


def _plan_json(plan, estimate, release_location) -> str:
    """`plan --json`: the records, the totals and the paths, for programs (`release_dir`: where a run publishes
    the release, without --out)."""
    from .plan_table import plan_records

    return json.dumps({"release_id": plan.spec.release_id, "release_dir": str(release_location),
                       "definition": plan.definition,
                       "budget_unit": "epsilon" if plan.definition == "pure" else "rho",
                       "cells": plan.n_cells, "tables": plan_records(plan, estimate),
                       "estimate_exact": estimate.exact, "paths": _path_lines(plan),
                       "randomized_response": _local_lines(plan)}, indent=2)


def _path_lines(plan) -> list[str]:
    """How post-processing will run: the estimate's path, and each marginals query's integer path."""
    from .postprocessing import estimation_path, joint_size, marginals_path
    from .spec import MarginalsQuery

    lines = [f"Estimate: {estimation_path(plan)}"]
    what = {"joint": "a joint table per unit, rounded (its margins are the published tables)",
            "fitted_tables": "a joint per unit fitted, each table rounded on its own (the joint is much larger "
                             "than the tables)",
            "tables": "no joint (over the per-unit limit): each table rounded on its own",
            "tree": "the tree of the chosen 2-way tables (MST): tables that add up, no joint formed",
            "junction": "the junction tree of the chosen tables (AIM-style): tables that add up, no joint formed",
            "model": "a graphical model of the chosen tables (AIM; they may close cycles), fitted per unit "
                     "(1000 iterations): tables that add up, no joint formed",
            "converged_model": "a graphical model of the chosen tables (AIM; they may close cycles), fitted per unit "
                               "until it settles: tables that add up, no joint formed"}
    for q in plan.spec.queries:
        if isinstance(q, MarginalsQuery):
            units = plan.table(next(t.name for t in plan.tables if t.query == q.name)).dims[0].size if q.within else 1
            path = marginals_path(plan, q)
            lines.append(f"Marginals {q.name}: {what[path]}; {joint_size(plan, q) // units:,} joint cells per unit"
                         + (f", {joint_size(plan, q):,} in all, fitted a chunk of units at a time"
                            if path not in ("tables", "tree", "junction", "model", "converged_model") else ""))
            if not q.selects:
                lines.append(_strategy_line(plan, q))
            elif q.name in plan.spec.auto_selections:
                lines.append(f"Selection {q.name}: {plan.spec.auto_selections[q.name]}")
    return lines


def _strategy_line(plan, query) -> str:
    """How a published marginals query is measured, and its expected workload error against direct measurement."""
    from .plan import direct_reason, strategy_errors

    errors = strategy_errors(plan, query)
    if errors is None:
        reason = direct_reason(query, plan.spec, plan.optimal_marginals)
        return f"Measurement {query.name}: each {query.way}-way table directly, equal shares ({reason})"
    tables, lower, ratio = errors
    return (f"Measurement {query.name}: workload-optimal split over {tables} tables ({lower} lower-way); expected "
            f"workload error {ratio:.3f}x that of measuring each {query.way}-way table directly (sum over the "
            f"tables of total least-squares variance / sqrt(cells))")


def _local_lines(plan) -> list[str]:
    """A line per column collected under randomized response: its local guarantee and its debiased tables."""
    from .debiased import debiased_tables, randomizations

    debiased = debiased_tables(plan)
    lines = []
    for column, rr in randomizations(plan).items():
        tables = [d.table.name for d in debiased if column in d.columns]
        per_unit = plan.bounds.max_records_per_unit * rr.epsilon
        lines.append(f"Randomized response: {column} (k = {rr.k}, local epsilon0 = {rr.epsilon} per record, "
                     f"{per_unit} per unit, true value reported with p = {rr.p_truth:.4f}; not charged to the "
                     f"ledger): debiased/ for {', '.join(tables) or 'no table'}")
    return lines


def _totals_text(plan) -> str:
    totals = plan.totals
    if totals.pure_epsilon is not None:
        return f"Total (basic composition): epsilon = {totals.pure_epsilon} ({float(totals.pure_epsilon):.6g})"
    return (f"Total (zCDP composition): rho = {totals.rho} ({float(totals.rho):.6g}), "
            f"i.e. ({totals.epsilon_at_delta:.4f}, {totals.delta:g})-DP")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@BASE_DIR_OPTION
@MAX_CELLS_OPTION
@click.option("--engine", type=click.Choice(ENGINES), help="The engine the memory statement is for (default: the spec's).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the plan as JSON (per table: cells, sensitivity, budget, noise, std, 95% margin, GLS std).")
def plan(spec: Path, base_dir: Path | None, max_cells: int | None, engine: str | None, as_json: bool) -> None:
    """Show the budget allocation, expected error and memory of every table; reads no data.

    Exit 2 when the release exceeds the cell limit (--max-cells) on the engine, as `run` would.
    """
    from .api import Release, public_errors
    from .layout import Layout
    from .limits import check_plan_limits, max_cells_setting, memory_statement, runs_in_workers
    from .postprocessing import EstimateVariances, estimate_variances

    with _handled(), public_errors(stage="plan"):
        release = Release.from_yaml(spec, base_dir)
        result = release.build_plan()
        parsed = release.spec
        engine = engine or parsed.engine
        limit = max_cells_setting(max_cells)
        over_limit = result.n_cells > limit and not runs_in_workers(result, engine)  # no variances if it may not run
        estimate = EstimateVariances({}, True) if over_limit else estimate_variances(result)
        if as_json:
            check_plan_limits(result, limit, engine)
            click.echo(_plan_json(result, estimate, release.release_location()))
            return
        console.print(_plan_table(result, estimate))
        console.print(f"Sensitivity: {result.sensitivity.derivation}")
        for derivation in dict.fromkeys(t.event.sensitivity.derivation for t in result.measured()
                                        if t.statistic != "count" or t.measure):
            console.print(f"Sensitivity: {derivation}")
        console.print(_totals_text(result))
        for line in _path_lines(result) + _local_lines(result):
            console.print(line, soft_wrap=True)
        limit_text = "no cell limit in the workers" if runs_in_workers(result, engine) else f"limit {limit:,}"
        console.print(f"{len(result.tables)} tables, {result.n_cells:,} cells ({limit_text}); "
                      f"{memory_statement(result, engine, Layout().group_work)}", soft_wrap=True)
        check_plan_limits(result, limit, engine)


@main.command(context_settings={"allow_interspersed_args": True})
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("pipeline_options", nargs=-1, type=click.UNPROCESSED)
@BASE_DIR_OPTION
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Use this key (created fresh, mode 0600, if the file does not exist). An existing key must be "
                   "owned by you, mode 0600/0400 and outside the output directory; with a ledger it re-runs only "
                   "the release, spec and input it was first used for (free), anything else is refused. "
                   "Default: a fresh key in <spec dir>/keys/.")
@click.option("--out", "out_dir", type=str,
              help="Publish under this directory (or object-store URI: s3://bucket/releases/) instead of the spec's "
                   "output.dir.")
@click.option("--input", "input_path", help="Read this input instead of the spec's input.path.")
@click.option("--engine", type=click.Choice(ENGINES),
              help="Engine (default: the spec's, embedded).")
@click.option("--master", help="Spark master URL (spark engine only; default local[*]): spark://host:7077, yarn, k8s://...")
@click.option("--runner", help="Beam runner (beam engine only; default DirectRunner): FlinkRunner, SparkRunner, "
                               "DataflowRunner, ...; further Beam pipeline options go after --.")
@click.option("--workers", type=click.IntRange(1, 256),
              help="Worker processes (default: CPU count): on the embedded engine they read and count a large "
                   "input, draw noise and post-process; on Beam, the DirectRunner's workers.")
@click.option("--overwrite", is_flag=True, help="Replace an existing release directory of the same id.")
@click.option("--ledger", envvar="DPRELEASE_LEDGER",
              help="Privacy-loss ledger (SQLite file or SQLAlchemy URL; env DPRELEASE_LEDGER; default "
                   "ledger.sqlite in the user data directory): reserves the release's spend before any noise is "
                   "drawn, refuses with exit 3 if over budget or if the dataset has no budget.")
@click.option("--no-ledger", is_flag=True, help="Run without budget accounting (the manifest's ledger is null).")
@click.option("--internal-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Validate the input with the spec's great-expectations suite and write the detailed report "
                   "(confidential) here; never inside the release.")
@click.option("--strict", is_flag=True,
              help="Stop (exit 1) when any value-level expectation fails, before any key is drawn or budget "
                   "reserved (the failed checks are named, never values). Makes whether a release exists depend "
                   "on the data: an internal choice. Needs --internal-dir.")
@click.option("--sign-key", type=click.Path(dir_okay=False, path_type=Path),
              help="Sign the manifest with this Ed25519 private key (PEM; openssl genpkey -algorithm ed25519).")
@MAX_CELLS_OPTION
@click.option("--group-work", type=click.IntRange(64), envvar="DPRELEASE_GROUP_WORK",
              help="Cells (a unit's tables and its marginals' joint table) per group of geographic units in "
                   "post-processing: a worker's unit of work and memory, and a part of the tables written per "
                   "group (default 2,000,000; env DPRELEASE_GROUP_WORK). Any value gives the same values.")
@click.option("--part-rows", type=click.IntRange(64), envvar="DPRELEASE_PART_ROWS",
              help="Rows per part of the other tables (default 4,000,000; env DPRELEASE_PART_ROWS).")
def run(spec: Path, pipeline_options: tuple[str, ...], base_dir, key_file, out_dir, input_path, engine, workers, overwrite,
        master, runner, ledger, no_ledger, internal_dir, strict, sign_key, max_cells, group_work, part_rows) -> None:
    """Run a release: bound, aggregate, add noise, post-process, publish atomically.

    Beam pipeline options (beam engine) follow a `--`, for example:

    \b
      dprelease run SPEC --engine beam --runner FlinkRunner -- --flink_master=host:8081 --parallelism=8
    """
    from .api import DEFAULT_LEDGER, Release
    from .layout import Layout

    if no_ledger and ledger:
        raise click.UsageError("--no-ledger and --ledger (or DPRELEASE_LEDGER) exclude each other")
    layout = Layout(**{name: value for name, value in (("group_work", group_work), ("part_rows", part_rows))
                       if value is not None})

    with _handled(), Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), console=errors, transient=False) as progress:
        tasks: dict[str, int] = {}

        def hook(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(STAGES.get(stage, stage), total=total)
            progress.update(tasks[stage], completed=done, total=total)

        result = Release.from_yaml(spec, base_dir).publish(
            input_path, ledger=None if no_ledger else (ledger or DEFAULT_LEDGER), out_dir=out_dir, key_file=key_file,
            engine=engine, workers=workers, overwrite=overwrite, internal_dir=internal_dir, strict=strict,
            sign_key=sign_key, max_cells=max_cells, layout=layout, master=master, runner=runner,
            pipeline_options=list(pipeline_options), progress=hook, entry="cli run")
    plan_ = result.plan
    # scripts parse these lines (deploy/): never wrap them
    console.print(Text.assemble(("Published", "bold green"), " release ", (plan_.spec.release_id, "bold"),
                                f" to {printable(result.release_dir)}"), soft_wrap=True)
    console.print(_totals_text(plan_))
    console.print(f"{len(plan_.tables)} tables, {plan_.n_cells:,} cells; "
                  f"tables/ (post-processed), measurements/ (raw noisy), manifest.json")
    state = "reused" if result.key_reused else "new"
    console.print(Text.assemble(f"Key ({state}): {printable(result.key_file)}  ", ("keep it secret; never publish it",
                                                                                  "dim")), soft_wrap=True)
    console.print(f"Check it: dprelease verify {printable(shlex.quote(str(result.release_dir)))}", soft_wrap=True)
    for warning in result.coding_warnings:  # from the published tables only (pipelines/coding_check.py)
        errors.print(Text.assemble(("Warning: ", "bold yellow"), warning), soft_wrap=True)


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@BASE_DIR_OPTION
@click.option("--internal-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Private directory for the detailed (confidential) report.")
@click.option("--input", "input_path", help="Validate this input instead of the spec's input.path.")
@click.option("--engine", type=click.Choice(ENGINES), help="Engine (default: the spec's).")
@click.option("--master", help="Spark master URL (spark engine only).")
def validate(spec: Path, base_dir, internal_dir: Path, input_path, engine, master) -> None:
    """Check an input against the spec's great-expectations suite; release nothing, spend nothing.

    Exit 2 on schema-level failures (missing column, wrong type). The value-level results go to the report in
    --internal-dir (confidential: counts and sample values); the console names only the checks that failed
    (the column and what the spec asks of it, never a value), and the exit code is 1 when any failed: the data
    does not match the spec (a mis-coded column would send every record to `(other)`). `run --strict` stops on
    the same checks before anything is reserved.
    """
    from .api import Release

    with _handled():
        checked = Release.from_yaml(spec, base_dir).validate(internal_dir, input_path, engine=engine, master=master)
    if checked.passed:
        console.print(f"Every expectation met (schema and values); the report (confidential) is "
                      f"{printable(checked.report)}", soft_wrap=True)
        return
    errors.print(styled("The data does not match the spec:", "bold yellow", " value checks failed for "
                        + printable("; ".join(checked.failed))), soft_wrap=True)
    console.print(f"Schema-level expectations met; the value-level report (confidential) is "
                  f"{printable(checked.report)}", soft_wrap=True)
    sys.exit(1)


@main.command()
@click.argument("release_dir", type=str)
@click.option("--public-key", type=click.Path(dir_okay=False, path_type=Path),
              help="Check the manifest's Ed25519 signature against this public key (PEM).")
@click.option("--ledger", "ledger_location",
              help="Check the manifest against this ledger (SQLite file or SQLAlchemy URL): the release is "
                   "committed there at the cost it states, and this very manifest is one recorded at publication.")
@click.option("--recompute", is_flag=True,
              help="Re-run the post-processing from measurements/ and demand the published tables exactly (floating "
                   "point: a release made on another CPU, numpy build or dprelease version could differ in a rounding "
                   "tie).")
def verify(release_dir: str, public_key, ledger_location, recompute: bool) -> None:
    """Recompute hashes, accounting, budget totals and every structural property of a release; exit 1 on
    any mismatch. Reads only regular files inside the release directory. RELEASE_DIR may be an object-store
    URI (s3://bucket/releases/ID): the release is downloaded to a private temporary copy first, each object
    read at most to the size its manifest states."""
    from .commands import verify as check

    with _handled():
        report = check(release_dir, public_key, ledger=ledger_location, recompute=recompute)
    manifest = report.manifest or {}
    software = manifest.get("software") if isinstance(manifest.get("software"), dict) else {}
    console.print(f"Release {printable(manifest.get('release_id', '?'))} of dataset "
                  f"{printable(manifest.get('dataset_id', '?'))}, engine {printable(manifest.get('engine', '?'))}, "
                  f"dprelease {printable(software.get('version', '?'))}", soft_wrap=True)
    if report.plan is not None:
        privacy = manifest.get("privacy") if isinstance(manifest.get("privacy"), dict) else {}
        console.print(f"Privacy unit: {printable(privacy.get('unit'))}; {printable(privacy.get('neighbouring_note'))}")
        console.print(_plan_table(report.plan, report.estimate))
        console.print(_totals_text(report.plan) + f"; declared budget {printable(report.plan.spec.budget.model_dump())}")
        invariants = [t.name for t in report.plan.tables if t.invariant]
        console.print(f"Invariants (published without protection): {', '.join(invariants) or 'none'}")
    console.print(f"Files checked: {report.checked_files}; signature: {printable(report.signature)}; ledger: "
                  f"{printable(report.ledger)}" + ("; post-processing recomputed" if report.recomputed else ""))
    if report.ok:
        console.print(styled("OK", "bold green", ": every file hash, allocation, mechanism, total and table "
                                                 "property matches."))
        return
    for problem in report.problems:
        errors.print(styled("MISMATCH", "bold red", " " + printable(problem)), soft_wrap=True)
    errors.print(styled(f"{len(report.problems)} mismatch(es)", "bold red",
                        ": this release does not match its manifest."))
    sys.exit(1)


@main.command()
@click.argument("release_dir", type=str)
@click.option("--data", "data", required=True, help="The confidential input the release was made from.")
@click.option("--internal-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Private directory for the result (confidential: it compares the release with the records).")
@click.option("--max-units", type=click.IntRange(1), help="Attack at most this many units (default: every one).")
@click.option("--time-limit", type=click.FloatRange(0.1), default=10.0, show_default=True,
              help="Seconds per unit for each integer program (the best solution found by then is used).")
def attack(release_dir: str, data: str, internal_dir: Path, max_units, time_limit: float) -> None:
    """Reconstruction-risk check: rebuild microdata from a release (a directory or an object-store URI), score it
    against the confidential records.

    Per unit of the finest geography level the count tables cross with attributes, an integer program finds
    records whose tabulation is closest to the published tables; the share of confidential records matched
    exactly (same unit, same attributes) is set beside the same attack on the true tables and two baselines (a
    guess from national marginals; a per-unit prior), with a verdict in words. The result is confidential: it
    is written to --internal-dir only, and only its path is printed."""
    from .commands import attack as reconstruct

    with _handled(), Progress(TextColumn("units"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              console=errors) as progress:
        task = progress.add_task("units", total=None)
        path = reconstruct(release_dir, data, internal_dir, max_units, time_limit,
                           progress=lambda done, total: progress.update(task, completed=done, total=total))
    console.print(f"Reconstruction result (confidential; never publish it) written to {printable(path)}",
                  soft_wrap=True)


@main.command()
@click.argument("release_dir", type=str)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Parquet file to write (default: <release dir>.synthetic.parquet beside the release, or in the "
                   "current directory for a URI). Never inside a release; an existing file only with --overwrite.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file.")
@click.option("--max-records", type=click.IntRange(1), default=100_000_000, show_default=True,
              help="Refuse to draw more records than this (a release's totals say how many it would draw).")
def synthesize(release_dir: str, out: Path | None, overwrite: bool, max_records: int) -> None:
    """Write synthetic microdata consistent with a release's hierarchy and marginal tables (RELEASE_DIR: a
    directory or an object-store URI).

    Post-processing only: records drawn from the integer joint table behind the marginals (a `select: mst`
    query's tree, a `select: aim` query's junction tree; with several marginals queries, one of them) and split
    among the finest hierarchy level's units by their published counts (per `by` cell for a hierarchy crossed
    with `by`). The release is verified first; it prints which tables the records reproduce exactly. A utility
    report (<out>.utility.json) gives, per table the records tabulate to, the L1 distance of their tabulation
    to the release's noisy measurements and to its published table."""
    from .commands import synthesize as draw

    with _handled():
        written = draw(release_dir, out, overwrite, max_records)
    synthetic = written.synthetic
    records = synthetic.records
    console.print(f"Wrote {records.num_rows:,} synthetic records ({', '.join(records.column_names)}) to "
                  f"{printable(written.path)}", soft_wrap=True)
    console.print(f"Tabulating them reproduces exactly: {', '.join(synthetic.reproduced) or 'none'}")
    if synthetic.not_reproduced:
        console.print("Not reproduced (tables of other queries, or a hierarchy whose integers differ from those "
                      "of the records' source, and then a `select: aim` model's tables, which the records follow "
                      "up to the fit of that model to the published tables; see the utility report): "
                      f"{', '.join(synthetic.not_reproduced)}")
    if synthetic.utility:
        worst = max(synthetic.utility, key=lambda row: row["l1_to_measurements_per_record"])
        console.print(f"Utility (L1 of the records' tabulation to the noisy measurements, per record): largest "
                      f"{worst['l1_to_measurements_per_record']:.3f} ({worst['table']}); every table in "
                      f"{printable(written.utility_path)}", soft_wrap=True)


@main.command()
@click.argument("release_dir", type=str)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="HTML file to write (default: <release dir>.report.html beside the release, or "
                   "<release id>.report.html in the current directory for a URI; never inside one).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file (the default one included).")
@click.option("--public-key", type=click.Path(dir_okay=False, path_type=Path), help="Check the signature too.")
@click.option("--ledger", envvar="DPRELEASE_LEDGER", help="Check the charge against this ledger and add the "
                                                           "dataset's ledger history.")
@click.option("--recompute", is_flag=True, help="Also re-run the post-processing from measurements/ (as verify "
                                                "--recompute).")
def report(release_dir: str, out, overwrite: bool, public_key, ledger, recompute: bool) -> None:
    """Write a self-contained HTML report of a release for auditors (verifies it first). RELEASE_DIR may be an
    object-store URI, as for verify."""
    from .commands import write_report

    with _handled():
        path, result = write_report(release_dir, out, overwrite, public_key, ledger, recompute)
    console.print(f"Report written to {printable(path)}" +
                  ("" if result.ok else f" ({len(result.problems)} mismatches shown)"), soft_wrap=True)
    if not result.ok:
        sys.exit(1)


def _default_ledger() -> str:
    from dprelease.accounting.ledger import default_ledger_location

    return str(default_ledger_location())


LEDGER_OPTION = click.option("--ledger", envvar="DPRELEASE_LEDGER", default=_default_ledger,
                             show_default="ledger.sqlite in the user data directory",
                             help="SQLite file or SQLAlchemy URL (env DPRELEASE_LEDGER).")


@main.group()
def ledger() -> None:
    """The privacy-loss ledger: lifetime budgets and the spend of every release, per dataset."""


@ledger.command("set-budget")
@click.argument("dataset")
@click.option("--epsilon", "epsilon", help="Lifetime pure-DP budget (for pure releases); with --delta, an (ε, δ) "
                                          "budget for zcdp and approx releases.")
@click.option("--delta", "delta", type=click.FloatRange(0, 0.5, min_open=True),
              help="With --epsilon: the budget is (ε, δ)-DP; it is kept as the largest ρ whose conversion is (ε, δ)-DP "
                   "(zcdp and approx releases are accounted in ρ), and spends are shown as ε at this δ.")
@click.option("--rho", "rho", help="Lifetime zCDP budget (for zcdp and approx releases).")
@click.option("--per-period", "per_period",
              help="Budget per period of a release series, in the same unit; 'none' removes it. Default: keep the "
                   "current one. Releases name their period in the spec (YYYY, YYYY-Qn, YYYY-MM or YYYY-MM-DD) and "
                   "are charged against every budget period it overlaps.")
@click.option("--period-unit", type=click.Choice(["year", "quarter", "month", "day"]),
              help="Length of the budget periods of --per-period (default month).")
@LEDGER_OPTION
def ledger_set_budget(dataset: str, epsilon, delta, rho, per_period, period_unit, ledger: str) -> None:
    """Create or change a dataset's lifetime budget (never below what it has spent)."""
    from dprelease.accounting.ledger import KEEP

    from .commands import Ledger

    with _handled():
        unit, amount, period = Ledger(ledger).set_budget(dataset, epsilon=epsilon, rho=rho, delta=delta,
                                                         per_period=per_period, period_unit=period_unit)
    text = "" if period is KEEP else (f"; per-{period_unit or 'month'} budget {_amount_text(period, unit)}"
                                      if period is not None else "; per-period budget none")
    given = f" (ε = {epsilon} at δ = {delta:g})" if delta is not None else ""
    console.print(f"Dataset {printable(dataset)}: lifetime budget {_amount_text(amount, unit)}{given}{text}",
                  soft_wrap=True)


def _amount_text(amount, unit: str) -> str:
    """A budget amount, decimals first: `0.985 rho (784673401/796600953)`; a whole or short fraction as is."""
    from fractions import Fraction

    amount = Fraction(amount)
    exact = str(amount)
    decimal = f"{float(amount):.4g}"
    return f"{decimal} {unit}" + ("" if exact == decimal or len(exact) <= 8 and amount.denominator == 1
                                  else f" ({exact})")


DELTA_OPTION = click.option("--delta", type=click.FloatRange(0, 1, min_open=True, max_open=True),
                            help="δ at which a rho (zCDP) spend is also shown as (ε, δ)-DP (default: each release's "
                                 "own δ, and the dataset's when its budget was given as (ε, δ)).")


@ledger.command("show")
@click.argument("dataset")
@LEDGER_OPTION
@DELTA_OPTION
def ledger_show(dataset: str, ledger: str, delta: float | None) -> None:
    """A dataset's budget, spend and every release."""
    _print_ledger(ledger, dataset, delta)


@ledger.command("list")
@LEDGER_OPTION
@DELTA_OPTION
def ledger_list(ledger: str, delta: float | None) -> None:
    """Every dataset with its budget and spend."""
    _print_ledger(ledger, None, delta)


def _as_epsilon(unit: str, spent, delta: float | None) -> str:
    """A spend as ε: itself under pure DP; a ρ (zCDP) spend converted at `delta` (none known: '-')."""
    from dprelease.accounting.conversions import zcdp_to_epsilon

    if unit == "epsilon":
        return f"ε = {float(spent):.4g}"
    if delta is None:
        return "-"
    return f"ε = {zcdp_to_epsilon(float(spent), delta):.4g} at δ = {delta:g}" if spent > 0 else "ε = 0"


def _print_ledger(location: str, dataset: str | None, delta: float | None = None) -> None:
    from fractions import Fraction

    from dprelease.accounting.ledger import COMMITTED, RESERVED

    from .commands import Ledger

    with _handled():
        rows, releases = Ledger(location).history(dataset)
    summary = Table(title="Datasets")
    for header in ("dataset", "accounted in", "lifetime", "spent", "remaining", "spent as (ε, δ)", "per period"):
        summary.add_column(header)
    for row in rows:
        spent = sum((Fraction(r.spend) for r in releases
                     if r.dataset_id == row.dataset_id and r.status in (COMMITTED, RESERVED)), Fraction(0))
        lifetime = Fraction(row.lifetime_budget)
        at = delta if delta is not None else (float(row.delta) if row.delta else None)
        unit = "epsilon (pure DP)" if row.unit == "epsilon" else "rho (zCDP)"
        period = _amount_text(Fraction(row.period_budget), row.unit) + f" per {row.period_unit or 'month'}" \
            if row.period_budget else "-"
        summary.add_row(*map(printable, (row.dataset_id, unit, _amount_text(lifetime, row.unit),
                                         _amount_text(spent, row.unit), _amount_text(lifetime - spent, row.unit),
                                         _as_epsilon(row.unit, spent, at), period)))
    console.print(summary)
    if dataset:
        detail = Table(title=f"Releases of {printable(dataset)}")
        for header in ("release", "period", "key id", "spend", "as ε at its δ", "status", "reserved at",
                       "manifest sha256"):
            detail.add_column(header)
        for r in releases:
            own = delta if delta is not None else (float(r.delta) if r.delta else None)
            unit = next((row.unit for row in rows if row.dataset_id == r.dataset_id), "rho")
            detail.add_row(*map(printable, (r.release_id, r.period or "-", r.key_id,
                                            _amount_text(Fraction(r.spend), unit),
                                            _as_epsilon(unit, Fraction(r.spend), own), r.status, str(r.reserved_at),
                                            (r.manifest_sha256 or "")[:16])))
        console.print(detail)


@ledger.command("reconcile")
@LEDGER_OPTION
@click.option("--dry-run", is_flag=True, help="Show what would be settled; change nothing.")
def ledger_reconcile(ledger: str, dry_run: bool) -> None:
    """Settle reservations left 'reserved' by runs that were killed.

    A run holds its reservation under a lease it renews (every minute; DPRELEASE_LEASE_SECONDS, default
    300). A reserved row whose lease expired over 30 s ago is committed when its release directory holds
    that release's manifest (published), and aborted, releasing its budget, when nothing was published;
    a run that comes back after that can no longer commit or publish. Rows under a live lease are left.
    """
    from .commands import Ledger

    with _handled():
        settled = Ledger(ledger).reconcile(dry_run)
    table = Table(title="Reconciled reservations" + (" (dry run: nothing changed)" if dry_run else ""))
    for header in ("row", "dataset", "release", "action", "why"):
        table.add_column(header)
    for item in settled:
        table.add_row(*map(printable, (item.row_id, item.dataset_id, item.release_id, item.action, item.reason)))
    console.print(table)
    console.print(f"{sum(i.action != 'left' for i in settled)} settled, {sum(i.action == 'left' for i in settled)} left")


@main.command("demo-data")
@click.option("--rows", type=click.IntRange(0, 10**10), required=True, help="Number of persons.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="A .parquet or .csv file, or a directory (for persons.parquet); geography.txt is written beside it.")
@click.option("--overwrite", is_flag=True, help="Replace existing files (never inside a release).")
@click.option("--seed", type=click.IntRange(0), default=1, show_default=True, help="Seed of the synthetic population.")
@click.option("--dirty-rate", type=click.FloatRange(0, 1), default=0.001, show_default=True,
              help="Share of rows with a null or out-of-domain value.")
@click.option("--states", type=click.IntRange(1, 99), help="A country-sized geography instead of the demo's: states "
              "(with --counties and --tracts; a real country: 51, 3577, 44627).")
@click.option("--counties", type=click.IntRange(1), help="Counties in all (Zipf-like per state; at most 999 per state).")
@click.option("--tracts", type=click.IntRange(1), help="Tracts in all (Zipf-like per county; codes of 11 characters).")
@click.option("--blocks", type=click.IntRange(1), help="Blocks in all (codes of 15 characters: a spec adds "
              "block: 15 to its levels).")
def demo_data(rows: int, out: Path, overwrite: bool, seed: int, dirty_rate: float, states, counties, tracts,
              blocks) -> None:
    """Generate a synthetic census-like person file and its geography domain file."""
    from .commands import demo_data as generate

    with _handled():
        data, domain = generate(rows, out, overwrite, seed, dirty_rate, states, counties, tracts, blocks)
    console.print(f"Wrote {rows:,} persons to {printable(data)} and the geography domain to {printable(domain)}",
                  soft_wrap=True)


def entry() -> None:
    """The `dprelease` command: `main`, then a garbage collection while Arrow is still whole, so that no Parquet
    reader's native threads are torn down with the interpreter (apache/arrow#34314: an intermittent
    'terminate called without an active exception', exit -6, after the work is done)."""
    import gc

    try:
        main()
    finally:
        gc.collect()


if __name__ == "__main__":
    entry()
