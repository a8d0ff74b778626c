"""The experiment: train each encoding at one length, evaluate it at that length and far beyond.

One *unit* is one encoding and one seed: train (resuming from its checkpoint), then evaluate at
every length and mode (for RoPE, once per extrapolation strategy, and optionally after a brief
fine-tune at a longer length). Each finished unit is written to ``units/`` at once, so a run that
is interrupted, or cut short by a GPU time slice, continues from the units already finished when
the same command is run again. The tidy table (``results.csv`` / ``results.json``) is rebuilt from
the units after each one.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from . import __version__, distributed
from .data import Corpus, load_corpus
from .encodings import ENCODINGS
from .errors import PosencError, check_positive, unknown_name
from .evaluate import MODES, evaluate, window_plan
from .model import GPT, GPTConfig
from .rope import ROPE_SCALINGS
from .train import TrainConfig, replace_atomically, save_atomic, train

MAIN_ENCODINGS = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5")  # the article's, with several seeds


@dataclass
class Spec:
    """Everything that defines an experiment; a preset is a named Spec."""

    preset: str = "custom"
    encodings: tuple[str, ...] = tuple(ENCODINGS)
    strategies: tuple[str, ...] = tuple(ROPE_SCALINGS)  # RoPE extrapolation strategies evaluated
    seeds: tuple[int, ...] = (0,)  # for MAIN_ENCODINGS
    other_seeds: tuple[int, ...] = (0,)  # for the newer relatives (xpos, kerple, fire)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    train_len: int = 128
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100
    checkpoint_every: int = 200
    eval_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    eval_tokens: int = 16384
    modes: tuple[str, ...] = MODES
    stride: int = 128
    eval_batch_size: int = 4
    finetune: tuple[str, ...] = ()  # RoPE strategies to fine-tune briefly at finetune_len
    finetune_steps: int = 0
    finetune_len: int = 0
    finetune_seeds: tuple[int, ...] | None = None  # the RoPE seeds that are fine-tuned (default: all)
    backend: str = "auto"
    compile: bool | None = None  # torch.compile the training step; default: on CUDA
    notes: str = ""

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "train_len", "steps", "batch_size", "lr", "eval_tokens",
                     "stride", "eval_batch_size", "checkpoint_every"):
            check_positive(name, getattr(self, name))
        for name in self.encodings:
            if name not in ENCODINGS:
                raise unknown_name("encoding", name, ENCODINGS)
        for name in (*self.strategies, *self.finetune):
            if name not in ROPE_SCALINGS:
                raise unknown_name("RoPE scaling", name, ROPE_SCALINGS)
        for mode in self.modes:
            if mode not in MODES:
                raise unknown_name("evaluation mode", mode, MODES)
        for length in self.eval_lengths:
            check_positive("evaluation length", length)
            if self.eval_tokens % length:
                raise PosencError(f"eval_tokens ({self.eval_tokens}) must be a multiple of every evaluation length ({length})")
            for mode in self.modes:  # the window arithmetic must work out at every length
                window_plan(self.eval_tokens, length, mode, min(self.stride, length))
        if not self.seeds or not self.eval_lengths or not self.encodings or not self.modes:
            raise PosencError("an experiment needs at least one encoding, seed, evaluation length and mode")
        if "dynamic-ntk" in self.finetune:
            raise PosencError("dynamic-ntk has no fixed factor to fine-tune with; fine-tune with pi, ntk or yarn")
        if self.finetune and (self.finetune_steps <= 0 or self.finetune_len <= self.train_len):
            raise PosencError("fine-tuning needs --finetune-steps > 0 and --finetune-len longer than the training length")
        if self.d_model % self.n_head:
            raise PosencError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if (self.d_model // self.n_head) % 2 and {"rope", "xpos"} & set(self.encodings):
            raise PosencError(f"RoPE and xPos rotate pairs: the head dimension d_model / n_head = "
                              f"{self.d_model // self.n_head} must be even")

    def finetune_batch(self) -> int:
        """The fine-tuning batch: the training batch's tokens per step, in windows of ``finetune_len``."""
        return max(1, self.batch_size * self.train_len // self.finetune_len)

    def seeds_for(self, encoding: str) -> tuple[int, ...]:
        return self.seeds if encoding in MAIN_ENCODINGS else self.other_seeds

    def finetunes(self, seed: int) -> tuple[str, ...]:
        """The strategies fine-tuned for RoPE seed ``seed``."""
        return self.finetune if self.finetune_seeds is None or seed in self.finetune_seeds else ()

    def model_config(self, encoding: str) -> GPTConfig:
        return GPTConfig(encoding=encoding, n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model,
                         train_len=self.train_len, backend=self.backend)

    def train_config(self, seed: int) -> TrainConfig:
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, lr=self.lr, warmup=self.warmup,
                           checkpoint_every=self.checkpoint_every, seed=seed)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Spec] = {
    "ci": Spec(preset="ci", n_layer=2, n_head=4, d_model=64, train_len=64, steps=40, batch_size=8, lr=3e-3,
               warmup=10, checkpoint_every=20, eval_lengths=(64, 128, 256), eval_tokens=1024, stride=32,
               eval_batch_size=4, notes="every encoding end to end in about a minute on 2 CPU cores; numbers mean nothing"),
    "cpu": Spec(preset="cpu", n_layer=4, n_head=4, d_model=128, train_len=128, steps=1200, batch_size=16, lr=2e-3,
                warmup=100, checkpoint_every=200, eval_lengths=(128, 256, 512, 1024, 2048), eval_tokens=16384,
                stride=128, eval_batch_size=4,
                notes="the qualitative picture on 2 CPU cores: train at 128, evaluate to 16x"),
    "article-cpu": Spec(preset="article-cpu", n_layer=4, n_head=4, d_model=128, train_len=512, steps=700, batch_size=8,
                        lr=2e-3, warmup=70, checkpoint_every=100, eval_lengths=(512, 1024, 2048, 4096, 8192),
                        eval_tokens=24576, stride=512, eval_batch_size=4, seeds=(0, 1, 2), other_seeds=(0, 1, 2),
                        finetune=("pi", "ntk", "yarn"), finetune_steps=200, finetune_len=2048, finetune_seeds=(0,),
                        notes="the article's lengths on 2 CPU cores: trained at 512, judged at 2048 (4x), "
                              "evaluated to 8192, three seeds of every encoding; about 2 hours"),
    "colab": Spec(preset="colab", n_layer=6, n_head=6, d_model=384, train_len=512, steps=1500, batch_size=16,
                  lr=1e-3, warmup=150, checkpoint_every=250, eval_lengths=(512, 1024, 2048, 4096, 8192),
                  eval_tokens=32768, stride=256, eval_batch_size=2,
                  notes="sized for a Colab T4 in about 30 minutes"),
    "paper": Spec(preset="paper", n_layer=12, n_head=8, d_model=512, train_len=512, steps=4000, batch_size=64,
                  lr=6e-4, warmup=300, checkpoint_every=250, eval_lengths=(512, 1024, 2048, 4096, 8192, 16384),
                  eval_tokens=65536, stride=512, eval_batch_size=4, seeds=(0, 1, 2),
                  notes="the article's model (12 layers, 8 heads, d_model 512, trained at 512) on a GPU"),
}


