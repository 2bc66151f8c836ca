"""Tokenizer parity with HF transformers: SmolLM2's GGUF tokenizer and the tiny HF folders."""
import copy
import json
import os

import gguf
import pytest

from replicas.loaders import default_model_path
from replicas.tokenizer import Tokenizer
from tests.support.checkpoints import make_tiny_gguf, make_tiny_llama, make_tiny_qwen3

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "héllo wörld — ñ “quotes” «guillemets» naïve café",
    "emoji 🤗🚀👩‍👩‍👧 ok 👍🏽 ❤️",
    "中文测试，日本語のテキスト、한국어 문장",
    "   lots   of\t\tspaces \n\n  \r\n trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>x<file_sep>y<|endoftext|>",
    "<think>\nhmm\n</think>\n\n<tool_call>{}</tool_call>",
    "",
    "12345678 3.14159 1e-9 0xFF 1,000,000",
    "don't I'LL we've THEY'RE it's",
    "\u200b\u00a0zero width and nbsp",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 🤗"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "  and 3+3?  "}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _hf_tokenizer(folder, gguf_file=None):
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    return Tokenizer.from_gguf(path), _hf_tokenizer(os.path.dirname(path), os.path.basename(path))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    make = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[request.param]
    folder = make(tmp_path_factory.mktemp(request.param))
    return Tokenizer.from_hf_folder(folder), _hf_tokenizer(folder)


def _check_parity(ours, theirs, texts=TEXTS):
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), text


def _check_chat_parity(ours, theirs, **kw):
    for chat in CHATS:
        for gen in (True, False):
            expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen, **kw)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, **kw) == expected
            expected_ids = theirs.apply_chat_template(chat, add_generation_prompt=gen, **kw)["input_ids"]
            assert ours.encode_chat(chat, add_generation_prompt=gen, **kw) == expected_ids


def test_smollm2_encode_decode_equal_transformers(smollm2):
    _check_parity(*smollm2)


def test_smollm2_chat_template_equal_transformers(smollm2):
    ours, theirs = smollm2
    _check_chat_parity(ours, theirs)
    assert ours.apply_chat_template(CHATS[0]).endswith("<|im_start|>assistant\n")


def test_smollm2_special_tokens(smollm2):
    ours, theirs = smollm2
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == (theirs.eos_token_id,) == (2,)
    assert ours.vocab_size == len(theirs) == 49152
    assert set(theirs.all_special_ids) <= ours.all_special_ids
    assert ours.id_to_token(2) == "<|im_end|>" and not ours.adds_bos
    # every control token of the file stays one token and is skipped when decoding
    assert ours.encode("<jupyter_code>x") == [13, ours.encode("x")[0]]
    assert ours.decode([13, 2, 1]) == ""


def test_tiny_folder_encode_decode_equal_transformers(tiny):
    _check_parity(*tiny)


def test_tiny_folder_chat_template_equal_transformers(tiny):
    ours, theirs = tiny
    _check_chat_parity(ours, theirs)
    _check_chat_parity(ours, theirs, tools=TOOLS)


def test_missing_special_tokens_render_empty_like_transformers(tiny):
    ours, theirs = copy.copy(tiny[0]), tiny[1]
    template = "[{{ bos_token }}][{{ unk_token }}][{{ eos_token }}]"
    ours.chat_templates = {"default": template}
    assert ours.apply_chat_template(CHATS[0]) == theirs.apply_chat_template(CHATS[0], chat_template=template,
                                                                            tokenize=False)


def test_tokenizer_pickles_after_rendering(smollm2):
    import pickle
    ours = smollm2[0]
    text = ours.apply_chat_template(CHATS[0])
    again = pickle.loads(pickle.dumps(ours))
    assert again.apply_chat_template(CHATS[0]) == text and again.encode(text) == ours.encode(text)


