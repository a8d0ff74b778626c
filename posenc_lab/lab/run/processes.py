"""Units in parallel: each unit of a run in its own ``python -m posenc_lab`` process, a few at a time (``--jobs``).

A small model leaves a GPU mostly idle; processes that share one ``--out`` each write their own unit file,
and the command that started them then writes the tables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from posenc_lab.errors import PosencError


def run_jobs(units: list[tuple[str, int]], jobs: int, out: Path, argv: list[str]) -> None:
    """Each unit in its own ``python -m posenc_lab`` process with this command's arguments ``argv``, ``jobs`` at
    a time.

    The processes share ``out`` (each writes its own unit file), and a unit already finished is skipped as
    always; the command then goes on to write the tables. A failed unit is named with its log; the others run on.
    """
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}
    waiting, running, failed = list(units), {}, []
    try:
        _pool(waiting, running, failed, jobs, logs, env, argv)
    except KeyboardInterrupt:  # stop every unit cleanly: each keeps its last training checkpoint and resumes
        for proc, _, _ in running.values():
            proc.send_signal(signal.SIGINT)
        for proc, _, _ in running.values():
            proc.wait(timeout=60)
        raise
    if failed:
        raise PosencError(f"{len(failed)} units failed: {', '.join(failed)}")


def without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` and their values (``--unit X`` and ``--unit=X`` alike)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(o + "=" for o in options)):
            kept.append(arg)
    return kept


def _pool(waiting, running, failed, jobs, logs, env, argv) -> None:
    """Start the waiting units, ``jobs`` at a time, until none waits or runs; a failed one is added to ``failed``."""
    argv = without_options(argv, ("--unit", "--jobs"))  # each process gets its one unit
    while waiting or running:
        while waiting and len(running) < jobs:
            encoding, seed = waiting.pop(0)
            log = logs / f"{encoding}-s{seed}.log"
            command = [sys.executable, "-m", "posenc_lab", *argv, "--unit", f"{encoding}:{seed}", "--jobs", "1",
                       "--no-report", "--no-progress"]
            running[(encoding, seed)] = (subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                                          env=env), time.time(), log)
        time.sleep(1)
        for unit, (proc, start, log) in list(running.items()):
            if proc.poll() is not None:
                del running[unit]
                print(f"{unit[0]}:{unit[1]} {'done' if proc.returncode == 0 else 'FAILED'} in "
                      f"{time.time() - start:.0f} s ({len(waiting)} waiting, {len(running)} running)", flush=True)
                if proc.returncode:
                    failed.append(f"{unit[0]}:{unit[1]} (log: {log})")
