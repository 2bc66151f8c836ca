"""bench.core_wire: every cell round-trips its message through both codecs and times each cost."""
import json
import random

from bench.core_wire import build, main, step_values
from replicas.engine_messages import decode_core_message, encode_core_message


def test_core_wire_times_both_codecs(tmp_path):
    res = main(["--outputs", "1,8", "--tokens", "2", "--logprobs", "2", "--seconds", "0.01", "--repeats", "2",
                "--out", str(tmp_path / "w.json")])
    assert [c["outputs"] for c in res["cells"]] == [1, 8]
    for c in res["cells"]:
        assert set(c["us_median"]) == {"build", "msgpack_encode", "pickle_encode", "msgpack_load", "pickle_load"}
        assert all(len(v) == 2 and min(v) > 0 for v in c["us_each_repeat"].values())
        assert c["bytes"]["msgpack"] > 0 and c["bytes"]["pickle"] > 0
    assert json.loads((tmp_path / "w.json").read_text())["provenance"]["command"].startswith("python -m bench.core_wire")


def test_a_step_with_logprobs_round_trips_through_the_wire():
    msg = build(step_values(5, 3, 2, random.Random(1)))
    again = decode_core_message(encode_core_message(msg))
    assert again == msg and again.outputs[2].outputs[0].logprobs[1] == msg.outputs[2].outputs[0].logprobs[1]
