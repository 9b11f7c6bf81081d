"""What the benchmarks run on: the results folder, the default model, the held-out chat prompts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


# Chat-style prompts: the first eight held-out evaluation prompts of the draft (train/eval_prompts.py, never
# used in its training), so benchmark numbers never reward memorised prompts; one list, kept there.
def load_eval_prompts():
    """The module ``train/eval_prompts.py`` (not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("eval_prompts", BENCH_DIR.parent / "train" / "eval_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHAT_PROMPTS = load_eval_prompts().CHAT_EVAL[:8]


def resolve_model(path: str | None) -> str:
    """The given checkpoint folder, or the project's default target (SmolLM2-135M-Instruct, fetched once)."""
    if path:
        if not Path(path).is_dir():
            raise SystemExit(f"model folder {path!r} does not exist")
        return str(Path(path).resolve())
    from ssd.models.fetch import fetch_default_target

    return str(fetch_default_target())


def chat_prompt_ids(model_path: str, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` chat prompts (cycled), identical for every engine under test."""
    from ssd.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    ids = [tok.apply_chat_template([{"role": "user", "content": text}]) for text in CHAT_PROMPTS]
    return [list(ids[i % len(ids)]) for i in range(num_prompts)]
