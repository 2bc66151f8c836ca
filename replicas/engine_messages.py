"""The messages between AsyncLLMEngine and its engine core process (replicas/engine_core.py): one class per kind.
The core dispatches on the message's type. Prompts cross as token ids: the client tokenizes (and applies chat
templates), so the core's step loop never does. Client -> core messages are pickled (`Connection.send`); core ->
client messages go as bytes (`encode_core_message`): Outputs, the one message of every step, as msgpack.

client -> core:  AddRequest | AbortRequest | GetStats | DrainFinishedTimings | Reconfigure | OpenEndpoint | Ping |
                 Shutdown
core -> client:  Ready (once, first) | Outputs | RequestFailed | Reply (one per call) | CoreDied (last)

Besides its owner (the process that started it, over two pipes) a core can serve further clients over one socket each
(`OpenEndpoint`; replicas/core_endpoint.py): the same messages, each client getting its own requests' outputs.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Optional, Union

import msgspec

from replicas.outputs import RequestOutput
from replicas.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages (and tools to offer, OpenAI tool objects) that AsyncLLMEngine turns into prompt ids with the
    model's chat template."""
    messages: list[dict]
    tools: Optional[list[dict]] = None


Prompt = Union[str, list[int], ChatPrompt]          # what AsyncLLMEngine takes


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int               # ids below this are valid in both the model and the tokenizer
    kv_tokens: int                # tokens the KV cache's base region holds (an elastic reserve not counted)
    elastic_available: bool


@dataclass(frozen=True, slots=True)
class CoreAddress:
    """Where a core accepts clients beyond its owner: a TCP address and the key both ends prove they hold
    (multiprocessing.connection's HMAC challenge)."""
    host: str
    port: int
    authkey: bytes


# ---- client -> core ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class EngineCall:
    """A call of an engine method, answered by one Reply with the same call_id between two steps."""
    call_id: int


@dataclass(frozen=True, slots=True)
class GetStats(EngineCall):
    pass


@dataclass(frozen=True, slots=True)
class DrainFinishedTimings(EngineCall):
    pass


@dataclass(frozen=True, slots=True)
class Reconfigure(EngineCall):
    max_num_batched_tokens: Optional[int] = None
    elastic: Optional[str] = None
    speculation: Optional[bool] = None


@dataclass(frozen=True, slots=True)
class OpenEndpoint(EngineCall):
    """The owner asks the core to accept further clients on `host`; the reply is the `CoreAddress`."""
    host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Ping(EngineCall):
    """Answered between two steps: a client without the owner's heartbeat learns that the core still steps."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """From the owner: stop the core. From another client: that client leaves (its requests are aborted)."""


ClientMessage = Union[AddRequest, AbortRequest, GetStats, DrainFinishedTimings, Reconfigure, OpenEndpoint, Ping,
                      Shutdown]


# ---- core -> client ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


class Outputs(msgspec.Struct, array_like=True, gc=False):
    """One engine step's outputs (without their prompts: the client has them)."""
    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class RequestFailed:
    request_id: str
    error: BaseException              # engine_core.portable_error(e): one the client can unpickle


@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    ok: bool
    value: object                     # the call's result, or its portable_error when not ok


@dataclass(frozen=True, slots=True)
class CoreDied:
    reason: str                       # one line for clients; the core logged the traceback


CoreMessage = Union[Ready, Outputs, RequestFailed, Reply, CoreDied]


_PICKLED, _OUTPUTS = 0, 1
_encoder = msgspec.msgpack.Encoder()
_outputs_decoder = msgspec.msgpack.Decoder(Outputs)


def encode_core_message(msg: CoreMessage) -> bytearray:
    """A core -> client message as the bytes `decode_core_message` reads: a kind byte, then Outputs as msgpack
    (msgspec builds and loads it at a fraction of pickle's cost, on the core's step loop and on the serving
    process's GIL) or any other message pickled (they are rare, and carry exceptions and call results)."""
    if type(msg) is Outputs:
        buf = bytearray((_OUTPUTS,))
        _encoder.encode_into(msg, buf, 1)
        return buf
    buf = bytearray((_PICKLED,))
    buf += pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return buf


def decode_core_message(data: bytes) -> CoreMessage:
    body = memoryview(data)[1:]
    return _outputs_decoder.decode(body) if data[0] == _OUTPUTS else pickle.loads(body)
