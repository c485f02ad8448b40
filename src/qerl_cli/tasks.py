"""Tasks and answer checking: GSM8K-style data, a generated arithmetic task, and rewards that tell a wrong
answer, an unparsable answer and a truncated completion apart."""

from __future__ import annotations

import functools
import hashlib
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from .errors import QerlError

CORRECT, WRONG, UNPARSABLE, TRUNCATED = "correct", "wrong", "unparsable", "truncated"

# a minus is a sign only where it does not follow a word character or a closing bracket ("9-2" ends in 2, not -2)
# and it touches its number ("12 - 5" ends in 5, not -5); a decimal may start at its point (".5" is 0.5, not 5)
_NUM = r"(?:(?<![\w.)\]])-(?=\$?\.?\d))?\$?\s?(?:\d[\d,]*(?:\.\d+)?|(?<!\d)\.\d+)"
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_HASHES = re.compile(r"####\s*(" + _NUM + r"(?:\s*/\s*\d+)?)")
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:)\s*(?:\*\*\s*)?(" + _NUM + r"(?:\s*/\s*\d+)?)", re.IGNORECASE)
_ANY_NUM = re.compile(_NUM + r"(?:\s*/\s*\d+)?")
# a number whose commas group its integer part in threes ("-1,234,567.5"), or one without commas
_GROUPED = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d*)?")
_FRAC = re.compile(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")


_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}")
_LATEX_SPACE = re.compile(r"\\[,!;: ]|~")


def _plain(text: str) -> str:
    """A boxed LaTeX answer as plain text: ``\\$`` and ``\\%`` dropped, ``{,}`` a comma, thin spaces (``\\,``
    ``\\!``) gone, ``\\text{..}`` unwrapped, and a unit word after the number dropped (``18 \\text{ apples}``)."""
    s = _LATEX_SPACE.sub("", text.replace("{,}", ",").replace("\\$", "$").replace("\\%", "%"))
    s = _TEXT.sub(r" \1 ", s).strip().rstrip("%").strip()
    m = re.fullmatch(r"(.*?\d\}?)\s+[A-Za-z]{2,}[A-Za-z ]*", s)  # (a number, then only words: the unit)
    return m.group(1) if m and not s.startswith("\\") else s


def parse_number(text: str) -> Fraction | None:
    """``"$1,080.00"`` → 1080, ``"\\frac{1}{2}"`` → 1/2, ``"3/4"`` → 3/4, ``"-7"`` → -7; None if not a number.
    LaTeX of a boxed answer reads as its text: ``\\$18``, ``1{,}080``, ``-\\frac{1}{2}``, ``18\\%``, ``5 \\text{ cm}``."""
    s = _plain(text.strip().rstrip(".")).rstrip(".").strip()
    sign, body = (-1, s[1:].strip()) if s.startswith("-\\") else (1, s)
    m = _FRAC.fullmatch(body)
    if m:
        try:
            return sign * Fraction(m.group(1)) / Fraction(m.group(2))
        except (ValueError, ZeroDivisionError):
            return None
    s = s.replace("$", "").replace(" ", "").rstrip(",")  # ("#### 15, so ..." ends its answer in a comma)
    if "," in s:  # a thousands separator only: "1,080" is 1080, but "1,5" (a list, or a decimal comma) is not 15
        if not all(_GROUPED.fullmatch(part) for part in s.split("/")):
            return None
        s = s.replace(",", "")
    if "/" in s:
        a, _, b = s.partition("/")
        try:
            return Fraction(a) / Fraction(b)
        except (ValueError, ZeroDivisionError):
            return None
    try:
        return Fraction(s)
    except ValueError:
        return None


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: ``\\boxed{}``, then ``#### x``, then "answer is x", then the last number."""
    for pattern in (_BOXED, _HASHES, _ANSWER_IS):
        found = [f for f in pattern.findall(completion) if f.strip()]  # (an empty \boxed{} holds no answer)
        if found:
            ans = found[-1].strip()
            # \boxed{x = 5}: the value after the last "=" (an equation is not itself a number)
            return ans.rsplit("=", 1)[-1].strip() if pattern is _BOXED and "=" in ans else ans
    nums = _ANY_NUM.findall(completion)
    return nums[-1].strip() if nums else None


def gold_answer(answer_field: str) -> str:
    """GSM8K gold: the text after ``####`` (or the whole field)."""
    m = _HASHES.search(answer_field)
    return m.group(1).strip() if m else answer_field.strip()


# the built-in checker's rules (parse_number, then exact string match): bump when they change
NUMERIC_CHECKER = {"name": "qerl.parse_number", "version": "3"}  # 2: LaTeX in a boxed answer; 3: a comma
# only as a thousands separator ("1,5" is no number, not 15)


