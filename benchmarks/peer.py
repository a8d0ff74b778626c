"""posenc_lab beside x-transformers on the same model, in one run: training tokens/s and long evaluation.

    pip install 'posenc-lab[peer]'   # x-transformers: a benchmark dependency only, never a runtime one
    python benchmarks/peer.py --smoke
    python benchmarks/peer.py --json results/benchmarks/cpu-peer.json

Both libraries build the same decoder (layers, width, heads *and head width* ``d_model / heads``
-- x-transformers' own default is 64-dimensional heads, twice ours at the article's shape --,
pre-norm, GELU MLP of 4x, tied embeddings, vocabulary 256) with each encoding that both offer, and run the same two measurements
interleaved, library by library, encoding by encoding: one AdamW training step on a fixed batch
(``tokens_per_s``) and the scoring of one window of ``--eval-len`` without gradients
(``eval_ms``). Both run under the same settings (fp32, denormals flushed as ``posenc_lab``'s
training and evaluation do; x-transformers with its SDPA path, ``attn_flash=True``). The speedups
are ours over theirs: above 1 means posenc_lab is faster. What remains unequal is printed: each
side's parameters, and the FLOPs of one forward and backward as ``torch.utils.flop_counter`` counts
them (attention under SDPA's math kernel, which the counter sees; x-transformers counted on its
einsum path, ``attn_flash=False``, because its SDPA path picks kernels the counter has no formula
for); ``train_flop_speedup`` is the ratio of FLOPs per second, the speedup for equal work.

Both models have the same head size: x-transformers' default of 64-dimensional heads would make its
attention twice as wide as ours (1.09 M against 0.82 M parameters), and a speedup would partly
measure that difference in size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import environment, median_time, print_table, write_json  # noqa: E402

from posenc_lab.model import GPT, GPTConfig  # noqa: E402
from posenc_lab.lab.run.training import TrainConfig, flush_denormals, make_optimizer  # noqa: E402

# how x-transformers spells each encoding (the ones it has); sinusoidal is its *scaled* sinusoid
PEER_OPTIONS = {
    "nope": ({"use_abs_pos_emb": False}, {}),
    "learned": ({}, {}),
    "rope": ({"use_abs_pos_emb": False}, {"rotary_pos_emb": True}),
    "xpos": ({"use_abs_pos_emb": False}, {"rotary_xpos": True}),
    "alibi": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}),
    "t5": ({"use_abs_pos_emb": False}, {"rel_pos_bias": True}),
}


def ours(name, args):
    torch.manual_seed(0)
    model = GPT(GPTConfig(encoding=name, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                          train_len=args.train_len))
    # ``masks``: an evaluation's own, as evaluate() hands every window of one length the masks built once
    return model, lambda x, masks=None: model(x, masks=masks), lambda x: model(x)


def theirs(name, args):
    from x_transformers import Decoder, TransformerWrapper

    wrapper_options, attn_options = PEER_OPTIONS[name]
    max_len = args.train_len if name == "learned" else max(args.train_len, args.eval_len)

    def build(flash):
        torch.manual_seed(0)
        return TransformerWrapper(num_tokens=256, max_seq_len=max_len, tie_embedding=True, **wrapper_options,
                                  attn_layers=Decoder(dim=args.d_model, depth=args.n_layer, heads=args.n_head,
                                                      attn_dim_head=args.d_model // args.n_head, ff_mult=4,
                                                      attn_flash=flash, **attn_options))

    model = build(flash=not attn_options.get("rel_pos_bias", False))
    # x-transformers' SDPA path chooses its own kernels, so the FLOP counter cannot see its attention;
    # its einsum path is the same arithmetic on the same weights, and the counter sees all of it
    twin = build(flash=False)
    return model, lambda x, masks=None: model(x), lambda x: twin(x)


def counted_flops(logits, args) -> float:
    """FLOPs of one forward and backward on a training batch, as ``torch.utils.flop_counter`` counts them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randint(0, 256, (args.batch, args.train_len + 1), generator=torch.Generator().manual_seed(1))
    # the counter has no formula for SDPA's fused CPU kernel: under the math kernel, attention is matmuls it sees
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = logits(x[:, :-1])
        F.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1)).backward()
    return float(counter.get_total_flops())


