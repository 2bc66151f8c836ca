"""Tool calling on chat (docs/structured_outputs.md): how the served model writes calls, the prompt that offers it
the tools, the grammar that forces calls, and the parser that reads them back from its output.

Formats (`ToolSupport.of_template`, from the chat template's source):
  hermes       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call (Qwen2.5, Qwen3, Hermes)
  llama3_json  `{"name": ..., "parameters": {...}}`, the whole output, one call (Llama 3.1+)
A template that does not use `tools` (SmolLM2's) gets the fallback: a system block that lists the functions as
JSON and asks for calls in the hermes format; earlier calls and tool results in the conversation are written in
that format too (results as user turns in `<tool_response>` tags).

`tool_choice` `required` and a named function force the calls through the grammar, in the model's own format, so
the same parser reads forced and free (`auto`) calls; `none` offers no tools and parses nothing.

The parser is incremental: `feed(text)` takes each new piece of output and returns the content and the tool-call
deltas it completes (a call's header once its name is known, then pieces of its arguments as they arrive);
`finish()` flushes what is held back. A whole output is parsed by feeding it at once, so a stream's deltas always
assemble to the non-streamed answer. Text between and around calls is content (its trailing whitespace dropped); a
call whose JSON has no name is content too.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from replicas.structured.spec import GrammarSpec, ToolCallFormat

HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", parallel=True)
LLAMA3_JSON = ToolCallFormat("llama3_json", "", "", "; ", "parameters", parallel=False)

FALLBACK_PROMPT = (
    "You may call functions to help with the user's request. The available functions, as JSON schemas:\n"
    "{functions}\n\n"
    "To call a function, answer with one block per call and nothing else:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <the arguments as a JSON object>}}\n</tool_call>\n"
    "The results come back in <tool_response> blocks.")


@dataclass(frozen=True)
class ToolSupport:
    """What the served model's chat template does with tools: the call format its model writes, and whether the
    template renders `tools` itself (native) or gets the fallback system block."""
    call_format: ToolCallFormat
    native: bool

    @staticmethod
    def of_template(source: Optional[str]) -> "ToolSupport":
        if not source or not re.search(r"\btools\b", source):
            return ToolSupport(HERMES, native=False)
        if "<|python_tag|>" in source or "ipython" in source:
            return ToolSupport(LLAMA3_JSON, native=True)
        return ToolSupport(HERMES, native=True)


# ---- the prompt ------------------------------------------------------------------------------------------------

def template_messages(messages: list[dict], tools: Optional[list[dict]], support: ToolSupport
                      ) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) for the chat template. `messages` are OpenAI chat messages (assistant `tool_calls` with
    JSON-text arguments, `tool` results); `tools` the OpenAI tool objects to offer, or None."""
    if support.native:
        return [_native_message(m) for m in messages], tools
    out = [_fallback_message(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = FALLBACK_PROMPT.format(functions=listing)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _native_message(m: dict) -> dict:
    """Templates write a call's arguments with `tojson`: they get the arguments as a JSON value, not as text."""
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _fallback_message(m: dict) -> dict:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if not m.get("tool_calls"):
        return m
    blocks = [HERMES.begin + json.dumps({"name": c["function"]["name"],
                                         "arguments": _arguments_object(c["function"]["arguments"])},
                                        ensure_ascii=False) + HERMES.end for c in m["tool_calls"]]
    content = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
    return {"role": "assistant", "content": content}


# ---- forced calls ----------------------------------------------------------------------------------------------

def forced_calls(tools: list[tuple[str, dict]], named: Optional[str], parallel: bool,
                 support: ToolSupport) -> GrammarSpec:
    """The grammar of `tool_choice` required (one or more calls to any of `tools`, one if not `parallel`) or of a
    named function (one call to it); `tools` are (name, parameters schema)."""
    chosen = [(n, p) for n, p in tools if n == named] if named is not None else tools
    return GrammarSpec.tool_calls(chosen, support.call_format, single_call=named is not None or not parallel)


# ---- reading calls back ----------------------------------------------------------------------------------------

@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""            # JSON text, as the model wrote it


@dataclass
class ToolCallDelta:
    """What one tool call gained: its header (id, name) once, then pieces of its arguments."""
    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _ValueEnd:
    """Where a JSON value ends in text that arrives in pieces: strings and {} [] nesting tracked; a value that is
    not an object, array or string ends before the first `,` `}` or `]` at its own level."""
    _SPECIAL = re.compile(r'["\\{}\[\],]')

    def __init__(self):
        self.depth, self.in_string, self.started = 0, False, False
        self.escape_at = -1            # index of the character a backslash escapes
        self.seen = 0                  # characters scanned

    def feed(self, text: str) -> Optional[int]:
        """Scan text[self.seen:] (text is the whole value so far); the index just past the value's end, or None."""
        start, self.seen = self.seen, len(text)
        if not self.started:
            stripped = len(text) - len(text[start:].lstrip())
            if stripped == len(text):
                return None
            start, self.started = stripped, True
        for m in self._SPECIAL.finditer(text, start):
            c, at = m.group(), m.start()
            if self.in_string:
                if at == self.escape_at:
                    continue
                if c == "\\":
                    self.escape_at = at + 1
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return at + 1
                continue
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:
                    return at
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
            elif c == "," and self.depth == 0:
                return at
        return None


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class _OpenCall:
    text: str = ""                                  # the call's text after its begin marker
    body: _ValueEnd = field(default_factory=_ValueEnd)
    body_end: Optional[int] = None
    index: Optional[int] = None                      # its index in `calls` once its header was sent
    args_start: int = 0
    args: _ValueEnd = field(default_factory=_ValueEnd)
    args_end: Optional[int] = None
    args_sent: int = 0


class ToolCallParser:
    """Reads one choice's output (see the module's docstring); `calls` holds every call read so far."""

    def __init__(self, call_format: ToolCallFormat, new_id: Callable[[], str] = new_call_id):
        self.begin, self.end = call_format.begin.strip(), call_format.end.strip()
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._text = ""                     # text not yet classified
        self._call: Optional[_OpenCall] = None
        self._held_space = ""               # trailing whitespace of the content, sent only if content follows it
        self._bare_calls = not self.begin   # llama3_json: the output is bare JSON calls if it starts with "{"
        self._decided = bool(self.begin)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and the tool-call deltas that `text` (the output's next piece) completes."""
        self._text += text
        content, deltas = [], []
        while self._text:
            if self._call is not None:
                if not self._feed_call(content, deltas):
                    break
            elif not self._feed_text(content):
                break
        return self._content("".join(content)), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back, at the end of the output (a partial marker, or a call that never got its name)."""
        content, call = self._text, self._call
        self._text, self._call = "", None
        if call is not None and call.index is None:
            content = self.begin + call.text + content
        elif self._bare_calls and not content.strip(" \t\n;"):
            content = ""                     # separators after llama3_json calls
        return self._content(content), []

    # ---- text outside calls -------------------------------------------------------------------
    def _feed_text(self, content: list[str]) -> bool:
        if self._bare_calls:
            if not self._decided:
                stripped = self._text.lstrip()
                if not stripped:
                    return False
                self._decided = True
                self._bare_calls = stripped.startswith("{")
                if self._bare_calls:
                    self._call, self._text = _OpenCall(), stripped
                return True
            rest = self._text.lstrip().lstrip(";").lstrip()
            if rest.startswith("{"):
                self._call, self._text = _OpenCall(), rest
                return True
            if not rest and self._text:
                return False                 # a separator so far: wait for what follows it
            content.append(self._text)
            self._text = ""
            return False
        if not self.begin:
            content.append(self._text)
            self._text = ""
            return False
        at = self._text.find(self.begin)
        if at < 0:
            keep = _partial_suffix(self._text, self.begin)
            content.append(self._text[:len(self._text) - keep])
            self._text = self._text[len(self._text) - keep:]
            return False
        content.append(self._text[:at])
        self._call, self._text = _OpenCall(), self._text[at + len(self.begin):]
        return True

    # ---- inside a call ------------------------------------------------------------------------
    def _feed_call(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Take the text into the open call; True when the call ended and text is left to classify."""
        call = self._call
        call.text += self._text
        self._text = ""
        if call.body_end is None:
            call.body_end = call.body.feed(call.text)
        if call.index is None:
            header = _HEADER.match(call.text)
            if header is not None and (call.body_end is None or header.end() < call.body_end):
                self._open(call, json.loads(f'"{header.group(1)}"'), deltas)
                call.args_start = header.end()
        if call.index is not None and call.args_end is None:
            args_text = call.text[call.args_start:]
            end = call.args.feed(args_text)
            if end is not None:
                call.args_end = call.args_start + end
            upto = len(args_text) if end is None else end
            piece = args_text[call.args_sent:upto]
            if call.args_sent == 0:
                piece = piece.lstrip()
            if piece:
                self.calls[call.index].arguments += piece
                deltas.append(ToolCallDelta(call.index, arguments=piece))
            call.args_sent = upto
        if call.body_end is None:
            return False
        rest = call.text[call.body_end:]
        if self.end:
            stripped = rest.lstrip()
            if len(stripped) < len(self.end) and self.end.startswith(stripped):
                return False                 # the end marker may still be arriving
            if stripped.startswith(self.end):
                rest = stripped[len(self.end):]
        if call.index is None:
            raw = self.begin + call.text[:len(call.text) - len(rest)]
            self._close_unnamed(call.text[:call.body_end], raw, content, deltas)
        self._call, self._text = None, rest
        return bool(rest)

    def _open(self, call: _OpenCall, name: str, deltas: list[ToolCallDelta]) -> None:
        call.index = len(self.calls)
        self.calls.append(ToolCall(self.new_id(), name))
        deltas.append(ToolCallDelta(call.index, id=self.calls[-1].id, name=name))

    def _close_unnamed(self, body: str, raw: str, content: list[str], deltas: list[ToolCallDelta]) -> None:
        """A call whose name did not come first: taken whole if `body` is an object with a name and arguments,
        else its text (`raw`, markers included) is content."""
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
            content.append(raw)
            return
        call = _OpenCall()
        self._open(call, obj["name"], deltas)
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        self.calls[call.index].arguments = text
        deltas.append(ToolCallDelta(call.index, arguments=text))

    def _content(self, text: str) -> str:
        """Content to send now: trailing whitespace waits for content after it (dropped at the end), so the
        pieces do not depend on how the output was cut."""
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        return body


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (held back: it may be the start
    of the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_tool_calls(text: str, call_format: ToolCallFormat) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output."""
    parser = ToolCallParser(call_format)
    content = parser.feed(text)[0] + parser.finish()[0]
    return content, parser.calls
