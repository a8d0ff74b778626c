"""The benchmark scripts run on the CPU at smoke size and report ratios against their own baseline (each script
trains or times models in a process of its own: the slow lane)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(script, *args, tmp_path):
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text()), p.stdout


def test_attention_benchmark_smoke(tmp_path):
    result, stdout = run("attention.py", "--lengths", "64,128", "--train-len", "64", tmp_path=tmp_path)
    rows = result["rows"]
    timed = [r for r in rows if "ms" in r]
    assert {r["encoding"] for r in timed} == {"nope", "rope", "xpos", "alibi", "t5", "kerple", "fire"}
    for r in timed:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["vs_sdpa_causal"] > 0
    baseline = [r for r in timed if r["encoding"] == "nope"]
    assert all(r["vs_sdpa_causal"] == 1.0 for r in baseline)
    assert {r["mode"] for r in timed} == {"forward", "forward+backward"}
    assert any(r.get("note") == "no FlexAttention backward on CPU" for r in rows)
    assert "vs_sdpa_causal" in stdout


def test_train_throughput_benchmark_smoke(tmp_path):
    result, stdout = run("train_throughput.py", "--encodings", "nope,rope,alibi,t5", "--rounds", "1", tmp_path=tmp_path)
    rows = {r["encoding"]: r for r in result["rows"]}
    assert set(rows) == {"nope", "rope", "alibi", "t5"} and rows["nope"]["vs_nope"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["vs_nope"] > 0 for r in rows.values())


def test_long_evaluation_benchmark_smoke(tmp_path):
    result, stdout = run("long_eval.py", "--encodings", "nope,rope,alibi,fire", tmp_path=tmp_path)
    rows = result["rows"]
    assert {r["encoding"] for r in rows} == {"nope", "rope", "alibi", "fire"}
    assert all(r["ms"] > 0 and r["first_ms"] > 0 and r["vs_nope"] > 0 for r in rows)
    assert all(r["vs_nope"] == 1.0 for r in rows if r["encoding"] == "nope")
    assert "vs_nope" in stdout


def test_generation_benchmark_smoke(tmp_path):
    result, _ = run("generate.py", "--encodings", "rope,alibi", tmp_path=tmp_path)
    assert [r["encoding"] for r in result["rows"]] == ["rope", "alibi"]
    assert all(r["tok_s_cached"] > 0 and r["tok_s_uncached"] > 0 for r in result["rows"])


def test_peer_benchmark_smoke_when_x_transformers_is_installed(tmp_path):
    pytest.importorskip("x_transformers")
    result, stdout = run("peer.py", "--encodings", "nope,alibi", tmp_path=tmp_path)
    rows = {r["encoding"]: r for r in result["rows"]}
    assert set(rows) == {"nope", "alibi"} and all(r["train_speedup"] > 0 and r["eval_speedup"] > 0 for r in rows.values())
    for r in rows.values():  # the same model on both sides: heads of d_model / heads, parameters within 2 %
        assert abs(r["params_theirs_m"] / r["params_ours_m"] - 1) < 0.02, r
        # the same arithmetic on both sides, counted both sides (x-transformers on its einsum twin)
        assert r["gflop_per_step_theirs"] == pytest.approx(r["gflop_per_step_ours"], rel=0.05), r
        assert r["train_flop_speedup"] == pytest.approx(
            r["train_speedup"] * r["gflop_per_step_ours"] / r["gflop_per_step_theirs"])


def test_levers_benchmark_smoke(tmp_path):
    result, stdout = run("levers.py", tmp_path=tmp_path)
    assert [r["way"] for r in result["rows"]][0] == "no bias, causal" and result["rows"][0]["vs_no_bias"] == 1.0
    assert len(result["rows"]) == 5 and result["mask_build_ms"] > 0


def test_step_benchmark_smoke(tmp_path):
    result, stdout = run("step.py", "--encodings", "nope,alibi", "--profile", "alibi", "--lever-encodings", "nope,t5",
                         "--levers", "fused-adamw,one-bias-block", tmp_path=tmp_path)
    limit = result["limit"]
    assert limit["limit_gflops"] > 0 and limit["square_1024_gflops"] > 0
    rows = {r["encoding"]: r for r in result["rows"]}
    assert rows["nope"]["vs_nope"] == 1.0 and rows["alibi"]["mfu"] > 0
    # the utilisation is the model's FLOPs per second over the limit measured in the same run (a smoke run's limit,
    # one measurement at tiny shapes on shared cores, can come out low, so no bound of 1 is asserted here)
    for r in rows.values():
        assert r["mfu"] == pytest.approx(r["model_gflop_per_step"] / (r["ms_per_step"] / 1e3) / limit["limit_gflops"])
    # the model's FLOPs (causal half) are below what the counter sees (the attention square in full)
    assert rows["nope"]["model_gflop_per_step"] < rows["nope"]["counted_gflop_per_step"]
    shares = result["profiles"]["alibi"]
    assert set(shares) == {"matmul", "attention", "optimiser", "other ops", "python and dispatch"}
    assert sum(shares.values()) == pytest.approx(1.0) and shares["matmul"] > 0
    # the one-block path is measured only where it differs: a learned bias
    assert {(r["lever"], r["encoding"]) for r in result["levers"]} == {("fused-adamw", "nope"), ("fused-adamw", "t5"),
                                                                        ("one-bias-block", "t5")}
    assert shares["optimiser"] > 0  # AdamW's arithmetic is found under its step
    assert all(r["speedup"] > 0 and r["loss_diff"] < 1e-3 for r in result["levers"])
    assert "matmul limit" in stdout