@functools.lru_cache(maxsize=1)
def _math_verify():
    """(parse, verify, version) of math-verify when it is installed, else None (looked up once)."""
    try:
        from math_verify import parse, verify  # optional, more thorough (LaTeX, sets, units)
    except ImportError:
        return None
    try:
        from importlib.metadata import version

        v = version("math-verify")
    except Exception:  # (not installed as a distribution, e.g. a source tree on the path)
        import math_verify

        v = str(getattr(math_verify, "__version__", "unknown"))
    return parse, verify, v


def answer_checker() -> dict:
    """The checker ``answers_match`` uses here (name and version): math-verify when it is importable, else
    the built-in numeric match. Results can differ between them, so artifacts record it and key on it."""
    mv = _math_verify()
    return {"name": "math-verify", "version": mv[2]} if mv is not None else dict(NUMERIC_CHECKER)


def answers_match(pred: str, gold: str) -> bool:
    mv = _math_verify()
    if mv is not None:
        parse, verify, _ = mv
        return bool(verify(parse(gold), parse(pred)))
    a, b = parse_number(pred), parse_number(gold)
    if a is not None and b is not None:
        return a == b
    return pred.strip() == gold.strip()


@dataclass
class Outcome:
    reward: float
    status: str  # correct | wrong | unparsable | truncated
    extracted: str | None


# what may still follow a number that a completion ends in: more digits, a decimal point, a thousands comma, a
# fraction's slash, spaces (``#### 1`` cut off by the token limit may have been ``#### 12`` or ``#### 1.5``)
_NUMBER_GOES_ON = re.compile(r"[\d.,/ \t$]*")


def score(completion: str, gold: str, truncated: bool, format_reward: float = 0.0) -> Outcome:
    """Reward 1 for a correct final answer (+ ``format_reward`` for a non-empty ``####``/boxed answer), 0
    otherwise. A completion cut off by the token limit is ``truncated`` (reward 0) unless it already holds a
    complete marked final answer: a closed ``\boxed{}``, or a ``####`` answer that something other than the
    number's own characters follows (one that runs to the cut may be missing its last digits)."""
    boxed = any(b.strip() for b in _BOXED.findall(completion))
    hashes = list(_HASHES.finditer(completion))
    marked = boxed or bool(hashes)
    if truncated and not boxed and hashes and _NUMBER_GOES_ON.fullmatch(completion[hashes[-1].end():]):
        marked = False  # the last #### answer runs to the cut
    if truncated and completion.rfind("\\boxed{") > max((m.start() for m in _BOXED.finditer(completion)), default=-1):
        marked = False  # a \boxed{ after the last closed one never closed: the final answer was cut mid-way
    pred = extract_answer(completion)
    if truncated and not marked:
        return Outcome(0.0, TRUNCATED, pred)
    if pred is None:
        return Outcome(0.0, UNPARSABLE, None)
    ok = answers_match(pred, gold)
    bonus = format_reward if marked else 0.0
    return Outcome(1.0 + bonus if ok else bonus, CORRECT if ok else WRONG, pred)


# The reward function's identity (bump when the rules of ``score`` / ``extract_answer`` change): rollouts key
# their cache on it with the gold answers, as the rewards depend on both.
REWARD_FUNCTION = "qerl.tasks.score/7"  # 2: "9-2" ends in 2 (not -2); \boxed{x=5} is 5; 3: an empty \boxed{} is
# no answer (nor a format bonus), and a cut-off completion whose #### answer runs to the cut is truncated;
# 4: a spaced minus is not a sign ("12 - 5" ends in 5); 5: a leading-point decimal (".5") is 0.5, not 5
# 6: "answer is: x" and "answer is **x**" are stated answers; 7: a cut-off completion whose last \boxed{ is
# unclosed is truncated (an earlier closed \boxed{} was scored)


def verifier() -> dict:
    """What turns a completion and a gold answer into a reward, as recorded in artifacts and cache keys: the
    reward function and the answer checker that ran (name + version)."""
    return {"reward": REWARD_FUNCTION, "checker": answer_checker()}


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Problem:
    question: str
    answer: str  # gold final answer


SYSTEM_HINT = "Solve the problem. End your reply with the final answer after '####'."


def prompt_format() -> dict:
    """How ``chat_prompt`` turns a question into the model's prompt, beyond the tokenizer (whose chat template the
    model input keys): the system hint. rollout, evaluate and train record it and key on it, as another hint
    prompts other completions."""
    return {"system": SYSTEM_HINT}


