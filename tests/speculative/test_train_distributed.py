"""Drafter training through Ray Train on CPU (gloo): a run stopped at step 10 and resumed from its checkpoint
gives the per-step losses of an uninterrupted run; checkpoints are split into shards within the limit and
written atomically; the JSONL log has the per-step fields."""
import json
import os
import random
import time
from dataclasses import replace

import pytest
import torch

from speculative.train_checkpoint import (find_checkpoint, list_checkpoints, optimizer_state_dict, optimizer_tensors,
                                          read_checkpoint, read_manifest, write_checkpoint)
from speculative.train_data import write_pairs
from tests.support.threads import one_thread  # noqa: F401  (autouse)

SHARD_BYTES = 96 * 1024
LOG_FIELDS = {"step", "loss", "final_loss", "base_loss", "accuracy", "accept_len", "lr", "lambda_base", "step_ms",
              "query_tokens_per_s", "seq_tokens_per_s", "tokens_seen", "mfu", "peak_memory_gib"}


@pytest.mark.timeout(20)
def test_checkpoint_shards_split_large_tensors_and_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(300, 100, generator=g), "small": torch.randn(7, generator=g),
               "bf16": torch.randn(50, 50, generator=g).to(torch.bfloat16), "scalar": torch.tensor(3.0),
               "bytes": torch.arange(200, dtype=torch.uint8)}
    os.makedirs(tmp_path / "checkpoints" / ".step-00000001.tmp-999")          # left by a writer that died
    folder = write_checkpoint(str(tmp_path / "checkpoints"), 1, tensors, {"note": "x"}, shard_bytes=32 * 1024)
    back, manifest = read_checkpoint(folder)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    assert len(manifest["tensors"]["big"]["parts"]) == 4 and manifest["meta"] == {"note": "x"}
    assert all(os.path.getsize(os.path.join(folder, f)) <= 32 * 1024 for f in manifest["files"])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000001"]
    write_checkpoint(str(tmp_path / "checkpoints"), 2, tensors, {}, keep=1)
    assert [os.path.basename(c) for c in list_checkpoints(str(tmp_path / "checkpoints"))] == ["step-00000002"]
    assert find_checkpoint(str(tmp_path)) == find_checkpoint(str(tmp_path / "checkpoints" / "step-00000002"))

    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95))
    p.grad = torch.ones_like(p)
    opt.step()
    flat, meta = optimizer_tensors(opt.state_dict())
    restored = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    restored.load_state_dict(optimizer_state_dict(flat, json.loads(json.dumps(meta))))
    assert restored.param_groups[0]["betas"] == (0.9, 0.95)
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from tests.support.checkpoints import make_tiny_llama
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_llama(root / "target")
    rng = random.Random(0)
    pairs = [([rng.randrange(5, 300) for _ in range(rng.randint(4, 10))],
              [rng.randrange(5, 300) for _ in range(rng.randint(12, 30))]) for _ in range(40)]
    write_pairs(str(root / "pairs.jsonl"), pairs)
    return root, target


def train_args(root, target, out, *extra):
    return ["--target", str(target), "--pairs", str(root / "pairs.jsonl"), "--out", str(root / out),
            "--layers", "1", "--block-size", "4", "--workers", "2", "--device", "cpu", "--steps", "20",
            "--batch-size", "2", "--seq-len", "32", "--anchors-per-seq", "4", "--lr", "3e-3", "--warmup-steps", "3",
            "--curriculum-steps", "10", "--checkpoint-shard-bytes", str(SHARD_BYTES), *extra]


def log_records(folder):
    with open(folder / "train_log.jsonl") as f:
        return [json.loads(line) for line in f]


def assert_same_losses(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["tokens_seen"] for r in a] == [r["tokens_seen"] for r in b]     # carried through the checkpoint
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-5), x["step"]
        assert x["accuracy"] == pytest.approx(y["accuracy"], abs=1e-4), x["step"]


@pytest.mark.timeout(90)
def test_a_run_stopped_at_step_10_resumes_to_the_uninterrupted_losses(tiny_setup):
    """One worker in this process (--launcher local, and the function every Ray worker runs): stop flag, time
    budget, resume."""
    from speculative.train import TrainConfig, main
    from speculative.train_distributed import TrainJob, train_worker
    root, target = tiny_setup
    cfg = TrainConfig(steps=20, batch_size=2, seq_len=32, anchors_per_seq=4, lr=3e-3, warmup_steps=3,
                      curriculum_steps=10, checkpoint_every=1000, checkpoint_shard_bytes=SHARD_BYTES)
    cpu = torch.device("cpu")

    def job(out, resume=None, deadline=None, **changes):
        return TrainJob(pairs=str(root / "pairs.jsonl"), out=str(root / out), cfg=replace(cfg, **changes),
                        target=target, layers=1, block_size=4, resume=resume, deadline=deadline)
    whole = train_worker(job("local-whole"), 0, 1, cpu)
    assert whole.finished and os.path.exists(root / "local-whole" / "drafter" / "config.json")
    assert whole.features is not None and whole.features.total > 0
    online = train_worker(job("local-online", target_features="online"), 0, 1, cpu)
    assert online.features is None
    assert_same_losses(log_records(root / "local-online"), log_records(root / "local-whole"))
    main(train_args(root, target, "local-first", "--launcher", "local", "--workers", "1", "--stop-at-step", "10",
                    "--checkpoint-every", "1000"))
    assert not os.path.exists(root / "local-first" / "drafter")
    assert read_manifest(find_checkpoint(str(root / "local-first")))["step"] == 10
    assert json.load(open(root / "local-first" / "run.json"))["result"]["step"] == 10
    train_worker(job("local-first"), 0, 1, cpu)                           # the same --out continues
    assert_same_losses(log_records(root / "local-first"), log_records(root / "local-whole"))
    late = train_worker(job("local-late", resume=str(root / "local-first" / "checkpoints" / "step-00000020"),
                            deadline=time.time()), 0, 1, cpu)
    assert late.step == 20 and late.finished                             # nothing left to do
    hurried = train_worker(job("local-hurried", deadline=time.time()), 0, 1, cpu)
    assert hurried.stopped_early and hurried.step == 1                   # out of time: one step, checkpointed
    assert find_checkpoint(str(root / "local-hurried")).endswith("step-00000001")


