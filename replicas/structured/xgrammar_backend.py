"""The xgrammar grammar backend (CPU and CUDA alike: matchers and bitmasks live on the host).

Vocabulary: the tokenizer's tokens in their encoded spelling, padded with empty entries to the model's vocabulary
(the LM head's width); special tokens other than the stop tokens are blanked, which xgrammar treats as never
allowed, so a grammar never lets `<|im_start|>` and the like into a JSON string. JSON is generated without free
whitespace (`", "` and `": "` separators), so a grammar never lets a model pad its output with blank lines; in tool
calls (xgrammar's structural tags) at most one whitespace character may separate two JSON tokens.

Schemas: xgrammar compiles some keywords without enforcing them; a schema using one is refused (GrammarError), so an
output never fails a schema the request was accepted with: `uniqueItems`, `contains` (and its bounds), `not`,
`if`/`then`/`else`, `dependentRequired`/`dependentSchemas`/`dependencies`, `multipleOf` on non-integers, `allOf` of
several schemas, and regex lookaround in `pattern`. `oneOf` is generated as `anyOf` (exclusivity is not checked).
"""
from __future__ import annotations

import json
import logging
import re
import statistics
import time
from typing import Any, Optional, Sequence

import xgrammar as xgr
from torch import Tensor

from replicas.structured.backend import GrammarError
from replicas.structured.spec import GrammarSpec

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")    # xgrammar's C++ errors start with "[time] file.cc:line: "
_ANY_OBJECT = json.dumps({"type": "object"})
_NOT_ENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                 "dependentRequired", "dependentSchemas", "dependencies")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
FILL_TRIALS = 16                # timed fills each way per batch-size bucket before the faster way is kept
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "propertyNames", "unevaluatedItems",
              "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


log = logging.getLogger(__name__)


class FillThreading:
    """Whether xgrammar's thread pool or the calling thread fills a step's bitmask rows, per batch size (buckets of
    powers of two), by timing on the live traffic: a bucket's first fills alternate between the two ways,
    FILL_TRIALS each, then the one with the lower median is kept. Handing rows to the pool costs a wake-up and a
    join, a row a microsecond or two, so which wins depends on the rows and on the machine's cores. Both ways write
    the same bitmask. With one thread there is nothing to choose."""

    def __init__(self, threads: int):
        self.threads = threads
        self.chosen: dict[int, bool] = {}                           # bucket -> threaded
        self._trials: dict[int, tuple[list[float], list[float]]] = {}  # bucket -> (calling thread, pool) seconds

    def next(self, rows: int) -> tuple[bool, bool]:
        """(whether the pool fills this batch of `rows`, whether the fill is a trial to time and `record`)."""
        if self.threads <= 1:
            return False, False
        bucket = rows.bit_length()
        chosen = self.chosen.get(bucket)
        if chosen is not None:
            return chosen, False
        alone, pooled = self._trials.setdefault(bucket, ([], []))
        return len(pooled) < len(alone), True

    def record(self, rows: int, threaded: bool, seconds: float) -> None:
        """A trial fill's time (after `next` said it was one)."""
        bucket = rows.bit_length()
        alone, pooled = self._trials[bucket]
        (pooled if threaded else alone).append(seconds)
        if len(pooled) >= FILL_TRIALS and len(alone) >= FILL_TRIALS:
            self.chosen[bucket] = statistics.median(pooled) < statistics.median(alone)
            log.info("grammar bitmask fills of %d-%d rows: %s (median %.1f us on the calling thread, %.1f us on %d "
                     "threads)", 1 << (bucket - 1), (1 << bucket) - 1,
                     "thread pool" if self.chosen[bucket] else "calling thread", 1e6 * statistics.median(alone),
                     1e6 * statistics.median(pooled), self.threads)


