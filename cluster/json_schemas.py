"""The JSON schemas a request brings (`response_format`'s, the tools' `parameters`): bounded in size and depth,
then checked against the JSON Schema metaschema; a bad one is a 400 naming its parameter. Whether the grammar
backend can enforce a schema is the engine's check (also a 400, replicas/structured/xgrammar_backend.py)."""
from __future__ import annotations

import json
from typing import Any

from cluster.errors import bad_request

MAX_SCHEMA_DEPTH = 32           # nesting of objects and arrays in one schema


def check_schema(schema: Any, param: str, max_bytes: int) -> None:
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema (an object)", param, "invalid_value")
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > max_bytes:
        raise bad_request(f"{param} is a schema of {size} bytes; this server takes at most {max_bytes}", param,
                          "invalid_value")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param, "invalid_value")
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise bad_request(f"{param} is not a valid JSON schema: {e.message}" + (f" (at {where})" if where else ""),
                          param, "invalid_value") from None


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest
