"""Streaming detokenization: deltas add up to a full decode; stop strings cut exactly and never leak."""
import random

import pytest

from tests.support.checkpoints import make_tiny_qwen3
from replicas.detokenizer import IncrementalDetokenizer
from replicas.loaders import default_model_path
from replicas.sampling_params import SamplingParams
from replicas.tokenizer import Tokenizer

TEXTS = [
    "Hello 👩‍👩‍👧 world! 中文测试 ok\n\n  code: def f(): return 1 🤗🚀 é",
    "The capital of France is Paris. Its population is about 2.1 million people.",
    "  leading spaces, trailing tabs\t\t\nand unicode: ñ ü ß ø — “quoted” ☃ 🇫🇷",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode_chat([{"role": "user", "content": "Say something."}])


def stream(tok, prompt, ids, chunk=1, **params):
    """All (delta, stop) pairs of feeding `ids` in chunks, then the flush."""
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    steps = [detok.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, steps, detok.flush()


@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_deltas_concatenate_to_full_decode(tok, prompt, chunk):
    for text in TEXTS:
        ids = tok.encode(text)
        detok, steps, tail = stream(tok, prompt, ids, chunk)
        deltas = [d for d, _ in steps]
        assert "".join(deltas) + tail == tok.decode(ids) == detok.text
        assert all("\ufffd" not in d for d in deltas)
        assert all(stop is None for _, stop in steps)


def test_emoji_split_over_tokens_is_emitted_whole(tok, prompt):
    ids = tok.encode(" 🤗")
    assert len(ids) >= 2          # the emoji's four bytes span several byte-level tokens
    _, steps, tail = stream(tok, prompt, ids)
    deltas = [d for d, _ in steps]
    assert "".join(deltas) == " 🤗" and tail == ""
    assert sum("🤗" in d for d in deltas) == 1 and deltas[-1].endswith("🤗")


def test_incomplete_character_at_finish_is_flushed(tok, prompt):
    ids = tok.encode("ok 🤗")[:-1]                    # cut inside the emoji
    detok, steps, tail = stream(tok, prompt, ids)
    emitted = "".join(d for d, _ in steps)
    assert emitted in ("ok", "ok ")         # what precedes the cut character (a token may hold it with the cut)
    assert emitted + tail == detok.text == tok.decode(ids) and tail.endswith("\ufffd")


def test_skip_special_tokens(tok, prompt):
    ids = tok.encode("Hi there<|im_end|>")
    assert ids[-1] == 2
    assert stream(tok, prompt, ids)[0].text == "Hi there"
    assert stream(tok, prompt, ids, skip_special_tokens=False)[0].text == "Hi there<|im_end|>"


def test_stop_string_across_token_boundaries(tok, prompt):
    text = "The capital of France is Paris. Its population is large."
    ids = tok.encode(text)
    detok, steps, tail = stream(tok, prompt, ids, stop=["is Par"])
    # the stop string starts and ends inside different tokens
    assert "is Par" not in "".join(tok.decode([i]) for i in ids[:1]) and len(tok.encode("is Par")) > 1
    assert detok.text == "The capital of France " and detok.stop_reason == "is Par"
    assert [s for _, s in steps if s] == ["is Par"] and tail == ""
    assert "".join(d for d, _ in steps) == detok.text
    emitted = ""
    for delta, _ in steps:        # no delta ever reaches past the cut
        emitted += delta
        assert text.startswith(emitted) and len(emitted) <= len("The capital of France ")


def test_include_stop_str_in_output(tok, prompt):
    ids = tok.encode("The capital of France is Paris. Its population is large.")
    detok, _, _ = stream(tok, prompt, ids, stop=["Paris", "capital"], include_stop_str_in_output=True)
    assert detok.text == "The capital" and detok.stop_reason == "capital"     # the earliest match wins


def test_possible_stop_prefix_is_held_then_released(tok, prompt):
    ids = tok.encode("Hello world")
    assert [tok.decode([i]) for i in ids] == ["Hello", " world"]
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["Hello there"]))
    assert detok.update(ids[:1]) == ("", None)                  # "Hello" may begin "Hello there"
    assert detok.update(ids[1:]) == ("Hello world", None)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["Hello there"]))
    detok.update(ids[:1])
    assert detok.flush() == "Hello" and detok.text == "Hello"   # finished without the stop: released


