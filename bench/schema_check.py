"""Check an xfer-bench result against bench/schema.json with a small JSON Schema subset
(type, const, enum, required, properties, additionalProperties, items, minItems, minimum,
exclusiveMinimum, anyOf, local $ref) — enough for this schema, no dependency.

    python -m xfer.bench.schema_check results.json     # exit 0 when valid, else the errors
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["SCHEMA_PATH", "load_schema", "errors"]

SCHEMA_PATH = Path(__file__).with_name("schema.json")
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def load_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def _is(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def errors(doc, schema: dict | None = None) -> list[str]:
    """Every way ``doc`` breaks ``schema`` (the xfer-bench schema by default), as 'path: problem'."""
    root = schema or load_schema()
    out: list[str] = []
    _check(doc, root, root, "$", out)
    return out


def _check(v, s: dict, root: dict, path: str, out: list[str]) -> None:
    if "$ref" in s:
        node = root
        for part in s["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        _check(v, node, root, path, out)
    if "anyOf" in s:
        if not any(not _collect(v, alt, root, path) for alt in s["anyOf"]):
            out.append(f"{path}: {v!r:.60} matches none of the allowed forms")
    if "const" in s and v != s["const"]:
        out.append(f"{path}: expected {s['const']!r}, got {v!r:.60}")
    if "enum" in s and v not in s["enum"]:
        out.append(f"{path}: expected one of {s['enum']}, got {v!r:.60}")
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is(v, t) for t in types):
            out.append(f"{path}: expected {' or '.join(types)}, got {type(v).__name__}")
            return
    if _is(v, "number"):
        if "minimum" in s and v < s["minimum"]:
            out.append(f"{path}: {v} is below the minimum {s['minimum']}")
        if "exclusiveMinimum" in s and v <= s["exclusiveMinimum"]:
            out.append(f"{path}: {v} must be > {s['exclusiveMinimum']}")
    if isinstance(v, dict):
        for key in s.get("required", []):
            if key not in v:
                out.append(f"{path}: missing {key!r}")
        props, extra = s.get("properties", {}), s.get("additionalProperties", True)
        for key, item in v.items():
            if key in props:
                _check(item, props[key], root, f"{path}.{key}", out)
            elif extra is False:
                out.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _check(item, extra, root, f"{path}.{key}", out)
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0):
            out.append(f"{path}: needs at least {s['minItems']} items, got {len(v)}")
        if "items" in s:
            for i, item in enumerate(v):
                _check(item, s["items"], root, f"{path}[{i}]", out)


def _collect(v, s: dict, root: dict, path: str) -> list[str]:
    out: list[str] = []
    _check(v, s, root, path, out)
    return out


def main(argv: list[str] | None = None) -> int:
    paths = argv if argv is not None else sys.argv[1:]
    if not paths:
        print("usage: python -m xfer.bench.schema_check RESULTS.json ...", file=sys.stderr)
        return 2
    status = 0
    for p in paths:
        problems = errors(json.loads(Path(p).read_text()))
        for e in problems:
            print(f"{p}: {e}", file=sys.stderr)
        status |= bool(problems)
        if not problems:
            print(f"{p}: valid xfer-bench/1 results")
    return status


if __name__ == "__main__":
    sys.exit(main())