def problems_from_rows(rows: list[dict], question_field: str = "question", answer_field: str = "answer") -> list[Problem]:
    out = []
    for i, r in enumerate(rows):
        if question_field not in r or answer_field not in r:
            raise QerlError(f"row {i} lacks the field '{question_field}' or '{answer_field}' (fields: {sorted(r)[:8]}).")
        if r[question_field] is None or r[answer_field] is None:
            raise QerlError(f"row {i} has no value (null) in '{question_field}' or '{answer_field}'.")
        out.append(Problem(str(r[question_field]), gold_answer(str(r[answer_field]))))
    return out


_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "coins")


def heldout_pair(a: int, b: int) -> bool:
    """Operand pairs reserved for the held-out split: a fixed hash of the unordered pair picks about one in five
    (22 of the 100 one-digit pairs; every digit occurs in some held-out pair, and a commuted pair stays on
    its side)."""
    lo, hi = min(a, b), max(a, b)
    return int(hashlib.sha256(f"qerl-heldout:{lo}:{hi}".encode()).hexdigest(), 16) % 5 == 0


def arithmetic_problems(n: int, seed: int, split: str = "train", difficulty: int = 1,
                        kinds: tuple[str, ...] = ("add", "mul", "word")) -> list[Problem]:
    """Generated problems: single-digit add / multiply and one-step word problems. ``difficulty`` d draws
    operands with d digits. The splits are disjoint in their operand pairs (``heldout_pair``), so no held-out
    question (nor its commuted form) is ever a training question; each split has its own seed stream."""
    if n < 0 or difficulty < 1:
        raise QerlError("arithmetic task needs n >= 0 and difficulty >= 1.")
    if split not in ("train", "heldout"):
        raise QerlError(f"the arithmetic task has splits 'train' and 'heldout', not '{split}'.")
    rng = random.Random(f"{split}:{seed}:{difficulty}")
    lo, hi = (0 if difficulty == 1 else 10 ** (difficulty - 1)), 10 ** difficulty - 1
    out = []
    for _ in range(n):
        kind = rng.choice(kinds)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        while heldout_pair(a, b) != (split == "heldout"):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if kind == "add":
            out.append(Problem(f"What is {a} + {b}?", str(a + b)))
        elif kind == "mul":
            out.append(Problem(f"What is {a} * {b}?", str(a * b)))
        else:
            who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            if rng.random() < 0.5:
                out.append(Problem(f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?", str(a + b)))
            else:
                out.append(Problem(f"{who} buys {a} bags with {b} {item} in each bag. How many {item} does {who} have?", str(a * b)))
    return out


MAX_GENERATED = 1_000_000  # problems of arith:N at most


def is_generated(spec: str) -> bool:
    """Whether ``spec`` names the generated arithmetic task (``arith`` or ``arith:N``) rather than a file or
    dataset (a file may well be called ``arithmetic.jsonl``)."""
    if spec == "arith":
        return True
    if not spec.startswith("arith:"):
        return False
    count = spec[len("arith:"):]
    if not (count.isascii() and count.isdigit()):  # (isdigit alone takes '²', which int() refuses)
        raise QerlError(f"{spec}: the generated task is 'arith' or 'arith:N' with N a whole number of problems.")
    if int(count) > MAX_GENERATED:  # (the problems are held in memory: a huge N ran the host out of it)
        raise QerlError(f"{spec}: the generated task holds at most {MAX_GENERATED:,} problems.")
    return True


def load_problems(spec: str, seed: int = 0, n: int | None = None, split: str = "train") -> list[Problem]:
    """``arith[:M]`` (generated, ``split`` train/heldout), or a jsonl/json/parquet file / HF dataset with
    question and answer fields. ``n`` (None/0 = all): the first ``n`` problems, for files and ``arith:M`` alike
    (``arith:M`` with ``n`` < M gives the first ``n`` of its M problems); plain ``arith`` generates ``n`` (256
    without ``n``). This is the one place that truncates (rollout's --num-prompts, evaluate's --num-examples)."""
    if is_generated(spec):
        _, _, count = spec.partition(":")
        k = int(count) if count else (n or 256)
        if n:  # the generator draws problem by problem: the first n of arith:M are arith:n's
            k = min(k, n)
        return arithmetic_problems(k, seed, split)
    from . import data

    probs = problems_from_rows(data.load_records(spec, split).rows)
    if not probs:
        raise QerlError(f"{spec} holds no problems.")
    return probs[:n] if n else probs


def chat_prompt(tokenizer, question: str) -> list[int]:
    """The prompt's token ids: the question after ``prompt_format``'s system hint, through the tokenizer's chat
    template where it has one (else plain text)."""
    system = prompt_format()["system"]
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    else:
        text = (system + "\n\n" if system else "") + question + "\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]
