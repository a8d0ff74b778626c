"""The training step against this machine's measured matmul rate: model-FLOPs utilisation, where
the time goes, and what each speed lever buys, all measured in one run.

    python benchmarks/step.py --smoke
    python benchmarks/step.py --json results/benchmarks/cpu-step.json     # the article-cpu shape

Four measurements, each against a baseline taken in the same run:

* **the limit**: float32 matrix multiplies of exactly the shapes one training step multiplies (every
  linear layer forward, its input gradient and its weight gradient; batch x length rows), timed back
  to back with the threads the run uses. Their summed FLOPs over their summed time is the rate at which
  this CPU ran the step's matrix work in isolation (``limit_gflops``: a measured rate at these shapes, not
  a hardware ceiling); a square 1024 multiply, usually faster, is printed beside it. The limit is
  measured in every round, between the encodings' steps, and the best round counts, as for the steps: a machine whose speed drifts (a shared host) cannot
  give the limit a slower moment than the steps it is compared with.
* **MFU**: each encoding's training step (forward, backward, gradient clipping, AdamW, as ``train``
  runs it), tokens/s, and model FLOPs per token ``6 N + 6 L n d`` (PaLM's accounting, the causal half
  of attention counted) over the limit. Beside it, the FLOPs ``torch.utils.flop_counter`` counts in
  the step (matrix multiplies and attention, counted under SDPA's math kernel: the attention
  square in full).
* **profile**: ``torch.profiler``'s self times of one step, grouped into matrix multiplies,
  attention (SDPA, softmax, masks), the optimiser, other operators, and the rest of the wall time
  (Python and dispatch).
* **levers**, one at a time against the default step: ``torch.compile`` of the loss (inductor's
  C++ backend; compile time reported apart), AdamW ``fused`` in place of ``foreach``, one thread in
  place of all. Each lever's loss after the same steps from the same start is compared with the
  default's. ``one-bias-block`` trains the learned biases through the whole attention square in one
  explicit softmax, against the default blocks of queries: below 1 means the blocks are faster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, median_time, print_table, write_json  # noqa: E402

from posenc_lab.backends import kernels  # noqa: E402
from posenc_lab.model import GPT, GPTConfig  # noqa: E402
from posenc_lab.lab.run.training import TrainConfig, decay_groups, flush_denormals  # noqa: E402

LEVERS = ("compile", "fused-adamw", "one-thread", "one-bias-block")


def build(name: str, args, *, fused: bool = False, compiled: bool = False, one_block: bool = False):
    """A model with encoding ``name`` and one training step on a fixed batch, as ``train`` runs it.

    ``one_block``: a learned bias trains through the whole attention square at once (the default is blocks of
    ``kernels.GRAD_BLOCK`` queries)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding=name, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                          train_len=args.seq_len))
    cfg = TrainConfig()
    decay, rest = decay_groups(model)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(cfg.beta1, cfg.beta2), fused=fused or None)
    loss_fn = torch.compile(model.loss) if compiled else model.loss
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g)

    def step() -> float:
        block = kernels.GRAD_BLOCK
        kernels.GRAD_BLOCK = 10**9 if one_block else block
        try:
            return plain_step()
        finally:
            kernels.GRAD_BLOCK = block

    def plain_step() -> float:
        with flush_denormals():
            loss = loss_fn(x[:, :-1], x[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


def matmul_shapes(args) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of every matrix multiply of one training step's linear layers (forward, input
    gradient, weight gradient), with ``m`` = batch x length rows."""
    rows, d = args.batch * args.seq_len, args.d_model
    linears = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * args.n_layer + [(d, 256)]
    shapes = []
    for k, n in linears:
        shapes += [(rows, k, n), (rows, n, k), (k, rows, n)]  # y = x W, dx = dy W^T, dW = x^T dy
    return shapes


def matmul_limit(args) -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = matmul_shapes(args)
    operands = [(torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)) for m, k, n in shapes]

    def all_of_them():
        for a, b in operands:
            torch.mm(a, b)

    flops = sum(2 * m * k * n for m, k, n in shapes)
    seconds = median_time(all_of_them, torch.device("cpu"), warmup=2, reps=args.reps)
    a, b = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    square = median_time(lambda: torch.mm(a, b), torch.device("cpu"), warmup=2, reps=args.reps)
    return {"limit_gflops": flops / seconds / 1e9, "square_1024_gflops": 2 * 1024**3 / square / 1e9,
            "step_matmul_gflop": flops / 1e9, "shapes": len(shapes)}


def counted_flops(model, args) -> float:
    """FLOPs of one forward and backward as ``torch.utils.flop_counter`` counts them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randint(0, 256, (args.batch, args.seq_len + 1))
    # the counter has no formula for SDPA's fused CPU kernel: under the math kernel, attention is matmuls it sees
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.loss(x[:, :-1], x[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def category(op: str) -> str:
    name = op.lower()
    if any(k in name for k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")):
        return "matmul"
    if any(k in name for k in ("attention", "softmax", "masked_fill", "aten::where", "aten::tril", "aten::triu")):
        return "attention"
    if any(k in name for k in ("optimizer.", "adam", "_foreach", "clip_grad", "aten::norm", "linalg_vector_norm")):
        return "optimiser"
    return "other ops"


def profile(step, reps: int = 3) -> dict:
    """Share of the wall time of ``reps`` steps in each :func:`category` (self times), the rest being
    Python and dispatch."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        wall = time.perf_counter() - t0
    shares = {"matmul": 0.0, "attention": 0.0, "optimiser": 0.0, "other ops": 0.0}
    for event in prof.events():  # operators by their own time; autograd nodes' and Python's own time is the rest
        if not event.name.startswith("aten::"):
            continue
        parent, inside_optimiser = event.cpu_parent, False
        while parent is not None and not inside_optimiser:  # AdamW's own arithmetic (sqrt, lerp_, ...) counts there
            inside_optimiser = parent.name.startswith("Optimizer.") or "clip_grad" in parent.name
            parent = parent.cpu_parent
        shares["optimiser" if inside_optimiser else category(event.name)] += event.self_cpu_time_total / 1e6
    shares = {k: v / wall for k, v in shares.items()}
    shares["python and dispatch"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def loss_after(step, n: int) -> float:
    loss = float("nan")
    for _ in range(n):
        loss = step()
    return loss


def measure(args) -> dict:
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    rows, profiles, levers = [], {}, []
    built = {name: build(name, args) for name in args.encodings}
    best = dict.fromkeys(args.encodings, float("inf"))
    limit = None
    bar = tqdm(total=args.rounds * len(built), desc="MFU", disable=args.no_progress)
    for _ in range(args.rounds):  # interleaved rounds: no encoding, and not the limit, gets the faster machine
        measured = matmul_limit(args)
        if limit is None or measured["limit_gflops"] > limit["limit_gflops"]:
            limit = measured
        for name, (_, step) in built.items():
            best[name] = min(best[name], median_time(step, cpu, warmup=args.warmup, reps=args.reps))
            bar.update()
    bar.close()
    for name in tqdm(args.encodings, desc="FLOPs and profile", disable=args.no_progress):
        model, step = built[name]
        seconds = best[name]
        tokens_per_s = args.batch * args.seq_len / seconds
        model_flops = model.flops_per_token(args.seq_len) * args.batch * args.seq_len
        rows.append({"encoding": name, "ms_per_step": seconds * 1e3, "tokens_per_s": tokens_per_s,
                     "model_gflop_per_step": model_flops / 1e9,
                     "counted_gflop_per_step": counted_flops(model, args) / 1e9,
                     "mfu": model_flops / seconds / (limit["limit_gflops"] * 1e9)})
        if name in args.profile:
            profiles[name] = profile(step)
    nope = next((r["tokens_per_s"] for r in rows if r["encoding"] == "nope"), None)
    for r in rows:
        r["vs_nope"] = r["tokens_per_s"] / nope if nope else None
    for name in tqdm(args.lever_encodings, desc="levers", disable=args.no_progress):
        _, base = build(name, args)
        base_loss = loss_after(build(name, args)[1], args.check_steps)
        model = build(name, args)[0]
        learned_bias = model.encoding.has_bias and any(p.requires_grad for p in model.encoding.parameters())
        for lever in args.levers:
            if lever == "one-bias-block" and not learned_bias:
                continue  # the same path either way
            if lever == "one-thread":
                torch.set_num_threads(1)
                _, fast = build(name, args)
                compile_s = None
            else:
                t0 = time.perf_counter()
                _, fast = build(name, args, fused=lever == "fused-adamw", compiled=lever == "compile",
                                one_block=lever == "one-bias-block")
                fast()  # the first call compiles
                compile_s = time.perf_counter() - t0 if lever == "compile" else None
            lever_s, base_s = float("inf"), float("inf")
            for _ in range(args.rounds):  # interleaved: neither side gets the warmer machine
                lever_s = min(lever_s, median_time(fast, cpu, warmup=1, reps=args.reps))
                torch.set_num_threads(threads)
                base_s = min(base_s, median_time(base, cpu, warmup=1, reps=args.reps))
                if lever == "one-thread":
                    torch.set_num_threads(1)
            torch.set_num_threads(1 if lever == "one-thread" else threads)
            _, fresh = build(name, args, fused=lever == "fused-adamw", compiled=lever == "compile",
                             one_block=lever == "one-bias-block")
            lever_loss = loss_after(fresh, args.check_steps)
            torch.set_num_threads(threads)
            levers.append({"encoding": name, "lever": lever, "speedup": base_s / lever_s,
                           "compile_s": compile_s, "loss_default": base_loss, "loss_lever": lever_loss,
                           "loss_diff": abs(lever_loss - base_loss)})
    return {"limit": limit, "rows": rows, "profiles": profiles, "levers": levers}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small sizes (CI)")
    p.add_argument("--encodings", type=lambda s: s.split(","),
                   default=["nope", "sinusoidal", "learned", "rope", "xpos", "alibi", "t5", "kerple", "fire"])
    p.add_argument("--profile", type=lambda s: s.split(","), default=["nope", "rope", "alibi", "t5"],
                   help="encodings whose step is profiled")
    p.add_argument("--lever-encodings", type=lambda s: s.split(","), default=["nope", "rope", "alibi", "t5"])
    p.add_argument("--levers", type=lambda s: s.split(","), default=list(LEVERS))
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="article-cpu's batch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats; the best median counts")
    p.add_argument("--check-steps", type=int, default=5, help="steps after which a lever's loss is compared")
    p.add_argument("--json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    unknown = set(args.levers) - set(LEVERS)
    if unknown:
        p.error(f"unknown lever {', '.join(sorted(unknown))}; choose from {', '.join(LEVERS)}")
    if args.smoke:
        args.n_layer, args.d_model, args.seq_len, args.batch = 2, 64, 64, 2
        args.reps, args.rounds, args.check_steps = 2, 1, 2
    result = measure(args) | {"environment": environment(torch.device("cpu")), "args": vars(args),
                              "command": list(sys.argv[1:] if argv is None else argv)}
    limit = result["limit"]
    print(result["environment"])
    print(f"matmul limit at the step's shapes: {limit['limit_gflops']:.1f} GFLOP/s "
          f"(square 1024: {limit['square_1024_gflops']:.1f} GFLOP/s)")
    print_table(result["rows"], ["encoding", "ms_per_step", "tokens_per_s", "mfu", "vs_nope"])
    for name, shares in result["profiles"].items():
        print(f"{name:10s} " + "  ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    print_table(result["levers"], ["encoding", "lever", "speedup", "compile_s", "loss_diff"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