def measurements(build, name, args):
    model, logits, counted = build(name, args)
    model.counted_flops = counted_flops(counted, args)
    model.zero_grad(set_to_none=True)
    opt = make_optimizer(model, TrainConfig())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.train_len + 1), generator=g)
    long = torch.randint(0, 256, (1, args.eval_len), generator=g)

    masks = {}  # the evaluation's masks, for the weights of the last training step

    def step():
        model.train()
        with flush_denormals():
            out = logits(x[:, :-1])
            F.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        masks.clear()

    def evaluate():
        model.eval()
        with torch.no_grad(), flush_denormals():
            logits(long, masks=masks)

    return model, step, evaluate


def run(args) -> dict:
    cpu = torch.device("cpu")
    built = {(lib, name): measurements(build, name, args)
             for name in args.encodings for lib, build in (("posenc_lab", ours), ("x-transformers", theirs))}
    best = {key: {"step": float("inf"), "eval": float("inf")} for key in built}
    bar = tqdm(total=args.rounds * len(built), desc="peer comparison", disable=args.no_progress)
    for _ in range(args.rounds):
        for key, (_, step, evaluate) in built.items():
            bar.set_postfix_str(" ".join(key))
            best[key]["step"] = min(best[key]["step"], median_time(step, cpu, warmup=args.warmup, reps=args.reps))
            if key[1] != "learned":
                best[key]["eval"] = min(best[key]["eval"], median_time(evaluate, cpu, warmup=1, reps=args.eval_reps))
            bar.update()
    bar.close()
    rows = []
    for name in args.encodings:
        ours_, theirs_ = best["posenc_lab", name], best["x-transformers", name]
        row = {"encoding": name,
               "params_ours_m": built["posenc_lab", name][0].num_params() / 1e6,
               "params_theirs_m": sum(p.numel() for p in built["x-transformers", name][0].parameters()) / 1e6,
               "train_tok_s_ours": args.batch * args.train_len / ours_["step"],
               "train_tok_s_theirs": args.batch * args.train_len / theirs_["step"]}
        row["train_speedup"] = row["train_tok_s_ours"] / row["train_tok_s_theirs"]
        row["gflop_per_step_ours"] = built["posenc_lab", name][0].counted_flops / 1e9
        row["gflop_per_step_theirs"] = built["x-transformers", name][0].counted_flops / 1e9
        row["train_flop_speedup"] = row["train_speedup"] * row["gflop_per_step_ours"] / row["gflop_per_step_theirs"]
        if name != "learned":
            row["eval_ms_ours"], row["eval_ms_theirs"] = ours_["eval"] * 1e3, theirs_["eval"] * 1e3
            row["eval_speedup"] = row["eval_ms_theirs"] / row["eval_ms_ours"]
        rows.append(row)
    import x_transformers

    env = environment(cpu) | {"x_transformers": getattr(x_transformers, "__version__", None) or _version("x-transformers")}
    return {"environment": env, "args": vars(args), "rows": rows}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small sizes (CI)")
    p.add_argument("--encodings", type=lambda s: s.split(","), default=list(PEER_OPTIONS))
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--train-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--eval-len", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--eval-reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best median counts")
    p.add_argument("--json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        import x_transformers  # noqa: F401
    except ImportError:
        print("peer comparison skipped: x-transformers is not installed (pip install 'posenc-lab[peer]')")
        return None
    unknown = set(args.encodings) - set(PEER_OPTIONS)
    if unknown:
        p.error(f"x-transformers has no {', '.join(sorted(unknown))}; choose from {', '.join(PEER_OPTIONS)}")
    if args.smoke:
        args.n_layer, args.d_model, args.train_len, args.batch, args.eval_len = 2, 64, 64, 2, 256
        args.reps, args.eval_reps, args.rounds = 2, 2, 1
    result = run(args)
    result["command"] = list(sys.argv[1:] if argv is None else argv)
    print(result["environment"])
    print_table(result["rows"], ["encoding", "params_ours_m", "params_theirs_m", "train_tok_s_ours",
                                 "train_tok_s_theirs", "train_speedup", "train_flop_speedup",
                                 "eval_ms_ours", "eval_ms_theirs", "eval_speedup"])
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
