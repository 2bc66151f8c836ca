"""The tokenizer: a `tokenizers.Tokenizer` plus special tokens and the chat template.

Built from an HF folder (tokenizer.json + tokenizer_config.json) or from GGUF metadata (byte-level
BPE), so that it encodes, decodes and renders chats exactly as HF transformers does for the same files.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

CHAT_ROLES = ("system", "user", "assistant", "tool")

# Pre-tokenizer split patterns named by GGUF `tokenizer.ggml.pre`; any other name gets GPT-2's pattern.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4   # llama.cpp token types


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters, the alphabet byte-level BPE vocabularies are written in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _special_template(bos: Optional[str], eos: Optional[str], ids: dict[str, int]) -> processors.TemplateProcessing:
    """The post-processor HF builds from add_bos_token/add_eos_token (None marks a token not added)."""
    head, tail = (f"{bos}:0 " if bos else ""), (f" {eos}:0" if eos else "")
    pair_b = (f" {bos}:1" if bos else "") + " $B:1" + (f" {eos}:1" if eos else "")
    special = [(t, ids[t]) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail}{pair_b}",
                                         special_tokens=list(dict.fromkeys(special)))


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) and renders its body as is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A template compiled the way HF does: sandboxed, trim_blocks/lstrip_blocks, HF's helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _check_messages(messages) -> list[dict]:
    """Validated copies of chat messages; None-valued keys dropped and text content parts joined, as HF and
    OpenAI servers do."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; the role must be one of {', '.join(CHAT_ROLES)}")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            message["content"] = "\n".join(p["text"] for p in content)
        elif content is None and not (role == "assistant" and message.get("tool_calls")):
            raise ValueError(f"messages[{i}] ({role}) has no content")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        checked.append(message)
    return checked


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, Optional[str]],
                 chat_template: Optional[str | dict[str, str]] = None, extra_eos_token_ids=()):
        self.backend = backend
        self.special_tokens = special_tokens          # bos_token, eos_token, unk_token, pad_token -> text or None
        self.chat_templates = chat_template if isinstance(chat_template, dict) else (
            {"default": chat_template} if chat_template else {})
        bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
        self.bos_token_id: Optional[int] = backend.token_to_id(bos) if bos else None
        eos_ids = [backend.token_to_id(eos)] if eos else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in [*eos_ids, *extra_eos_token_ids]
                                                                  if i is not None))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        named = {backend.token_to_id(t) for t in special_tokens.values() if t}
        added = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids: set[int] = (named | added) - {None}
        # Whether plain encoding starts with BOS (HF: the post-processor adds it).
        self.adds_bos = self.bos_token_id is not None and backend.encode("a").ids[:1] == [self.bos_token_id]

    @property
    def chat_template(self) -> Optional[str]:
        return self.chat_templates.get("default")

    # ---- construction -------------------------------------------------------------------------------
    @staticmethod
    def from_gguf(reader_or_path) -> "Tokenizer":
        import gguf
        reader = gguf.GGUFReader(reader_or_path) if isinstance(reader_or_path, (str, os.PathLike)) else reader_or_path
        model = _gguf_value(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
        tokens: list[str] = _gguf_value(reader, "tokenizer.ggml.tokens")
        token_types: list[int] = _gguf_value(reader, "tokenizer.ggml.token_type", [])
        merges = [tuple(m.split(" ", 1)) for m in _gguf_value(reader, "tokenizer.ggml.merges", [])]
        byte_chars = byte_to_unicode()
        alphabet = set(byte_chars.values())

        def spelled(token: str) -> str:   # tokens stored as raw text are respelled in the byte alphabet
            return token if set(token) <= alphabet else "".join(byte_chars[b] for b in token.encode("utf-8"))

        vocab = {spelled(t): i for i, t in enumerate(tokens)}
        backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
        split = GGUF_PRE_SPLITS.get(_gguf_value(reader, "tokenizer.ggml.pre"))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        typed = list(zip(tokens, token_types))
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocab.
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in typed
                                    if k == _GGUF_CONTROL and set(t) <= alphabet])
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in typed
                            if k == _GGUF_USER_DEFINED and t in vocab])
        special = {}
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
            token_id = _gguf_value(reader, f"tokenizer.ggml.{key}_token_id")
            special[name] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values()
                                    if t and t not in added])
        add_bos = _gguf_value(reader, "tokenizer.ggml.add_bos_token", False)
        add_eos = _gguf_value(reader, "tokenizer.ggml.add_eos_token", False)
        bos, eos = special["bos_token"] if add_bos else None, special["eos_token"] if add_eos else None
        backend.post_processor = _special_template(bos, eos, backend.get_vocab(with_added_tokens=True))
        templates = {"default": _gguf_value(reader, "tokenizer.chat_template")}
        templates["tool_use"] = _gguf_value(reader, "tokenizer.chat_template.tool_use")
        return Tokenizer(backend, special, {k: v for k, v in templates.items() if v})

    @staticmethod
    def from_hf_folder(path: str) -> "Tokenizer":
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {path} (only 'fast' tokenizers saved as tokenizer.json "
                                    "are supported)")
        backend = BackendTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            special[name] = value.get("content") if isinstance(value, dict) else value
        # Like transformers 5: with a tokenizer.json, its post-processor alone decides BOS/EOS; the
        # add_bos_token/add_eos_token flags of tokenizer_config.json are ignored.
        template: Any = config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        extra_eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return Tokenizer(backend, special, template, extra_eos)

    # ---- encoding -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it throughout): a long prompt tokenized in a
        # worker thread leaves the serving process's event loop running.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.backend.id_to_token(i)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    # ---- chat -----------------------------------------------------------------------------------------
    def _template(self, tools) -> jinja2.Template:
        if not self.chat_templates:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        name = "tool_use" if tools and "tool_use" in self.chat_templates else "default"
        source = self.chat_templates.get(name) or next(iter(self.chat_templates.values()))
        return compile_chat_template(source)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kw) -> str:
        checked = _check_messages(messages)
        variables = {**{k: v for k, v in self.special_tokens.items() if v is not None}, **kw}
        try:
            return self._template(tools).render(messages=checked, tools=tools, documents=None,
                                                add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kw) -> list[int]:
        """Token ids of a rendered chat. Special tokens the template wrote are kept as written (HF encodes with
        add_special_tokens=False); BOS is prepended only if the tokenizer adds BOS and the template did not."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kw),
                          add_special_tokens=False)
        if self.adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