@pytest.mark.timeout(90)
def test_a_warm_restart_starts_from_a_finished_drafter_and_carries_its_tokens_on(tiny_setup):
    """--init-drafter: a fresh run starts from a finished run's drafter/ (its train_log.jsonl is copied there),
    so its first loss is the trained one's, not a random drafter's, and tokens_seen continues from it; a drafter
    of another shape is refused."""
    from speculative.train import main
    root, target = tiny_setup
    main(train_args(root, target, "warm-first", "--launcher", "local", "--workers", "1"))
    first = log_records(root / "warm-first")
    drafter = root / "warm-first" / "drafter"
    assert log_records(drafter) == first                                  # the log travels with the weights
    main(train_args(root, target, "warm-second", "--launcher", "local", "--workers", "1", "--steps", "5",
                    "--init-drafter", str(drafter)))
    main(train_args(root, target, "cold-second", "--launcher", "local", "--workers", "1", "--steps", "5"))
    second, cold = log_records(root / "warm-second"), log_records(root / "cold-second")
    assert [r["tokens_seen"] for r in second] == [first[-1]["tokens_seen"] + r["tokens_seen"] for r in cold]
    assert second[0]["loss"] < cold[0]["loss"] - 0.5
    assert json.load(open(root / "warm-second" / "run.json"))["init_drafter"] == str(drafter)
    with pytest.raises(ValueError, match="another shape"):
        main(train_args(root, target, "warm-wrong", "--launcher", "local", "--workers", "1", "--steps", "2",
                        "--init-drafter", str(drafter), "--block-size", "8"))


def test_cached_features_equal_the_targets_hidden_states_of_each_batch(tiny_setup):
    """FeatureCache: the target run once over the pairs (grouped by length, a few per pass) gives, for any batch,
    the rows the online step computes from the batch itself, and zeros at the padding columns."""
    from speculative.train_data import PairBatcher, read_pairs
    from speculative.train_features import FeatureCache
    from speculative.train_loop import load_hf_target
    root, target_path = tiny_setup
    target, _ = load_hf_target(str(target_path), (0, 1), torch.device("cpu"), torch.float32)
    pairs = read_pairs(str(root / "pairs.jsonl"), 0, 1)
    cache = FeatureCache(target.hidden, pairs, 32, torch.device("cpu"), tokens_per_pass=100)
    assert cache.total == sum(min(len(p) + len(r), 32) for p, r in pairs) and cache.on_device
    batcher = PairBatcher(pairs, 5, 32, 4, seed=1)
    for _ in range(3):
        batch = batcher.next()
        got, want = cache.gather(batch), target.hidden(batch.input_ids)
        lengths = [min(len(pairs[i][0]) + len(pairs[i][1]), 32) for i in batch.pair_ids]
        for row, n in enumerate(lengths):
            assert torch.allclose(got[row, :n], want[row, :n], atol=1e-5)
            assert not got[row, n:].any()


@pytest.mark.timeout(480)
def test_two_gloo_workers_resume_from_a_checkpoint_to_the_same_losses(ray_cluster, tiny_setup):
    """Ray Train with 2 CPU workers (DDP over gloo), through the CLI entry point: a 20-step run, and a run
    resumed from its step-10 checkpoint in a fresh output folder (a checkpoint brought back from elsewhere); the
    held-out metrics, a collective like the others, are in every record."""
    from speculative.train import main
    root, target = tiny_setup
    assert main(train_args(root, target, "whole", "--checkpoint-every", "10", "--keep-checkpoints", "2",
                           "--heldout-pairs", str(root / "pairs.jsonl"), "--heldout-batches", "1")) == 0
    mid = str(root / "whole" / "checkpoints" / "step-00000010")
    manifest = read_manifest(mid)
    assert manifest["step"] == 10 and manifest["meta"]["world_size"] == 2 and len(manifest["files"]) > 2
    assert len(manifest["meta"]["batchers"]) == 2 and "rng.torch.1" in manifest["tensors"]
    assert all(os.path.getsize(os.path.join(mid, f)) <= SHARD_BYTES for f in manifest["files"])
    assert any(len(entry["parts"]) > 1 for entry in manifest["tensors"].values())   # a tensor cut in pieces
    assert main(train_args(root, target, "resumed", "--resume", mid)) == 0

    whole, resumed = log_records(root / "whole"), log_records(root / "resumed")
    assert [r["step"] for r in whole] == list(range(1, 21))
    assert all(LOG_FIELDS | {"heldout_accept_len", "heldout_accuracy"} <= set(r) for r in whole)
    assert all(r["seq_tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 and r["mfu"] is None for r in whole)
    seen = [r["tokens_seen"] for r in whole]
    assert seen == sorted(seen) and seen[0] > 0 and len(set(seen)) == len(seen)
    assert_same_losses(resumed, whole)                    # steps 1-10 came with the checkpoint's log
    assert whole[-1]["loss"] < whole[0]["loss"]
    run = json.load(open(root / "resumed" / "run.json"))
    assert run["result"]["finished"] and run["workers"] == 2 and run["target_features"].startswith("cached")
    assert run["mfu_note"] and os.path.exists(root / "resumed" / "drafter" / "config.json")
