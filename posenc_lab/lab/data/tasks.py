"""The synthetic retrieval tasks: windows of bytes with a passkey planted in a haystack and asked for at the end.

Three tasks (``task``), each learnable from scratch at the training length on a CPU:

* ``content`` (the control, a synthetic passkey test in the spirit of Mohtashami & Jaggi 2023): the haystack
  is random lowercase letters; the passkey is four bytes, each drawn from its own alphabet (``0-9``,
  ``A-J``, ``K-T``, ``U-Z!#$%``), planted at a chosen depth of the haystack (depth 0: the first bytes,
  depth 1: the last bytes before the question); the window ends with ``?`` and the four passkey bytes.
  Because each passkey byte comes from its own alphabet and appears nowhere else, finding it is pure
  content lookup (``?`` asks for a digit, a digit asks for a letter of ``A-J``, ...): no position
  arithmetic is needed, so a model that fails beyond the training length fails because its position
  encoding disturbs attention there, not because the task needs positions.
* ``digits``: one shared alphabet. The passkey is five digits planted in a haystack of lowercase
  letters; the question ``?`` asks for them **in order**. The first digit is found by its class,
  but the next ones must be copied from the position after the previous one (a digit can repeat in
  the key), the byte-level form of Mohtashami & Jaggi's (2023) "the pass key is 71432".
* ``multikey``: several named keys of the same kind (``K48213;``, names distinct upper-case
  letters, the asked one at the chosen depth, the others at random places), and the question
  ``?K`` names one, in the spirit of RULER's multi-key needles (Hsieh et al. 2024): the right key
  must be told from distractors of the same kind, then copied in order. The name is followed by the
  digits directly, so that one look-up of the name finds the key. A training window may end with
  several questions, each naming a key drawn at random (repeats allowed: asking every key once
  would let the last be found by elimination).

The targets are ``IGNORE`` everywhere but the answer bytes, so the loss (and the score) is on the answer only.
"""

from __future__ import annotations

import torch

from posenc_lab.errors import PosencError, unknown_name
from posenc_lab.model import IGNORE

