"""H200 probe (session 12): where one request's TTFT goes in-process. SmolLM2 (TIDAL_DEFAULT_MODEL), one
128-token random prompt at a time: wall ms of each of the first 4 steps (device synchronised), then the
prefill step under cProfile (Python time, Triton launches included) and torch.profiler (top ops)."""
import cProfile
import pstats
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.sampling_params import SamplingParams

engine = LLMEngine(EngineConfig(device="cuda", elastic="off"))
rng = random.Random(0)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def one(i):
    engine.add_request(f"p{i}", [rng.randrange(100, 40000) for _ in range(128)], params)
    times = []
    while engine.has_unfinished:
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


for i in range(5):
    one(i)
for i in range(5, 10):
    print("step ms:", " ".join(f"{t:.2f}" for t in one(i)[:4]))
for i in range(3):
    engine.add_request(f"cprof{i}", [rng.randrange(100, 40000) for _ in range(128)], params)
    prof_py = cProfile.Profile()
    prof_py.enable()
    engine.step()
    torch.cuda.synchronize()
    prof_py.disable()
    while engine.has_unfinished:
        engine.step()
pstats.Stats(prof_py).sort_stats("cumulative").print_stats(30)
pstats.Stats(prof_py).sort_stats("tottime").print_stats(20)
engine.add_request("prof", [rng.randrange(100, 40000) for _ in range(128)], params)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    engine.step()
    torch.cuda.synchronize()
while engine.has_unfinished:
    engine.step()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
