"""Past one process: the runner under torchrun (DistributedDataParallel over Gloo on the CPU) gives the
single-process results, writes every file once, continues after an interruption, and fails clearly."""

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc_lab import PosencError
from posenc_lab.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

# a toy run: a fixed bias (alibi) and a learned one (t5, whose gradient flows through the bias)
RUN = ["run", "--preset", "ci", "--encodings", "alibi,t5", "--steps", "6", "--batch-size", "4", "--warmup", "2",
       "--checkpoint-every", "3", "--eval-lengths", "64,128", "--eval-tokens", "512", "--stride", "32",
       "--no-progress", "--no-report"]


def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(encoding="t5", n_layer=1, n_head=2, d_model=32, train_len=64))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", **extra}


def torchrun(out, *extra, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "posenc_lab",
           *RUN, "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env())


def by_unit(out):
    return {p.name: json.loads(p.read_text()) for p in sorted((Path(out) / "units").glob("*.json"))}


@pytest.mark.slow
def test_torchrun_two_processes_give_the_single_process_results_and_continue(tmp_path):
    single = subprocess.run([sys.executable, "-m", "posenc_lab", *RUN, "--out", str(tmp_path / "one")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
    assert single.returncode == 0, single.stderr[-3000:]
    two = torchrun(tmp_path / "two")
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    one_units, two_units = by_unit(tmp_path / "one"), by_unit(tmp_path / "two")
    assert set(one_units) == set(two_units) == {"alibi-s0.json", "t5-s0.json"}
    for name, a in one_units.items():
        b = two_units[name]
        assert len(a["train_losses"]) == len(b["train_losses"]) == 6
        for x, y in zip(a["train_losses"], b["train_losses"]):
            assert x == pytest.approx(y, abs=1e-4)  # stored to 4 decimals
        for ra, rb in zip(a["rows"], b["rows"]):
            assert (ra["encoding"], ra["strategy"], ra["eval_len"], ra["eval_mode"]) == \
                   (rb["encoding"], rb["strategy"], rb["eval_len"], rb["eval_mode"])
            if not math.isnan(ra["loss"]):
                assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)
        assert "x 2 processes" in b["rows"][0]["device"]
    # one process wrote: no stray temporary files, one results table, one model per unit, no checkpoints left
    files = sorted(p.relative_to(tmp_path / "two").as_posix() for p in (tmp_path / "two").rglob("*") if p.is_file())
    assert not any(".tmp" in f for f in files), files
    assert [f for f in files if f.startswith("models/")] == ["models/alibi-s0.pt", "models/t5-s0.pt"]
    assert not any(f.startswith("checkpoints/") and f.endswith(".pt") for f in files)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "two" / "units").glob("*.json")}
    again = torchrun(tmp_path / "two")
    assert again.returncode == 0 and "done already" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing recomputed or rewritten


def launch_group(out: Path, worker_args: list[str], *, world=2, timeout=120):
    """Start ``world`` worker processes joined by a fresh TCP store; wait for all; return their results."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_worker.py"), str(out), *worker_args],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port)))
             for r in range(world)]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    results = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
               for r in range(world)]
    return procs, outputs, results


@pytest.mark.slow
def test_sharded_evaluation_equals_the_single_process_evaluation_exactly(tmp_path):
    from posenc_lab.lab.data.corpora import load_corpus
    from posenc_lab.lab.measure.perplexity import evaluate

    stream = load_corpus("stdlib").stream("test")
    procs, outputs, results = launch_group(tmp_path, ["--evaluate"])
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outputs]
    for mode in ("nonoverlapping", "sliding"):  # 48 bytes of lead-in: every sliding target has 48 before it
        alone = evaluate(tiny_model(), stream, length=64, tokens=2048, mode=mode,
                         stride=16 if mode == "sliding" else None, lead_in=48, batch_size=3)
        for result in results:
            shard = result["evaluation"][mode]
            assert shard["tokens"] == alone["tokens"] == 2048
            assert shard["loss"] == alone["loss"]  # the same sum in the same order: bit for bit
            assert shard["per_position"] == alone["per_position"]


@pytest.mark.slow
def test_a_killed_process_ends_the_others_with_a_clear_error_not_a_hang(tmp_path):
    t0 = time.perf_counter()
    procs, outputs, results = launch_group(tmp_path, ["--die-after", "3", "--", *RUN, "--out", str(tmp_path / "run"),
                                                      "--dist-timeout", "30"])
    elapsed = time.perf_counter() - t0
    assert procs[1].returncode == 9 and results[1] is None  # the killed one
    assert results[0]["rc"] == 1 and "lost the other processes" in outputs[0][1], outputs[0][1][-2000:]
    assert "Traceback" not in outputs[0][1]
    assert elapsed < 100, f"the survivor took {elapsed:.0f} s to notice"


@pytest.mark.slow
def test_a_batch_that_does_not_split_evenly_names_both_numbers(tmp_path):
    run = [a if a != "4" else "3" for a in RUN]  # --batch-size 3 over 2 processes
    procs, outputs, results = launch_group(tmp_path, ["--", *run, "--out", str(tmp_path / "run")])
    for result, (_, err) in zip(results, outputs):
        assert result["rc"] == 2
        assert "global batch size 3 is not divisible by the number of processes 2" in err


def test_one_process_needs_no_process_group():
    from posenc_lab.lab.run import distributed

    assert not distributed.active() and distributed.world_size() == 1 and distributed.is_main()
    x = torch.arange(6).reshape(3, 2)
    assert distributed.shard_rows(x)[0] is x
    assert distributed.gather_in_order([(1, "b"), (0, "a")]) == ["a", "b"]
    distributed.check_divisible(3)  # anything divides by one process
    assert not torch.distributed.is_initialized()


def test_backend_follows_the_device():
    from posenc_lab.lab.run import distributed

    assert distributed.default_backend(torch.device("cpu")) == "gloo"
    assert distributed.default_backend(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(PosencError, match="unknown process-group backend"):
        os.environ["WORLD_SIZE"] = "2"
        try:
            distributed.init(torch.device("cpu"), backend="carrier-pigeon")
        finally:
            del os.environ["WORLD_SIZE"]
