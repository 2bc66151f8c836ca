"""Elastic KV on CUDA with real VMM: 10,000 lend/reclaim cycles under a live mixed load (CUDA graphs, prefix
caching) with greedy outputs equal to the non-elastic engine; a burst of maximum-size prompts while the
reserve is lent and in use completes, while the static-commit baseline runs out of memory on that burst.

The burst runs in subprocesses (`python -m tests.gpu.test_elastic_gpu burst MODE`), each with the GPU to
itself less a ballast tensor (8 GiB left to the engine, 128 MiB of slack beyond the activation headroom),
so that the KV pool really fills the memory it is given."""
import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from replicas import SamplingParams, envs
from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.model_runner import ModelRunner
from tests.support import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CYCLES = envs.elastic_cycles()
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
             "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "tie_word_embeddings": True, "eos_token_id": 151645}


def collect(engine, done: dict) -> None:
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out.outputs[0].token_ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.support.checkpoints import make_tiny_llama

    folder = make_tiny_llama(str(tmp_path_factory.mktemp("elastic-gpu")), hidden_size=128, num_attention_heads=4,
                             num_key_value_heads=4)
    return folder


def test_ten_thousand_cycles_under_live_load(tiny):
    """Base 256 blocks + one 2 MiB reserve handle per layer (128 blocks of 16 KiB): the running set spills
    into the reserve, so reclaims migrate and preempt; every step with a prompt reclaims first."""
    cfg = EngineConfig.from_flat(model=tiny, dtype="float32", block_size=16, num_kv_blocks=256 + 128,
                                 reserve_blocks=128, max_num_seqs=32, max_model_len=512, max_num_batched_tokens=1024,
                                 enable_prefix_caching=True, elastic="elastic", elastic_lend_step_tokens=40,
                                 elastic_lend_after_steps=1, elastic_min_lend_steps=0)
    engine = LLMEngine(cfg)
    elastic = engine.elastic
    assert engine.runner.graphs is not None, "the stress must run through CUDA graphs"
    addresses = [c.data_ptr() for c in engine.runner.kv_caches]
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    systems = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(8)]
    requests, done, n = {}, {}, 0
    while elastic.reclaim_total < CYCLES:
        if engine.block_manager.reserve_lent and not engine.scheduler.waiting:
            prompt = rng.choice(systems) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 120))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 120), ignore_eos=True)
            requests[f"r{n}"] = (prompt, params)
            engine.add_request(f"r{n}", prompt, params)
            n += 1
        collect(engine, done)
        assert engine.stats.num_steps < 30 * CYCLES, "the load stopped cycling"
    while engine.has_unfinished:
        collect(engine, done)
    torch.cuda.synchronize()
    assert [c.data_ptr() for c in engine.runner.kv_caches] == addresses
    assert elastic.blocks_migrated > 0 and elastic.preemptions > 0 and engine.block_manager.hits > 0
    assert_same_as_plain(cfg, tiny, requests, done)


def assert_same_as_plain(cfg, tiny, requests: dict, done: dict) -> None:
    """Greedy tokens equal a plain engine's with room for everything (near-ties aside)."""
    transformers = pytest.importorskip("transformers")
    from tests.support.greedy import compare_greedy

    ref = LLMEngine(cfg.with_(num_kv_blocks=8192, max_num_seqs=256, elastic="off", reserve_blocks=0))
    want = {}
    for rid, (prompt, params) in requests.items():
        ref.add_request(rid, prompt, params)
    while ref.has_unfinished:
        collect(ref, want)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    @torch.no_grad()
    def last_logits(ids):
        return hf(torch.tensor([ids])).logits[0, -1]
    ids = sorted(requests)
    flips = compare_greedy([requests[r][0] for r in ids], [done[r] for r in ids], [want[r] for r in ids],
                           last_logits)
    assert len(flips) <= len(ids) // 200, flips


def test_budget_changes_grant_and_take_back_the_reserve_under_live_load(tiny):
    """The chunk knob at run time on VMM: at a 32-token budget the whole reserve handle (one granule per range)
    is mapped for good as KV, at 1024 it is given back with its live K/V moved below it or the newest sequences
    preempted; through CUDA graphs, with greedy outputs equal to a plain engine's."""
    cfg = EngineConfig.from_flat(model=tiny, dtype="float32", block_size=16, num_kv_blocks=256 + 128,
                                 reserve_blocks=128, max_num_seqs=32, max_model_len=512, max_num_batched_tokens=1024,
                                 enable_prefix_caching=True, elastic="elastic", elastic_lend_step_tokens=40,
                                 elastic_lend_after_steps=1, elastic_min_lend_steps=0)
    engine = LLMEngine(cfg)
    kv, bm = engine.runner.kv, engine.block_manager
    assert engine.runner.graphs is not None
    addresses = [c.data_ptr() for c in engine.runner.kv_caches]
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    requests, done, grants = {}, {}, 0
    for step in range(1600):
        if step % 40 == 0:
            engine.reconfigure(max_num_batched_tokens=32 if step % 80 == 0 else 1024)
            grants += bm.num_base == 256 + 128 and bm.num_reserve == 0
            assert bm.num_base == kv.num_base and sum(kv.grants) == sum(engine.elastic.grants)
        if step % 3 == 0 and step < 1400:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 150))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 100), ignore_eos=True)
            requests[f"r{step}"] = (prompt, params)
            engine.add_request(f"r{step}", prompt, params)
        collect(engine, done)
    while engine.has_unfinished:
        collect(engine, done)
    torch.cuda.synchronize()
    assert [c.data_ptr() for c in engine.runner.kv_caches] == addresses
    assert grants == 20, "a 32-token budget did not make the whole reserve base KV"
    assert engine.elastic.blocks_migrated > 0
    assert_same_as_plain(cfg, tiny, requests, done)


