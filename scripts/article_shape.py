"""The two checks around the article-shape run on a lent GPU (scripts/device_article_shape.sh calls both).

    python scripts/article_shape.py probe --deadline 500 --json out/probe.json [run options]
    python scripts/article_shape.py precision runs/article-shape --corpus stdlib:PATH@3.11.7 --json out/precision.json

``probe`` (about 30 seconds) measures the card before anything is trained: its matrix-multiply rate
(bf16 on CUDA, float32 on the CPU), and a few eager training steps of the run's model with its cheapest
and its dearest encoding (NoPE and T5), with the memory each step holds. From them it predicts the
run's training time twice: optimistically at 30 % of the measured multiply rate (the model FLOPs
utilisation the compiled path aims at), and pessimistically as every unit trained one after another at
the eager rate. It exits with status 3 and one sentence when even the optimistic time does not fit the
deadline, so that a slow card costs 30 seconds and not the whole call. The run options (``--preset``,
``--encodings``, ``--seeds``, ``--steps``, ``--batch-size``) are those the run gets.

``precision`` evaluates seed 0 of ALiBi and T5 of a finished run at its longest evaluation length, once
as the run did (bf16 autocast on CUDA) and once in float32, and reports the relative difference of
their perplexities (on the CPU both are float32, and the difference is 0).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import matmul_tflops, sync  # noqa: E402
from posenc_lab.lab.experiments.families import spec_of  # noqa: E402
from posenc_lab.lab.data.corpora import evaluation_text, load_corpus  # noqa: E402
from posenc_lab.lab.measure.perplexity import evaluate  # noqa: E402
from posenc_lab.model import GPT  # noqa: E402
from posenc_lab.lab.experiments.language_model import preset, units_of  # noqa: E402
from posenc_lab.lab.run.training import TrainConfig, autocast, make_optimizer  # noqa: E402

#: the model FLOPs utilisation the optimistic prediction assumes (the compiled path's aim on an H100)
AIMED_MFU = 0.30


def eager_steps(spec, encoding: str, device: torch.device, steps: int = 6) -> dict:
    """Seconds per eager training step of ``spec``'s model with ``encoding`` at its batch size and length (the
    median of ``steps`` after two warm-up steps), and the most memory a step held (GiB; None on the CPU)."""
    torch.manual_seed(0)
    model = GPT(spec.model.config(encoding)).to(device)
    opt = make_optimizer(model, TrainConfig())
    length, batch = spec.model.train_len, spec.training.batch_size
    x = torch.randint(0, 256, (batch, length + 1), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        with autocast(device):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"seconds_per_step": sorted(times)[len(times) // 2], "peak_gib": peak,
            "flops_per_token": model.flops_per_token(length)}


def probe(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    overrides = {"steps": args.steps, "batch_size": args.batch_size}
    spec = preset(args.preset, **overrides)
    units = [u for u in units_of(spec) if (args.encodings is None or u[0] in args.encodings)
             and (args.seeds is None or u[1] in args.seeds)]
    rate = matmul_tflops(device)
    measured = {name: eager_steps(spec, name, device) for name in ("nope", "t5")}
    tokens = spec.training.steps * spec.training.batch_size * spec.model.train_len
    flops = sum(tokens * measured["t5" if e == "t5" else "nope"]["flops_per_token"] for e, _ in units)
    optimistic = flops / (AIMED_MFU * rate * 1e12)
    pessimistic = sum(spec.training.steps * measured["t5" if e == "t5" else "nope"]["seconds_per_step"]
                      for e, _ in units)
    eager_mfu = tokens / spec.training.steps * measured["nope"]["flops_per_token"] / (
        measured["nope"]["seconds_per_step"] * rate * 1e12)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "matmul_tflops": float(f"{rate:.3g}"), "units": len(units), "train_tokens_per_unit": tokens,
              "train_pflop": round(flops / 1e15, 3), "eager": measured, "eager_mfu_nope": round(eager_mfu, 3),
              "predicted_seconds": {"optimistic": round(optimistic, 1), "pessimistic": round(pessimistic, 1)},
              "deadline_seconds": args.deadline, "overhead_seconds": args.overhead}
    fits = optimistic + args.overhead <= args.deadline
    report["go"] = fits
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"probe on {report['device']}: matmul {rate:.1f} TFLOP/s; eager step NoPE "
          f"{measured['nope']['seconds_per_step'] * 1e3:.1f} ms, T5 {measured['t5']['seconds_per_step'] * 1e3:.1f} ms "
          f"(eager MFU {eager_mfu:.1%}); {len(units)} units, {flops / 1e15:.2f} PFLOP of training: "
          f"{optimistic:.0f} s at {AIMED_MFU:.0%} MFU, {pessimistic:.0f} s eager one after another")
    if not fits:
        print(f"stopped: even at {AIMED_MFU:.0%} MFU the training takes {optimistic:.0f} s, and with "
              f"{args.overhead:.0f} s for compiling and evaluation it passes the deadline of {args.deadline:.0f} s: "
              "this card is too slow for the preset's byte budget")
        return 3
    if pessimistic + args.overhead > args.deadline:
        print("the eager bound passes the deadline: the run relies on the compiled path; units are packed as they "
              "finish, so a run cut at the deadline keeps every finished unit (seed 0 of every encoding first)")
    return 0


def precision(args) -> int:
    run = Path(args.run)
    config = json.loads((run / "config.json").read_text())
    spec = spec_of(config)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ev = spec.evaluation
    length = max(ev.eval_lengths)
    text = evaluation_text(load_corpus(args.corpus), ev.eval_tokens, lead_in=ev.lead_in())
    tokens = min(ev.eval_tokens // length, args.windows) * length
    report = {"length": length, "scored_bytes": tokens, "device": str(device), "encodings": {}}
    for encoding in args.encodings:
        weights = run / "models" / f"{encoding}-s0.pt"
        if not weights.exists():
            print(f"{encoding}: no seed-0 weights in {run / 'models'}; skipped")
            continue
        model = GPT(spec.model.config(encoding))
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        got = {}
        for name, full in (("as run", False), ("float32", True)):
            got[name] = evaluate(model, text.stream, length=length, tokens=tokens, lead_in=text.lead_in,
                                 batch_size=ev.eval_batch_size, device=device, full_precision=full)["loss"]
        relative = math.exp(got["as run"] - got["float32"]) - 1
        report["encodings"][encoding] = {"ppl_as_run": math.exp(got["as run"]), "ppl_float32": math.exp(got["float32"]),
                                         "relative_difference": relative, "within_0.1%": abs(relative) <= 1e-3}
        print(f"{encoding} seed 0 at {length}: perplexity {math.exp(got['as run']):.4f} as run, "
              f"{math.exp(got['float32']):.4f} in float32 ({relative:+.2e}; within 0.1 %: {abs(relative) <= 1e-3})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe", help="measure the card and predict the run's time; exit 3 if it cannot fit")
    pr.add_argument("--preset", default="article-shape")
    pr.add_argument("--encodings", type=lambda s: s.split(","))
    pr.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")])
    pr.add_argument("--steps", type=int)
    pr.add_argument("--batch-size", type=int)
    pr.add_argument("--deadline", type=float, default=500.0, help="seconds the run may take")
    pr.add_argument("--overhead", type=float, default=150.0, help="seconds for compiling and evaluation")
    pr.add_argument("--device")
    pr.add_argument("--json")
    pc = sub.add_parser("precision", help="bf16 against float32 evaluation of seed 0 at the longest length")
    pc.add_argument("run")
    pc.add_argument("--corpus", default="stdlib")
    pc.add_argument("--encodings", type=lambda s: s.split(","), default=["alibi", "t5"])
    pc.add_argument("--windows", type=int, default=8, help="windows of the longest length scored")
    pc.add_argument("--device")
    pc.add_argument("--json")
    args, _ = p.parse_known_args(argv)
    return probe(args) if args.command == "probe" else precision(args)


if __name__ == "__main__":
    sys.exit(main())