def test_tiny_llama_bos_written_once(tmp_path):
    tok = Tokenizer.from_hf_folder(make_tiny_llama(tmp_path))
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.adds_bos and tok.bos_token_id == bos
    assert tok.encode("hi")[0] == bos and tok.encode("hi", add_special_tokens=False)[0] != bos
    ids = tok.encode_chat(CHATS[0])
    assert ids[0] == bos and ids.count(bos) == 1
    # generation_config's EOS ids join the tokenizer's own
    assert set(tok.eos_token_ids) == {tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")}
    assert tok.eos_token_ids[0] == tok.token_to_id("<|eot_id|>")


@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_qwen3])
def test_tokenizer_json_post_processor_overrides_config_flags_like_transformers(tmp_path, make):
    folder = make(tmp_path)
    config_file = os.path.join(folder, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(add_bos_token=make is make_tiny_qwen3, add_eos_token=True)
    with open(config_file, "w") as f:
        json.dump(config, f)
    assert Tokenizer.from_hf_folder(folder).encode("hi there") == _hf_tokenizer(folder)("hi there")["input_ids"]


def test_tiny_qwen3_plain_added_tokens_survive_skip(tmp_path):
    tok = Tokenizer.from_hf_folder(make_tiny_qwen3(tmp_path))
    assert tok.bos_token_id is None and not tok.adds_bos
    ids = tok.encode("<think>a</think><|im_end|>")
    assert tok.token_to_id("<think>") in ids
    assert tok.decode(ids) == "<think>a</think>"
    assert tok.token_to_id("<think>") not in tok.all_special_ids
    assert tok.token_to_id("<|im_end|>") in tok.all_special_ids
    no_think = tok.apply_chat_template(CHATS[0], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_tokenizer_equals_its_source_folder_and_transformers(tmp_path, arch):
    path = make_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    from_gguf, from_folder = Tokenizer.from_gguf(path), Tokenizer.from_hf_folder(path + ".hf")
    theirs = _hf_tokenizer(str(tmp_path), f"{arch}.gguf")
    # transformers gives a GGUF without an unknown token an extra "<|endoftext|>" (GPT2Tokenizer's default unk),
    # past the model's vocabulary; we do not copy that.
    _check_parity(from_gguf, theirs, [t for t in TEXTS if "<|endoftext|>" not in t])
    for text in TEXTS:
        assert from_gguf.encode(text) == from_folder.encode(text)
    assert from_gguf.apply_chat_template(CHATS[1]) == from_folder.apply_chat_template(CHATS[1])


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ("hello", "non-empty"),
    (["hello"], "must be a dict"),
    ([{"role": "wizard", "content": "hi"}], "role 'wizard'"),
    ([{"content": "hi"}], "role None"),
    ([{"role": "user"}], "no content"),
    ([{"role": "user", "content": 3}], "must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
])
def test_malformed_messages_raise_clear_errors(smollm2, messages, match):
    with pytest.raises(ValueError, match=match):
        smollm2[0].apply_chat_template(messages)


def test_text_content_parts_are_joined(smollm2):
    tok = smollm2[0]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a\nb"}])


def test_template_exceptions_become_value_errors(tmp_path):
    tok = Tokenizer.from_hf_folder(make_tiny_llama(tmp_path))
    tok.chat_templates = {"default": "{{ raise_exception('only one message, please') if messages|length > 1 }}"}
    with pytest.raises(ValueError, match="only one message, please"):
        tok.apply_chat_template(CHATS[2])
    tok.chat_templates = {}
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])


def test_template_sandbox_blocks_attribute_escape(smollm2):
    tok = copy.copy(smollm2[0])
    tok.chat_templates = {"default": "{{ messages.__class__.__mro__ }}"}
    with pytest.raises(ValueError, match="unsafe"):
        tok.apply_chat_template(CHATS[0])


def test_unsupported_gguf_tokenizer_model(tmp_path):
    path = str(tmp_path / "spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="only byte-level BPE"):
        Tokenizer.from_gguf(path)


def test_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(str(tmp_path))