FILLER = torch.tensor(list(b"abcdefghijklmnopqrstuvwxyz"))
SLOTS = [torch.tensor(list(chars)) for chars in (b"0123456789", b"ABCDEFGHIJ", b"KLMNOPQRST", b"UVWXYZ!#$%")]
QUESTION = ord("?")
KEY_LEN = len(SLOTS)
#: the retrieval tasks (see the module docstring)
TASKS = ("content", "digits", "multikey")
#: the alphabet of the digits and multikey passkeys (byte values)
DIGITS = torch.tensor(list(b"0123456789"))
NAMES = torch.tensor(list(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
DIGITS_LEN = 5  # the passkey of the digits and multikey tasks
MULTIKEYS = 4  # named keys in a multikey window (the asked one and three distractors)


def _place(seq, rows, start, piece):
    seq[rows, start[:, None] + torch.arange(piece.shape[1])] = piece


def _digit_windows(n, length, depth, generator, task, keys=MULTIKEYS, questions=1):
    """The ``digits`` and ``multikey`` windows: ``length + 1`` bytes, the last ``DIGITS_LEN`` the answer (with
    ``questions`` > 1, multikey only: that many questions at the end, each answer scored)."""
    if task == "digits":
        needle_len, ask_len = DIGITS_LEN, 1
    else:
        needle_len, ask_len = DIGITS_LEN + 2, 2  # "K48213;" and "?K"
    tail = questions * (ask_len + DIGITS_LEN)
    haystack = length + 1 - tail
    slots = keys if task == "multikey" else 1
    if haystack < 2 * slots * needle_len:
        raise PosencError(f"a {task} retrieval window needs at least {2 * slots * needle_len + tail - 1} "
                          f"bytes, got {length}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise PosencError(f"needle depth must lie in [0, 1], got {depth}")
    seq = FILLER[torch.randint(len(FILLER), (n, length + 1), generator=generator)]
    key = DIGITS[torch.randint(len(DIGITS), (n, DIGITS_LEN), generator=generator)]
    last = haystack - needle_len
    start = torch.randint(last + 1, (n,), generator=generator) if depth is None else torch.full((n,), round(depth * last))
    rows = torch.arange(n)[:, None]
    if task == "digits":
        _place(seq, rows, start, key)
        every = key[:, None, :]  # n 1 5
    else:
        names = torch.stack([NAMES[torch.randperm(len(NAMES), generator=generator)[:keys]] for _ in range(n)])  # n K
        semi = torch.full((n, 1), ord(";"))
        _place(seq, rows, start, torch.cat([names[:, :1], key, semi], 1))
        every = key[:, None, :].repeat(1, keys, 1)  # n K 5: every needle's digits, the asked one first
        for i in range(n):  # the distractors: other names, other digits, never overlapping a needle
            taken = [(int(start[i]), int(start[i]) + needle_len)]
            for k in range(1, keys):
                while True:
                    at = int(torch.randint(last + 1, (1,), generator=generator))
                    if all(at + needle_len <= a or at >= b for a, b in taken):
                        break
                taken.append((at, at + needle_len))
                other = key[i]
                while torch.equal(other, key[i]):  # a distractor's digits always differ from the asked key's
                    other = DIGITS[torch.randint(len(DIGITS), (DIGITS_LEN,), generator=generator)]
                seq[i, at : at + needle_len] = torch.cat([names[i, k : k + 1], other, semi[0]])
                every[i, k] = other
    # the questions after the haystack: "?" (the name asked: multikey), the digits ("?B90215?K48213..."); the first
    # asks for the needle placed at the depth, each later one for a needle drawn at random, repeats allowed (asking
    # every key once would let the last be found by elimination); the loss is on every answer
    asked = torch.cat([torch.zeros(n, 1, dtype=torch.long),
                       torch.randint(keys, (n, questions - 1), generator=generator)], 1)  # n questions: needle asked
    answers = torch.zeros(length + 1, dtype=torch.bool)
    for q in range(questions):
        at = haystack + q * (ask_len + DIGITS_LEN)
        seq[:, at] = QUESTION
        if task == "multikey":
            seq[:, at + 1] = names[rows[:, 0], asked[:, q]]
        seq[:, at + ask_len : at + ask_len + DIGITS_LEN] = every[rows[:, 0], asked[:, q]]
        answers[at + ask_len : at + ask_len + DIGITS_LEN] = True
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, ~answers[1:]] = IGNORE
    return inputs.long(), targets.long(), key.long(), start


def make_windows(n: int, length: int, depth: float | None, generator: torch.Generator, task: str = "content",
                 keys: int = MULTIKEYS, questions: int = 1):
    """``n`` windows of ``length`` bytes: inputs ``n x length``, targets (``IGNORE`` except the answer
    positions), the passkeys (``n x 4`` for ``content``, ``n x 5`` digits otherwise) and the (asked)
    needle's start positions.

    Layout of the ``length + 1`` bytes (``content``): haystack (``length - 4`` bytes, passkey inside it), ``?``,
    the passkey. ``depth`` in [0, 1] places the passkey at ``round(depth * (length - 8))``; ``None`` draws
    it uniformly per window (training). ``digits``: haystack, ``?``, the five digits; ``multikey``:
    haystack with ``keys`` named keys (four unless asked otherwise), ``?``, the asked name, its five digits;
    ``depth`` places the asked needle the same way. ``questions`` > 1 (multikey, for training): the window ends
    with that many questions (``?B90215?K48213...``), the first naming the needle placed at the depth and each later
    one a needle drawn at random (repeats allowed), and every answer is scored; the returned passkeys and starts
    are those of the first question's needle.
    """
    if questions != 1 and task != "multikey":
        raise PosencError(f"several questions are for the multikey task, not {task}")
    if questions < 1:
        raise PosencError(f"a window asks at least one question, got {questions}")
    if task not in TASKS:
        raise unknown_name("retrieval task", task, TASKS)
    if not 1 <= keys <= len(NAMES):
        raise PosencError(f"a multikey window holds 1 to {len(NAMES)} named keys, got {keys}")
    if task != "content":
        return _digit_windows(n, length, depth, generator, task, keys, questions)
    haystack = length - KEY_LEN
    if haystack < KEY_LEN:
        raise PosencError(f"a retrieval window needs at least {2 * KEY_LEN} bytes, got {length}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise PosencError(f"needle depth must lie in [0, 1], got {depth}")
    seq = FILLER[torch.randint(len(FILLER), (n, length + 1), generator=generator)]
    key = torch.stack([slot[torch.randint(len(slot), (n,), generator=generator)] for slot in SLOTS], dim=1)  # n 4
    last = haystack - KEY_LEN
    if depth is None:
        start = torch.randint(last + 1, (n,), generator=generator)
    else:
        start = torch.full((n,), round(depth * last))
    rows = torch.arange(n)[:, None]
    seq[rows, start[:, None] + torch.arange(KEY_LEN)] = key
    seq[:, haystack] = QUESTION
    seq[:, haystack + 1:] = key
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, :haystack] = IGNORE  # the loss is on the four answer bytes only
    return inputs.long(), targets.long(), key.long(), start


def describe_task(task: str = "content") -> dict:
    """The task's alphabets, as stored with the results: the filler bytes, the passkey's alphabet per slot, the
    question byte and the answer's length (and, for the digits and multikey tasks, the task's name; for multikey,
    the key names, the key count and the needle's form)."""
    if task == "content":
        return {"filler": FILLER.tolist(), "slots": [s.tolist() for s in SLOTS], "question": QUESTION,
                "answer_bytes": KEY_LEN}
    described = {"task": task, "filler": FILLER.tolist(), "slots": [DIGITS.tolist()] * DIGITS_LEN,
                 "question": QUESTION, "answer_bytes": DIGITS_LEN}
    if task == "multikey":  # the needle's form is recorded, so that a folder made with another form is refused
        described.update(names=NAMES.tolist(), keys=MULTIKEYS, needle="K48213;", question="?K")
    return described