def run_burst(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "tests.gpu.test_elastic_gpu", "burst", mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def parse(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_burst_while_lent_completes_and_static_commit_runs_out_of_memory():
    elastic = parse(run_burst("elastic"))
    assert elastic["phase"] == "done" and not elastic["oom"], elastic
    assert elastic["reserve_used_before_burst"] > 0 and elastic["lent_before_burst"]
    assert elastic["reclaims"] >= 1 and elastic["burst_finished"] == elastic["burst"]
    assert elastic["first_prefill_reserved_bytes"] <= elastic["headroom_bytes"] + elastic["slack_bytes"], elastic
    static = parse(run_burst("static"))
    assert static["oom"] and static["phase"] == "burst", static


def burst_main(mode: str) -> None:
    """Fill base and part of the reserve with prompts small enough to run lent, then send maximum-size
    prompts. Prints one RESULT line of JSON."""
    import tempfile

    from memory.reserve import measure_step_memory

    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(QWEN3_06B, f)
    budget, lend_tokens, slack = 32768, 4096, 128 << 20
    init_kv = ModelRunner.init_kv

    def init_kv_beside_ballast(runner):      # the weights are loaded: leave the engine 8 GiB for the rest
        free, _ = torch.cuda.mem_get_info()
        runner.ballast = torch.empty(max(0, free - (8 << 30)), dtype=torch.uint8, device="cuda")
        init_kv(runner)
    ModelRunner.init_kv = init_kv_beside_ballast
    _, total = torch.cuda.mem_get_info()
    engine = LLMEngine(EngineConfig.from_flat(model=folder, load_format="dummy", max_num_seqs=32,
                                              max_num_batched_tokens=budget, max_model_len=budget, block_size=16,
                                              gpu_memory_utilization=1 - slack / total, elastic=mode,
                                              elastic_lend_step_tokens=lend_tokens, elastic_lend_after_steps=1,
                                              elastic_min_lend_steps=0))
    elastic, rank, bm = engine.elastic, engine.runner.kv, engine.block_manager
    result = {"mode": mode, "oom": False, "phase": "fill", "slack_bytes": slack, "base_blocks": bm.num_base,
              "reserve_blocks": bm.num_reserve, "reserve_bytes": rank.reserve_bytes,
              "headroom_bytes": rank.sizing.headroom_bytes, "sizing": rank.sizing.to_dict()}
    if mode == "elastic":       # the first real full prefill with the reserve returned: the margin it needs
        first = measure_step_memory(engine.runner, budget, engine.config.scheduling.max_num_seqs)
        result["first_prefill_reserved_bytes"] = first.reserved_peak
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, detokenize=False)
    done: dict = {}
    last_report = [time.monotonic()]

    def step() -> None:
        """One engine step; a request the engine ended is an out-of-memory result (the engine catches a step's
        OOM and ends that step's requests), anything else a failure of the test's set-up."""
        collect(engine, done)
        for rid, error in engine.take_failed():
            if "out of" not in str(error) or "memory" not in str(error):
                raise AssertionError(f"{rid} failed: {error!r}")
            raise torch.OutOfMemoryError(f"{rid}: {error}")
        if time.monotonic() - last_report[0] > 5:     # where a slow run is, on stderr (the test shows its tail)
            last_report[0] = time.monotonic()
            print(f"{result['phase']}: steps {engine.stats.num_steps}, running {len(engine.scheduler.running)}, "
                  f"waiting {len(engine.scheduler.waiting)}, lent {bm.reserve_lent}, reserve in use "
                  f"{len(bm.reserve_blocks_in_use())}/{bm.num_reserve}, lends {elastic.lend_total}, "
                  f"refused {elastic.lend_refused}, reclaims {elastic.reclaim_total}", file=sys.stderr, flush=True)

    try:
        i = 0
        for _ in range(20000):            # engine steps and idle iterations (an idle step counts no step)
            if len(bm.reserve_blocks_in_use()) >= bm.num_reserve // 2 or len(engine.scheduler.running) >= 30:
                break
            if not engine.scheduler.waiting and bm.reserve_lent:
                engine.add_request(f"fill{i}", [rng.randrange(3, 150000) for _ in range(3500)], params)
                i += 1
            step()
        else:
            raise AssertionError(f"the fill never used half the reserve: {elastic.lend_total} lends "
                                 f"({elastic.lend_refused} refused), {engine.stats.num_steps} steps")
        result.update(phase="burst", lent_before_burst=bm.reserve_lent,
                      reserve_used_before_burst=len(bm.reserve_blocks_in_use()))
        burst = [f"burst{j}" for j in range(4)]
        for rid in burst:
            engine.add_request(rid, [rng.randrange(3, 150000) for _ in range(budget - 8)],
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
        while engine.has_unfinished:
            step()
        torch.cuda.synchronize()
        result.update(phase="done", burst=len(burst), burst_finished=sum(r in done for r in burst))
    except RuntimeError as e:                    # torch.OutOfMemoryError, or a library's failed allocation
        text = str(e)
        if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in text.lower() \
                and "ALLOC_FAILED" not in text:
            raise
        result.update(oom=True, error=text.splitlines()[0][:300])
    result.update(reclaims=elastic.reclaim_total, lends=elastic.lend_total, migrated=elastic.blocks_migrated,
                  preempted=elastic.preemptions)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "burst":
        burst_main(sys.argv[2])
    else:
        sys.exit("usage: python -m tests.gpu.test_elastic_gpu burst elastic|static")
