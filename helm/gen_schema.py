"""Derives helm/pdserve/values.schema.json from the comments and values of values.yaml.

Each key's description is the comment block right above it (a key without one is an error).
Types come from the default values; objects are closed (unknown keys are refused) unless the
comment says `[free-form]`. Markers: `[enum: a|b]`, `[min: N]`, `[max: N]`, `[free-form]`.

    python helm/gen_schema.py           # rewrite values.schema.json
    python helm/gen_schema.py --check   # exit 1 when the checked-in schema has drifted
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent / "pdserve"
_MARKER = re.compile(r"\[(enum|min|max|free-form)(?::\s*([^\]]*))?\]")


def _comment_above(lines: list[str], line_no: int) -> str:
    block: list[str] = []
    i = line_no - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        block.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(block)


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    raise ValueError(f"unsupported default value {value!r}")


def _node_schema(node: yaml.Node, lines: list[str], comment: str, path: str) -> dict[str, Any]:
    markers = {m.group(1): (m.group(2) or "").strip() for m in _MARKER.finditer(comment)}
    schema: dict[str, Any] = {}
    description = _MARKER.sub("", comment).strip()
    if description:
        schema["description"] = re.sub(r"\s+", " ", description)
    if isinstance(node, yaml.MappingNode):
        schema["type"] = "object"
        if "free-form" in markers:
            return schema
        schema["additionalProperties"] = False
        schema["properties"] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            key_comment = _comment_above(lines, key_node.start_mark.line)
            if not key_comment:
                raise ValueError(f"values.yaml line {key_node.start_mark.line + 1}: {path}{key} has no comment")
            schema["properties"][key] = _node_schema(value_node, lines, key_comment, f"{path}{key}.")
        return schema
    if isinstance(node, yaml.SequenceNode):
        schema["type"] = "array"
        return schema
    value = yaml.safe_load(yaml.serialize(node))
    schema["type"] = _scalar_type(value)
    if "enum" in markers:
        schema["enum"] = [v.strip() for v in markers["enum"].split("|")]
    if "min" in markers:
        schema["minimum"] = int(markers["min"])
    if "max" in markers:
        schema["maximum"] = int(markers["max"])
    return schema


def build_schema(values_path: Path = CHART / "values.yaml") -> dict[str, Any]:
    """The JSON schema of values.yaml (raises ValueError on an undocumented key)."""
    text = values_path.read_text()
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        raise ValueError("values.yaml must be a mapping")
    body = _node_schema(root, text.splitlines(), "", "")
    return {"$schema": "https://json-schema.org/draft-07/schema#", "title": "pdserve chart values", **body}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when values.schema.json is stale")
    args = parser.parse_args(argv)
    target = CHART / "values.schema.json"
    text = render(build_schema())
    if args.check:
        if not target.exists() or target.read_text() != text:
            print(f"{target} is stale: run python helm/gen_schema.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
