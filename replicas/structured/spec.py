"""What a request's output must match: the grammar spec that crosses from the API to the engine core.

A spec says what, never how: a JSON schema, any JSON object, or tool calls written in the model's own tool-call
format. The grammar backend (replicas/structured/backend.py) turns it into a compiled grammar; specs are frozen
and hashable, so a spec is its own cache key (replicas/structured/cache.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

KINDS = ("json_schema", "json_object", "tool")


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: each call is `begin` + a JSON object {"name": ..., <arguments_key>: {...}}
    + `end`; consecutive calls are separated by `separator`; `parallel`: one turn may hold several calls."""
    name: str
    begin: str
    end: str
    separator: str
    arguments_key: str
    parallel: bool = True


@dataclass(frozen=True)
class GrammarSpec:
    """kind json_schema: `schema` is the JSON schema (compact JSON text, key order kept: it is the order the
    properties are generated in). json_object: any JSON object. tool: one call (`single_call`) or more in
    `call_format`, each to one of `tools` = ((function name, parameters JSON schema text), ...), its arguments valid
    against that function's parameters."""
    kind: str
    schema: str = ""
    tools: tuple[tuple[str, str], ...] = ()
    call_format: Optional[ToolCallFormat] = None
    single_call: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema" and not self.schema:
            raise ValueError("a json_schema grammar needs a schema")
        if self.kind == "tool" and (not self.tools or self.call_format is None):
            raise ValueError("a tool grammar needs tools and a call format")

    @staticmethod
    def json_schema(schema: Any) -> "GrammarSpec":
        return GrammarSpec("json_schema", schema=schema_text(schema))

    @staticmethod
    def json_object() -> "GrammarSpec":
        return GrammarSpec("json_object")

    @staticmethod
    def tool_calls(tools: list[tuple[str, Any]], call_format: ToolCallFormat, single_call: bool) -> "GrammarSpec":
        return GrammarSpec("tool", tools=tuple((name, schema_text(p)) for name, p in tools),
                           call_format=call_format, single_call=single_call or not call_format.parallel)

    @property
    def param(self) -> str:
        """The API parameter that asked for this grammar (an error about it names this parameter)."""
        return "tools" if self.kind == "tool" else "response_format"

    @property
    def num_bytes(self) -> int:
        """Bytes of the JSON schemas the grammar is compiled from (bounded by the engine's max_schema_bytes)."""
        return len(self.schema.encode()) + sum(len(p.encode()) for _, p in self.tools)

    def call_schema(self, name: str, parameters: str) -> dict:
        """The JSON schema of one call object of tool `name` in this spec's call format."""
        key = self.call_format.arguments_key
        return {"type": "object", "properties": {"name": {"const": name}, key: json.loads(parameters)},
                "required": ["name", key], "additionalProperties": False}


def schema_text(schema: Any) -> str:
    """A JSON schema (dict or JSON text) as compact JSON text, its key order kept."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