def test_stop_in_one_multi_token_update_and_tokens_after_stop(tok, prompt):
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["gamma"]))
    assert detok.update(ids) == ("alpha beta ", "gamma")
    assert detok.update(tok.encode(" more")) == ("", None)
    assert detok.flush() == "" and detok.text == "alpha beta "


def test_min_tokens_defers_stop_strings(tok, prompt):
    ids = tok.encode("stop here, then stop again")
    detok, steps, _ = stream(tok, prompt, ids, stop=["stop"], min_tokens=3)
    assert detok.text == "stop here, then " and detok.stop_reason == "stop"


def test_windows_stay_small(tok, prompt):
    """Updates run in the tokenizer's stream (no whole-output decode); the flush decodes a few held tokens."""
    ids = tok.encode(" ".join(TEXTS) * 8 + " 🤗")[:-1]     # ends inside the emoji: the flush has held tokens
    widths = []
    decode = tok.decode

    class Spy:
        backend = tok.backend

        def decode(self, window, skip_special_tokens=True):
            widths.append(len(window))
            return decode(window, skip_special_tokens)

    detok = IncrementalDetokenizer(Spy(), prompt, SamplingParams(stop=["never appears"]))
    for i in ids:
        detok.update([i])
    assert len(ids) > 300 and widths == []
    assert detok.text + detok.flush() == tok.decode(ids)
    assert 0 < max(widths) <= 12


def test_stream_refusing_a_window_restarts_from_the_emitted_tokens(tok, prompt, monkeypatch):
    """tokenizers' stream raises on a window whose text does not extend its previous text: a fresh stream takes
    the held and new ids, and the deltas still add up to the full decode."""
    import replicas.detokenizer as module
    ids = tok.encode(TEXTS[0])
    real, made = module.DecodeStream, []

    class Refusing:
        def __init__(self, *args, **kwargs):
            self.inner, self.calls = real(*args, **kwargs), 0
            made.append(self)

        def step(self, backend, new):
            self.calls += 1
            if len(made) == 1 and self.calls == 9:          # past the prompt's 5 tokens of context
                raise Exception("Invalid prefix encountered")
            return self.inner.step(backend, new)

    monkeypatch.setattr(module, "DecodeStream", Refusing)
    detok, steps, tail = stream(tok, prompt, ids)
    assert len(made) == 2
    assert "".join(d for d, _ in steps) + tail == detok.text == tok.decode(ids)


def test_random_token_streams_match_decode_and_cut_at_first_stop(tmp_path):
    tok = Tokenizer.from_hf_folder(make_tiny_qwen3(tmp_path))
    rng = random.Random(0)
    stopped = 0
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        skip = trial % 3 != 0
        full = tok.decode(ids, skip_special_tokens=skip)
        stops = []
        if trial % 2 and len(full) > 4:
            at = rng.randrange(len(full) - 2)
            stops = [full[at:at + rng.randrange(1, 4)]]
            stops = [s for s in stops if "\ufffd" not in s]
        detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops, skip_special_tokens=skip))
        out, pos = [], 0
        while pos < len(ids):
            n = rng.randrange(1, 4)
            out.append(detok.update(ids[pos:pos + n])[0])
            pos += n
        out.append(detok.flush())
        expected = full if not stops or stops[0] not in full else full[:full.index(stops[0])]
        assert "".join(out) == detok.text == expected, (ids, stops)
        stopped += detok.stop_reason is not None
    assert stopped > 50
