"""Structured outputs: grammar-guided decoding (docs/structured_outputs.md).

spec.py          GrammarSpec: what a request's output must match (backend-neutral, crosses to the engine core)
backend.py       the grammar backend interface (compile, matchers, batched fill and accept) and its loader
xgrammar_backend.py   the xgrammar implementation
cache.py         GrammarCache: compiled grammars, bounded LRU, compiled off the step loop
bitmask.py       the packed token bitmask and its batched masked fill on the logits rows
guided.py        GuidedDecoding: the engine's per-sequence grammar state, the per-step bitmask, accept, resync
"""