def preset(name: str, **overrides) -> Spec:
    if name not in PRESETS:
        raise unknown_name("preset", name, PRESETS)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[name], **overrides)


# --------------------------------------------------------------------------------------------- bookkeeping


def git_commit() -> str:
    """The package checkout's commit, ``-dirty`` when the package's own source has uncommitted changes
    (the results depend on it; edits elsewhere in the repository do not make a run dirty), or ``unknown``."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    processes = f" x {distributed.world_size()} processes" if distributed.active() else ""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device) + processes
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads){processes}"


def write_atomic(path: Path, text: str) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(text))


COLUMNS = ["encoding", "strategy", "seed", "train_len", "eval_len", "eval_mode", "stride", "status", "loss",
           "perplexity", "bits_per_byte", "tokens", "eval_seconds", "train_loss", "train_steps", "train_tokens",
           "train_seconds", "finetune_steps", "finetune_tokens", "finetune_len", "preset", "corpus", "corpus_sha256",
           "python", "device", "torch", "posenc_lab", "git_commit", "config"]


# --------------------------------------------------------------------------------------------- running


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _evaluate_all(model, spec: Spec, stream, device, progress, label) -> tuple[list[dict], dict]:
    rows, per_position = [], {}
    for length in spec.eval_lengths:
        for mode in spec.modes:
            stride = min(spec.stride, length) if mode == "sliding" else None
            r = evaluate(model, stream, length=length, tokens=spec.eval_tokens, mode=mode, stride=stride,
                         batch_size=spec.eval_batch_size, device=device, progress=progress,
                         desc=f"{label} L={length} {mode}")
            rows.append({"eval_len": length, "eval_mode": mode, "stride": stride or "", "status": r["status"],
                         "loss": r["loss"], "perplexity": r["perplexity"], "bits_per_byte": r["bits_per_byte"],
                         "tokens": r["tokens"], "eval_seconds": round(r["seconds"], 3)})
            if mode == "nonoverlapping" and r["per_position"] is not None:
                per_position[str(length)] = [round(x, 5) for x in r["per_position"]]
    return rows, per_position


def encoding_state(model) -> dict:
    """The learned parameters of a bias encoding (small tables), for the book's figures."""
    if model.cfg.encoding not in ("t5", "kerple", "fire"):
        return {}
    return {k: v.detach().cpu().tolist() for k, v in model.encoding.state_dict().items()}


