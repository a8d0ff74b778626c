"""Command line: ``python -m posenc_lab run|retrieval|report|presets|--version`` (also installed as ``posenc-lab``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posenc_lab.encodings import ENCODINGS
from posenc_lab.errors import PosencError, TrainingDiverged
from posenc_lab.rope import ROPE_SCALINGS
from posenc_lab.lab.extras import MissingExtra, require
from posenc_lab.lab.run.processes import run_jobs

EPILOG = """examples:
  python -m posenc_lab run --preset ci --out runs/smoke
  python -m posenc_lab run --preset cpu --encodings rope,alibi,t5 --out runs/cpu
  python -m posenc_lab run --preset cpu --encodings rope --finetune pi,yarn --finetune-steps 200 --finetune-len 512 --out runs/ft
  python -m posenc_lab report runs/cpu

A run writes to --out: config.json, units/ (one file per finished encoding and seed),
models/ (final weights), checkpoints/ (training state of unfinished units), results.csv and
results.json, figures/. Running the same command again continues where it stopped.
"""


def _names(text: str, valid, kind: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("all",):
        return tuple(valid)
    for n in names:
        if n not in valid:
            raise argparse.ArgumentTypeError(f"unknown {kind} {n!r}; valid: {', '.join(valid)} (or 'all')")
    return names


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _distributed_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (only under torchrun; see README 'Running on several GPUs')")
    g.add_argument("--dist-backend", help="process-group backend: nccl (default on CUDA) or gloo (default on CPU)")
    g.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds a process waits for the others before stopping with an error (default 300)")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def version_text() -> str:
    """The package's version and, for each committed run shipped with it, the commits of ``posenc_lab`` that
    produced its results (the ``git_commit`` of its rows; ``-dirty``: the package's source had uncommitted edits)."""
    from collections import Counter

    from posenc_lab import __version__
    from posenc_lab.lab import results

    lines = [f"posenc-lab {__version__} ({Path(__file__).resolve().parent})",
             "committed results shipped with it, by the posenc_lab commit that produced them:"]
    for name in results.RUNS:
        try:
            rows = results.rows(name)
        except (PosencError, OSError):
            lines.append(f"  {name}: not shipped")
            continue
        commits = Counter(str(row.get("git_commit", "unknown")) for row in rows)
        lines.append(f"  {name}: " + ", ".join(f"{c[:12]}{'-dirty' if c.endswith('-dirty') else ''} ({n} rows)"
                                               for c, n in sorted(commits.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


class _Version(argparse.Action):
    """``--version``: print :func:`version_text` and exit (read only when asked for)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def parser() -> argparse.ArgumentParser:
    """The command line's parser: one subcommand per kind of run, and ``report`` and ``presets``."""
    p = argparse.ArgumentParser(prog="posenc-lab", description="Train with each position encoding at one length, "
                                "evaluate far beyond it.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version, help="the package's version and the commits of the results it ships")
    sub = p.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _retrieval_parser(sub)
    _context_parser(sub)
    rep = sub.add_parser("report", help="tables and figures of a run folder")
    rep.add_argument("folder")
    rep.add_argument("--no-figures", action="store_true")

    sub.add_parser("presets", help="list the presets")
    return p


def _run_parser(sub) -> None:
    """``run``: the options of a language-model run, each one a setting of :class:`~posenc_lab.lab.experiments.language_model.Spec` (by its
    flat name, :meth:`~posenc_lab.lab.experiments.recipe.Composed.given`) or how to run it."""
    from posenc_lab.lab.experiments.language_model import ARTICLE_ENCODINGS, PRESETS
    from posenc_lab.lab.measure.perplexity import MODES

    r = sub.add_parser("run", help="train and evaluate (continues an interrupted run)", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--preset", default="cpu", help=f"starting configuration: {', '.join(PRESETS)} (default cpu; "
                   "see `posenc-lab presets`)")
    r.add_argument("--out", help="folder for the results, checkpoints and figures (default: runs/<preset>)")
    r.add_argument("--corpus", default="stdlib", help="stdlib (embedded, offline; default), wikitext-103 or wikitext-2 "
                   "(need the 'datasets' package and a network), or a path to a text file or folder")
    r.add_argument("--encodings", type=lambda s: _names(s, list(ENCODINGS), "encoding"),
                   help=f"comma-separated, or all: {', '.join(ENCODINGS)}")
    r.add_argument("--strategies", type=lambda s: _names(s, list(ROPE_SCALINGS), "RoPE strategy"),
                   help=f"RoPE extrapolation strategies to evaluate: {', '.join(ROPE_SCALINGS)}")
    r.add_argument("--seeds", type=_ints, help="seeds of every encoding run (e.g. 0,1,2); with --other-seeds "
                   f"too, of the article's encodings ({', '.join(ARTICLE_ENCODINGS)}) only")
    r.add_argument("--other-seeds", type=_ints, help="seeds of the encodings outside the article's (default: --seeds "
                   "when given, else the preset's)")
    r.add_argument("--steps", type=int, help="training steps")
    r.add_argument("--batch-size", type=int, help="training batch size (windows)")
    r.add_argument("--lr", type=float, help="peak learning rate")
    r.add_argument("--warmup", type=int, help="learning-rate warm-up steps")
    r.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    r.add_argument("--train-len", type=int, help="training length (tokens)")
    r.add_argument("--n-layer", type=int)
    r.add_argument("--n-head", type=int)
    r.add_argument("--d-model", type=int)
    r.add_argument("--eval-lengths", type=_ints, help="comma-separated evaluation lengths")
    r.add_argument("--eval-tokens", type=int, help="tokens scored at every length (a multiple of each length)")
    r.add_argument("--modes", type=lambda s: _names(s, list(MODES), "mode"), help=f"evaluation modes: {', '.join(MODES)} "
                   "(the preset's sliding windows are kept only at the lengths evaluated, and only with sliding)")
    r.add_argument("--stride", type=int, help="sliding-window stride (tokens newly scored per window)")
    r.add_argument("--eval-batch-size", type=int)
    r.add_argument("--finetune", type=lambda s: _names(s, [m for m in ROPE_SCALINGS if m != "dynamic-ntk"], "strategy"),
                   help="RoPE strategies to fine-tune briefly at --finetune-len before evaluating (pi, ntk, yarn)")
    r.add_argument("--finetune-steps", type=int, help="fine-tuning steps (the PI paper used about 1000)")
    r.add_argument("--finetune-len", type=int, help="fine-tuning length (tokens)")
    r.add_argument("--finetune-seeds", type=_ints, help="the RoPE seeds that are fine-tuned (default: all)")
    r.add_argument("--backend", choices=["auto", "sdpa", "flex", "reference"], help="attention backend")
    r.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    r.add_argument("--unit", dest="units", action="append", type=_unit, metavar="ENCODING:SEED",
                   help="run only this unit of the preset (repeatable); processes that share --out can split a run")
    r.add_argument("--jobs", type=int, default=1, help="units run at once, each in its own process on the same "
                   "device (a small model leaves a GPU mostly idle); logs in OUT/logs/")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the training step (default: on CUDA, off on the CPU)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.add_argument("--extend", action="store_true",
                   help="add to the finished run in --out the evaluations these options ask for and it lacks "
                        "(a new length or sliding stride), from its kept final weights, without training")
    _distributed_options(r)
    r.add_argument("--no-report", action="store_true", help="skip the report at the end")


def _retrieval_parser(sub) -> None:
    """``retrieval``: the options of a passkey-retrieval run (of :class:`~posenc_lab.lab.experiments.retrieval.RetrievalSpec`)."""
    from posenc_lab.lab.experiments.retrieval import RETRIEVAL_PRESETS

    ret = sub.add_parser("retrieval", help="passkey retrieval at 1x to 8x the training length (continues an "
                         "interrupted run)", formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="examples:\n  python -m posenc_lab retrieval --preset retrieval-cpu\n"
                                "  python -m posenc_lab retrieval --preset retrieval-cpu --encodings rope,alibi --trials 100")
    ret.add_argument("--preset", default="retrieval-cpu", help=f"starting configuration: {', '.join(RETRIEVAL_PRESETS)}")
    ret.add_argument("--out", help="folder for the results (default: runs/<preset>)")
    ret.add_argument("--task", choices=["content", "digits", "multikey"],
                     help="content: a lookup by character class; digits: five digits copied in order; multikey: "
                          "the named key among distractors of the same kind (default: the preset's)")
    ret.add_argument("--encodings", type=lambda s: _names(s, list(ENCODINGS), "encoding"))
    ret.add_argument("--strategies", type=lambda s: _names(s, list(ROPE_SCALINGS), "RoPE strategy"))
    ret.add_argument("--seeds", type=_ints)
    ret.add_argument("--steps", type=int, help="training steps")
    ret.add_argument("--batch-size", type=int)
    ret.add_argument("--lr", type=float)
    ret.add_argument("--train-len", type=int, help="training length (bytes)")
    ret.add_argument("--n-layer", type=int)
    ret.add_argument("--n-head", type=int)
    ret.add_argument("--d-model", type=int)
    ret.add_argument("--multiples", type=_ints, help="evaluation lengths as multiples of the training length (e.g. 1,2,4,8)")
    ret.add_argument("--depths", type=_floats, help="needle depths in [0, 1] (e.g. 0,0.25,0.5,0.75,1)")
    ret.add_argument("--trials", type=int, help="windows per (length, depth) cell")
    ret.add_argument("--train-keys", type=_ints, help="multikey: named keys per training window, cycled by step "
                                                      "(e.g. 1,2,3,4); the grid always asks among 4")
    ret.add_argument("--train-questions", type=_ints, help="multikey: questions per training window, cycled by step "
                                                           "(e.g. 1,2,3,4), each naming a key drawn at random (the "
                                                           "grid asks one)")
    ret.add_argument("--untied", dest="tie_embeddings", action="store_false", default=None,
                     help="separate input embedding and output head (default: the preset's; tied except "
                          "in retrieval-multikey-cpu)")
    ret.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    ret.add_argument("--no-progress", action="store_true")
    _distributed_options(ret)


def _context_parser(sub) -> None:
    """``context``: the options of the context measurements (of :class:`~posenc_lab.lab.experiments.context.ContextSpec`)."""
    from posenc_lab.lab.experiments.context import CONTEXT_PRESETS

    ctx = sub.add_parser("context", help="does a trained language model use the context past its training length? "
                         "(the gain from far context and a Python passkey; continues an interrupted run)",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="examples:\n  python -m posenc_lab context --preset context-cpu --run runs/article-cpu\n"
                                "  python -m posenc_lab context --preset context-cpu --run article-cpu --seeds 0")
    ctx.add_argument("--preset", default="context-cpu", help=f"starting configuration: {', '.join(CONTEXT_PRESETS)}")
    ctx.add_argument("--run", help="the trained models: a run folder (--out of `run`) or a committed run's name")
    ctx.add_argument("--out", help="folder for the results (default: runs/<preset>)")
    ctx.add_argument("--encodings", type=lambda s: _names(s, list(ENCODINGS), "encoding"))
    ctx.add_argument("--strategies", type=lambda s: _names(s, list(ROPE_SCALINGS), "RoPE strategy"))
    ctx.add_argument("--seeds", type=_ints)
    ctx.add_argument("--lengths", type=_ints, help="evaluation lengths of the gain (bytes)")
    ctx.add_argument("--reach", type=int, help="keys a query may attend to in the limited evaluation (default: the "
                                               "training length)")
    ctx.add_argument("--trials", type=int, help="passkey windows per (length, depth) cell and seed")
    ctx.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    ctx.add_argument("--corpus", help="where to read the run's corpus (as run's --corpus) when it is not this "
                                      "machine's default; its SHA-256 must match the run's")
    ctx.add_argument("--unit", dest="units", action="append", type=_unit, metavar="ENCODING:SEED",
                     help="measure only this trained model (repeatable); processes that share --out can split the work")
    ctx.add_argument("--jobs", type=int, default=1, help="units measured at once, each in its own process")
    ctx.add_argument("--no-progress", action="store_true")
    ctx.add_argument("--no-report", action="store_true", help="skip the report at the end")


def _report(folder, figures: bool = True) -> str:
    """The text report of a run folder and, with ``figures``, its PNGs under ``folder/figures``. Without the
    ``[figures]`` extra that draws them (``pip install posenc-lab[lab]`` alone), the figures are skipped with one line
    that names it: the results are in the folder already."""
    from posenc_lab.lab import extras
    from posenc_lab.lab.verdicts import tables as report

    text = report.report(folder)
    if figures:
        absent = extras.missing("figures")
        if absent:
            return text + (f"\n\nfigures skipped: they need the [figures] extra (missing: {', '.join(absent)}): "
                           "pip install 'posenc-lab[figures]'")
        from posenc_lab.lab.figures.files import save_report_figures

        rows, units, _ = report.load(folder)
        written = save_report_figures(rows, units, Path(folder) / "figures")
        text += "\n\nfigures: " + ", ".join(str(p) for p in written)
    return text


def main(argv=None) -> int:
    try:
        require("lab", "the posenc-lab command")
    except MissingExtra as err:
        print(f"posenc-lab: error: {err}", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --jobs hands each unit's process
    from posenc_lab.lab.run import distributed

    try:
        if args.command in ("run", "retrieval") and distributed.launched_by_torchrun():
            import torch

            distributed.init(torch.device(args.device) if args.device else None, backend=args.dist_backend,
                             timeout_s=args.dist_timeout)
        COMMANDS[args.command](args)
        return 0
    except (PosencError, TrainingDiverged) as err:
        print(f"posenc-lab: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("posenc-lab: interrupted; finished units and the last checkpoint are kept: run the same command "
              "again to continue", file=sys.stderr)
        return 130
    except RuntimeError as err:
        if not distributed.active() or not _lost_peer(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"posenc-lab: error: process {distributed.rank()} of {distributed.world_size()} lost the other "
              f"processes ({first}); finished units and the last checkpoint are kept: run the same command again "
              "to continue", file=sys.stderr)
        return 1
    finally:
        distributed.shutdown()


def _lost_peer(err: RuntimeError) -> bool:
    """Whether an error comes from the process group (a peer died or timed out), not from a bug."""
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, getattr(dist, "DistBackendError", ())) or any(
        word in text for word in ("connection", "timed out", "timeout", "gloo", "nccl", "peer", "socket"))


def _unit(text: str) -> tuple[str, int]:
    encoding, _, seed = text.rpartition(":")
    if encoding not in ENCODINGS or not seed.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not ENCODING:SEED with a known encoding (e.g. rope:0)")
    return encoding, int(seed)


def _asked(args, base, overrides: dict) -> dict:
    """``overrides`` with the two rules of ``run``: ``--seeds`` alone seeds every encoding, and the preset's sliding
    windows are kept only where they are evaluated (at the lengths asked, and only when sliding is a mode)."""
    overrides = dict(overrides)
    if args.seeds is not None and args.other_seeds is None:
        overrides["other_seeds"] = args.seeds
    evaluation = base.evaluation
    modes = args.modes or evaluation.modes
    lengths = args.eval_lengths or evaluation.eval_lengths
    if "sliding" not in modes:
        overrides["sliding"] = ()
    elif args.eval_lengths is not None and evaluation.sliding:
        overrides["sliding"] = tuple((n, stride) for n, stride in evaluation.sliding if n in lengths)
    return overrides


def _presets(args) -> None:
    """``presets``: one line for each preset of every kind of run."""
    from posenc_lab.lab.experiments.context import CONTEXT_PRESETS
    from posenc_lab.lab.experiments.language_model import PRESETS
    from posenc_lab.lab.experiments.retrieval import RETRIEVAL_PRESETS

    def trained(spec) -> str:  # the model and its training, in words
        m, t = spec.model, spec.training
        return (f"{m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, trained at {m.train_len} for {t.steps} "
                f"steps x {t.batch_size}")

    for name, spec in PRESETS.items():
        print(f"{name:6s} {trained(spec)}; evaluated at {', '.join(map(str, spec.evaluation.eval_lengths))}; "
              f"seeds {list(spec.seeds)}. {spec.notes}")
    for name, spec in RETRIEVAL_PRESETS.items():
        print(f"{name} (retrieval) {trained(spec)}; judged at "
              f"{', '.join(f'{m}x' for m in spec.multiples)} x depths {list(spec.depths)}, {spec.trials} trials "
              f"per cell. {spec.notes}")
    for name, spec in CONTEXT_PRESETS.items():
        print(f"{name} (context) the trained models of {spec.run or '--run'}: gain at "
              f"{', '.join(map(str, spec.lengths))}, passkey at {', '.join(f'{m}x' for m in spec.passkey_multiples)}"
              f"; seeds {list(spec.seeds)}. {spec.notes}")


def _retrieval(args) -> None:
    """``retrieval``: a passkey-retrieval run, then its report."""
    from posenc_lab.lab.experiments import retrieval
    from posenc_lab.lab.run import distributed

    spec = retrieval.retrieval_preset(args.preset, **retrieval.RetrievalSpec.given(args))
    out = args.out or f"runs/{args.preset}"
    retrieval.run(spec, out, device=args.device, progress=not args.no_progress)
    if distributed.is_main():
        print(retrieval.report(out))


def _context(args) -> None:
    """``context``: the context measurements on a run's trained models, then their report."""
    from posenc_lab.lab.experiments import context

    spec = context.context_preset(args.preset, **context.ContextSpec.given(args))
    if not spec.run:
        raise PosencError("give the trained models with --run (a run folder or a committed run's name)")
    out = args.out or f"runs/{args.preset}"
    if args.jobs > 1:
        run_jobs(args.units or context.units_of(spec), args.jobs, Path(out), args.argv)
    context.run(spec, out, device=args.device, progress=not args.no_progress, corpus=args.corpus,
                only=args.units)
    if not args.no_report:
        print(context.report(out))


def _run(args) -> None:
    """``run``: train and evaluate (or, with ``--extend``, only evaluate what a finished run lacks), then report."""
    from posenc_lab.lab.experiments.extend_run import extend
    from posenc_lab.lab.experiments.language_model import Spec, preset, run, units_of
    from posenc_lab.lab.run import distributed

    spec = preset(args.preset, **_asked(args, preset(args.preset), Spec.given(args)))
    out = args.out or f"runs/{args.preset}"
    if args.extend:
        extend(spec, out, corpus=args.corpus, device=args.device, progress=not args.no_progress)
    else:
        if args.jobs > 1:
            run_jobs(args.units or units_of(spec), args.jobs, Path(out), args.argv)
        run(spec, out, corpus=args.corpus, device=args.device, progress=not args.no_progress, only=args.units)
    if not args.no_report and distributed.is_main():
        print(_report(out))


def _report_command(args) -> None:
    """``report``: the text report of a run folder, and its figures."""
    print(_report(args.folder, figures=not args.no_figures))


#: each command of the parser -> the function that runs it with the parsed arguments
COMMANDS = {"run": _run, "retrieval": _retrieval, "context": _context, "report": _report_command, "presets": _presets}


if __name__ == "__main__":
    sys.exit(main())
