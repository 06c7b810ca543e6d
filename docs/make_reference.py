"""Generate the reference pages from the code: docs/reference/spec.md from the spec's JSON Schema (the pydantic
model `dprelease schema` prints) and docs/reference/cli.md from every command's --help. tests/test_docs.py checks
that the committed pages equal what this writes, so the reference never drifts from the code.

    python docs/make_reference.py
"""
from __future__ import annotations

import json
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent


def _type_of(node: dict, definitions: dict) -> str:
    """A schema node's type, as a reader says it."""
    if "$ref" in node:
        return f"[{node['$ref'].rsplit('/', 1)[-1]}](#{node['$ref'].rsplit('/', 1)[-1].lower()})"
    if "anyOf" in node:
        return " or ".join(_type_of(option, definitions) for option in node["anyOf"])
    if "oneOf" in node:
        return " or ".join(_type_of(option, definitions) for option in node["oneOf"])
    if "enum" in node:
        return " / ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {_type_of(node.get('items', {}), definitions)}"
    if kind == "object" and "additionalProperties" in node and isinstance(node["additionalProperties"], dict):
        return f"map of name to {_type_of(node['additionalProperties'], definitions)}"
    if "pattern" in node:
        return f"{kind} matching `{node['pattern']}`"
    return kind


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _model_section(name: str, node: dict, definitions: dict) -> list[str]:
    lines = [f"## {name}", ""]
    if node.get("description"):
        lines += [_cell(node["description"]), ""]
    properties = node.get("properties") or {}
    if properties:
        required = set(node.get("required") or [])
        lines += ["| field | type | required | description |", "|---|---|---|---|"]
        for field, spec in properties.items():
            lines.append(f"| `{field}` | {_cell(_type_of(spec, definitions))} | "
                         f"{'yes' if field in required else 'no'} | {_cell(spec.get('description', ''))} |")
        lines.append("")
    elif node.get("enum") or node.get("type"):
        lines += [f"Type: {_cell(_type_of(node, definitions))}", ""]
    return lines


def spec_reference() -> str:
    from dprelease.pipelines.spec import json_schema

    schema = json_schema()
    definitions = schema.get("$defs", {})
    lines = ["# Spec reference", "",
             "Generated from the spec's JSON Schema (`dprelease schema`; `python docs/make_reference.py`). The "
             "schema accepts every spec the tool accepts (a test runs it over every shipped and test spec). The "
             "checks a schema cannot state (cross-field rules: levels that exist, attributes that are declared, "
             "budgets that fit) are made by `dprelease plan` and `run`, with errors that name the field.", ""]
    lines += _model_section("ReleaseSpec", schema, definitions)
    for name in sorted(definitions):
        lines += _model_section(name, definitions[name], definitions)
    return "\n".join(lines).rstrip("\n") + "\n"


def _help_of(command: click.Command, path: list[str], parent: click.Context | None = None) -> list[str]:
    """The command's --help as a terminal 100 columns wide shows it (its own and its parents' context settings,
    such as -h, applied as when it runs)."""
    context = command.make_context(path[-1], [], parent=parent, resilient_parsing=True, terminal_width=100,
                                   max_content_width=100)
    lines = [f"## `{' '.join(path)}`", "", "```text", command.get_help(context).rstrip(), "```", ""]
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(context)):
            lines += _help_of(command.get_command(context, name), [*path, name], context)
    return lines


def cli_reference() -> str:
    from dprelease.pipelines.cli import main

    lines = ["# Command-line reference", "",
             "Every command's `--help`, generated (`python docs/make_reference.py`). Exit codes: 0 ok, 2 bad spec or "
             "arguments, 3 budget refused, 1 anything else.", ""]
    return "\n".join(lines + _help_of(main, ["dprelease"])).rstrip("\n") + "\n"


PAGES = {"reference/spec.md": spec_reference, "reference/cli.md": cli_reference}


if __name__ == "__main__":
    for relative, make in PAGES.items():
        (HERE / relative).parent.mkdir(parents=True, exist_ok=True)
        (HERE / relative).write_text(make(), encoding="utf-8")