def run_unit(spec: Spec, encoding: str, seed: int, train_stream, eval_stream, out: Path, device, progress,
             common: dict) -> dict:
    """Train and evaluate one encoding with one seed; returns the unit record (rows and curves)."""
    label = f"{encoding}/s{seed}"
    torch.manual_seed(seed)
    model = GPT(spec.model_config(encoding))
    compile = spec.compile if spec.compile is not None else device.type == "cuda"
    trained = train(model, train_stream, spec.train_config(seed), checkpoint=out / "checkpoints" / f"{encoding}-s{seed}.pt",
                    device=device, progress=progress, desc=f"train {label}", compile=compile)
    base = {"encoding": encoding, "seed": seed, "train_len": spec.train_len, "train_loss": round(trained["train_loss"], 5),
            "train_steps": trained["train_steps"], "train_tokens": trained["train_tokens"],
            "train_seconds": round(trained["train_seconds"], 2), "finetune_steps": 0, "finetune_tokens": 0,
            "finetune_len": "", **common}
    rows, curves = [], {}
    strategies = spec.strategies if encoding == "rope" else ("-",)
    for strategy in strategies:
        if encoding == "rope":
            model.encoding.set_scaling(strategy)
        evaluated, per_position = _evaluate_all(model, spec, eval_stream, device, progress, f"{label} {strategy}")
        rows += [{**base, "strategy": strategy, **r} for r in evaluated]
        curves[strategy] = per_position
    if encoding == "rope":
        for strategy in spec.finetunes(seed):
            tuned = copy.deepcopy(model)
            factor = spec.finetune_len / spec.train_len
            tuned.encoding.set_scaling(strategy, factor=factor)
            ft_cfg = replace(spec.train_config(seed), steps=spec.finetune_steps, lr=spec.lr / 10,
                             warmup=max(1, spec.finetune_steps // 10))
            ft_cfg = replace(ft_cfg, batch_size=spec.finetune_batch())  # same tokens per step
            ft = train(tuned, train_stream, ft_cfg, length=spec.finetune_len,
                       checkpoint=out / "checkpoints" / f"{encoding}-s{seed}-ft-{strategy}.pt",
                       device=device, progress=progress, desc=f"fine-tune {label} {strategy}", compile=compile)
            evaluated, per_position = _evaluate_all(tuned, spec, eval_stream, device, progress, f"{label} {strategy}+ft")
            name = f"{strategy}+ft"
            rows += [{**base, "strategy": name, "finetune_steps": spec.finetune_steps, "finetune_tokens": ft["train_tokens"],
                      "finetune_len": spec.finetune_len, **r} for r in evaluated]
            curves[name] = per_position
    if distributed.is_main():
        save_atomic(model.state_dict(), out / "models" / f"{encoding}-s{seed}.pt")
    return {"encoding": encoding, "seed": seed, "rows": rows, "per_position": curves,
            "train_losses": [round(x, 4) for x in trained["losses"]], "encoding_state": encoding_state(model)}


def collect(out: Path) -> list[dict]:
    """Every row of every finished unit, in a stable order."""
    units = sorted((out / "units").glob("*.json"))
    rows = [row for path in units for row in json.loads(path.read_text())["rows"]]
    return rows


def write_table(out: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(out / "results.csv", buf.getvalue())
    write_atomic(out / "results.json", json.dumps(rows, indent=1))


def prepare(out: Path, config: dict) -> None:
    """Record ``config`` in ``out/config.json``; refuse a folder that holds a different experiment."""
    config_path = out / "config.json"
    if config_path.exists():
        previous = json.loads(config_path.read_text())
        if json.loads(json.dumps(config)) != {k: previous.get(k) for k in config}:
            raise PosencError(f"{out} holds a different experiment (its config.json differs): use a new --out, "
                              "or the same options to continue it")
    distributed.barrier()  # every process has read the old config before the main one rewrites it
    if distributed.is_main():
        write_atomic(config_path, json.dumps(config, indent=1))


def run_units(out: Path, units: list[tuple[str, int]], run_one, *, after_each=None, log=print) -> None:
    """The runner every experiment shares: ``run_one(encoding, seed)`` for each unit not finished in ``out``.

    A finished unit is written to ``out/units/<encoding>-s<seed>.json`` at once (atomically), so an
    interrupted run continues from the units already done; its checkpoints are then deleted (its
    final weights stay in ``out/models``). ``after_each(out)`` runs after every unit (the tables).
    """
    log = log if distributed.is_main() else (lambda *a: None)
    for i, (encoding, seed) in enumerate(units, 1):
        path = out / "units" / f"{encoding}-s{seed}.json"
        if distributed.agree(path.exists(), f"whether {path} is finished"):
            log(f"[{i}/{len(units)}] {encoding} seed {seed}: done already ({path})")
            continue
        log(f"[{i}/{len(units)}] {encoding} seed {seed}")
        t0 = time.perf_counter()
        record = run_one(encoding, seed)
        record["seconds"] = round(time.perf_counter() - t0, 1)
        if distributed.is_main():  # one process writes; the others wait for the file before going on
            write_atomic(path, json.dumps(record))
            for ckpt in (out / "checkpoints").glob(f"{encoding}-s{seed}*.pt"):
                ckpt.unlink()  # the unit is done: its training state is no longer needed (weights are in models/)
            if after_each is not None:
                after_each(out)
        distributed.barrier()


def run_context(spec, corpus: Corpus, device: torch.device) -> dict:
    """The columns every row of a run carries: what ran, on what, with which code."""
    return {"preset": spec.preset, "corpus": corpus.name, "corpus_sha256": corpus.meta["sha256"],
            "python": ".".join(map(str, sys.version_info[:3])), "device": device_name(device),
            "torch": torch.__version__, "posenc_lab": __version__, "git_commit": git_commit(),
            "config": json.dumps(spec.to_dict(), sort_keys=True)}


def resolve_device(device: str | None) -> torch.device:
    try:
        device = torch.device(device) if device else default_device()
    except RuntimeError:
        raise PosencError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PosencError("--device cuda was asked for, but this torch sees no CUDA GPU")
    if distributed.active() and device.type == "cuda":  # under torchrun: this process's own GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def run(spec: Spec, out: Path | str, *, corpus: Corpus | str = "stdlib", device: str | None = None,
        progress: bool = True, log=print) -> list[dict]:
    """Run every unit of ``spec`` not yet finished in ``out``; returns the rows of the whole table."""
    out = Path(out)
    device = resolve_device(device)
    corpus = load_corpus(corpus) if isinstance(corpus, str) else corpus
    prepare(out, {"spec": spec.to_dict(), "corpus": corpus.describe()})
    train_stream, eval_stream = corpus.stream("train"), corpus.stream("test")
    if len(eval_stream) < spec.eval_tokens + 1:
        raise PosencError(f"the test split of {corpus.name!r} has {len(eval_stream)} bytes, fewer than eval_tokens "
                          f"+ 1 = {spec.eval_tokens + 1}: lower --eval-tokens or use a larger corpus")
    distributed.check_divisible(spec.batch_size)  # before any training, not when a unit gets there
    if spec.finetune:
        distributed.check_divisible(spec.finetune_batch())
    common = run_context(spec, corpus, device)
    units = [(e, s) for e in spec.encodings for s in spec.seeds_for(e)]
    run_units(out, units, lambda e, s: run_unit(spec, e, s, train_stream, eval_stream, out, device, progress, common),
              after_each=lambda o: write_table(o, collect(o)), log=log)
    rows = collect(out)
    if distributed.is_main():
        write_table(out, rows)
    return rows