def vocab_type(backend_json: dict) -> tuple[xgr.VocabType, bool]:
    """(vocabulary type, add_prefix_space) of a `tokenizers` tokenizer, read from its decoder and normalizer."""
    decoder = backend_json.get("decoder") or {}
    decoders = decoder.get("decoders") or [decoder]
    kinds = {d.get("type") for d in decoders if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in kinds:
        normalizer = json.dumps(backend_json.get("normalizer") or {})
        pre = json.dumps(backend_json.get("pre_tokenizer") or {})
        prefix = '"Prepend"' in normalizer or ('"Metaspace"' in pre and '"never"' not in pre)
        return xgr.VocabType.BYTE_FALLBACK, prefix
    return xgr.VocabType.RAW, False


class XGrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], threads: int):
        stops = set(stop_token_ids)
        encoded = [""] * vocab_size
        for token, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and (i not in tokenizer.all_special_ids or i in stops):
                encoded[i] = token
        kind, prefix = vocab_type(json.loads(tokenizer.backend.to_str()))
        info = xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=sorted(stops),
                                 add_prefix_space=prefix)
        # The engine keeps its own cache (replicas/structured/cache.py): xgrammar's would hold a second copy.
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(threads)
        self.batch_one = xgr.BatchGrammarMatcher(1)
        self.fill_threading = FillThreading(threads)

    def compile(self, spec: GrammarSpec) -> Any:
        for schema in [spec.schema] if spec.kind == "json_schema" else [p for _, p in spec.tools]:
            problem = not_enforced(json.loads(schema))
            if problem is not None:
                raise GrammarError(problem)
        try:
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            return self.compiler.compile_structural_tag(json.dumps(self._tool_calls(spec)))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_LOG_PREFIX.sub("", str(e)).strip().splitlines()[0]) from None

    @staticmethod
    def _tool_calls(spec: GrammarSpec) -> dict:
        calls = [spec.call_schema(name, params) for name, params in spec.tools]
        fmt = spec.call_format
        content = {"type": "json_schema", "json_schema": calls[0] if len(calls) == 1 else {"anyOf": calls},
                   "max_whitespace_cnt": 1}
        return {"type": "structural_tag", "format": {
            "type": "tags_with_separator", "separator": fmt.separator, "at_least_one": True,
            "stop_after_first": spec.single_call,
            "tags": [{"type": "tag", "begin": fmt.begin, "content": content, "end": fmt.end}]}}

    def new_matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: Sequence[Any], bitmask: Tensor, rows: Optional[Sequence[int]] = None) -> None:
        threaded, trial = self.fill_threading.next(len(matchers))
        start = time.perf_counter() if trial else 0.0
        (self.batch if threaded else self.batch_one).batch_fill_next_token_bitmask(
            list(matchers), bitmask, None if rows is None else list(rows))
        if trial:
            self.fill_threading.record(len(matchers), threaded, time.perf_counter() - start)

    def accept(self, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        # One call per matcher: xgrammar's batched accept builds its result through a per-element array lookup,
        # which costs more than the accepts themselves at a step's batch sizes.
        return [m.accept_token(t) for m, t in zip(matchers, tokens)]

    def is_terminated(self, matcher: Any) -> bool:
        return matcher.is_terminated()

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)


def not_enforced(schema: Any, where: str = "#") -> Optional[str]:
    """Why xgrammar would not enforce `schema` (a keyword it compiles but does not check), or None."""
    if not isinstance(schema, dict):
        return None
    for key in _NOT_ENFORCED:
        if key in schema:
            return f"{key} is not supported (at {where})"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"multipleOf is supported on integers only (at {where})"
    if len(schema.get("allOf") or ()) > 1:
        return f"allOf of several schemas is not supported (at {where})"
    if isinstance(schema.get("pattern"), str) and _LOOKAROUND.search(schema["pattern"]):
        return f"pattern: lookahead and lookbehind are not supported (at {where})"
    subschemas = [(f"{where}/{k}", schema[k]) for k in _SUBSCHEMA if k in schema]
    subschemas += [(f"{where}/{k}/{i}", s) for k in _SUBSCHEMA_LISTS if isinstance(schema.get(k), list)
                   for i, s in enumerate(schema[k])]
    subschemas += [(f"{where}/{k}/{name}", s) for k in _SUBSCHEMA_MAPS if isinstance(schema.get(k), dict)
                   for name, s in schema[k].items()]
    for path, sub in subschemas:
        problem = not_enforced(sub, path)
        if problem is not None:
            return problem
    return None


def create(tokenizer, vocab_size: int, stop_token_ids: Sequence[int], threads: int) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, threads)
