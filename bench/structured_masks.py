"""How long does a grammar library take to compute the next-token mask, at the default target's vocabulary?

Structured outputs mask the target's logits at every verified position, so the library's mask time is paid per
token on the critical path (under SD and SSD once per verified row). This walks each constraint below along a
valid document's tokens (the target's tokenizer) and times, per token, filling the bitmask and advancing the
state; it records the one-time compile. Libraries that are not installed are reported as missing; install them
to compare (``pip install --no-deps xgrammar apache-tvm-ffi outlines-core``; xgrammar otherwise pulls triton).

    python bench/structured_masks.py [--model PATH] [--json bench/results/structured_masks.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine_info  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "employed"],
    "additionalProperties": False,
}
DOCUMENT = '{"name": "Ada Lovelace", "age": 36, "languages": ["English", "French", "Mathematics"], "employed": false}'
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_TEXT = "415-555-0134 ext. 1207"

CASES = {
    "json_object": ({"type": "object"}, DOCUMENT),
    "json_schema": (SCHEMA, DOCUMENT),
    "regex": (REGEX, REGEX_TEXT),
}


def _summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {"mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2], "max_ms": ms[-1]}


def _walk(fill: Callable[[], None], advance: Callable[[int], bool], tokens: list[int]) -> dict[str, Any]:
    masks, steps = [], []
    for t in tokens:
        start = time.perf_counter()
        fill()
        masks.append(time.perf_counter() - start)
        start = time.perf_counter()
        ok = advance(t)
        steps.append(time.perf_counter() - start)
        if not ok:
            return {"error": f"token {t} rejected"}
    return {"tokens": len(tokens), "mask": _summary(masks), "advance": _summary(steps)}


def bench_llguidance(hf_tok: Any, vocab: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    out: dict[str, Any] = {"version": llguidance.get_version(), "tokenizer_s": time.perf_counter() - start}
    for name, (spec, text) in CASES.items():
        kind = "regex" if name == "regex" else "json_schema"
        start = time.perf_counter()
        grammar = llguidance.grammar_from(kind, spec if kind == "regex" else json.dumps(spec))
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - start
        mask = llguidance.torch.allocate_token_bitmask(1, vocab)
        res = _walk(
            lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask),
            matcher.consume_token,
            hf_tok.encode(text, add_special_tokens=False),
        )
        out[name] = {"compile_s": compile_s, **res}
    return out


def bench_xgrammar(hf_tok: Any, vocab: int) -> dict[str, Any]:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - start}
    for name, (spec, text) in CASES.items():
        start = time.perf_counter()
        if name == "regex":
            compiled = compiler.compile_regex(spec)
        elif name == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_json_schema(json.dumps(spec))
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - start
        mask = xgrammar.allocate_token_bitmask(1, vocab)
        res = _walk(lambda: matcher.fill_next_token_bitmask(mask), matcher.accept_token,
                    hf_tok.encode(text, add_special_tokens=False))
        out[name] = {"compile_s": compile_s, **res}
    return out


def bench_outlines_core(hf_tok: Any, vocab: int) -> dict[str, Any]:
    """outlines-core compiles regular expressions only (a JSON schema becomes a regex; no grammars)."""
    import outlines_core
    import torch
    from outlines_core.json_schema import build_regex_from_schema

    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    start = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    eos = hf_tok.eos_token_id
    for token, idx in hf_tok.get_vocab().items():
        if idx == eos:
            continue
        try:
            table.setdefault(bytes(byte_of[c] for c in token), []).append(idx)
        except KeyError:  # special tokens outside the byte alphabet
            continue
    vocabulary = outlines_core.Vocabulary(eos, table)
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - start}
    for name, (spec, text) in CASES.items():
        start = time.perf_counter()
        regex = spec if name == "regex" else build_regex_from_schema(json.dumps(spec))
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        compile_s = time.perf_counter() - start
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        res = _walk(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
                    lambda t: guide.advance(t) is not None, hf_tok.encode(text, add_special_tokens=False))
        out[name] = {"compile_s": compile_s, **res}
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte maps to a printable character (the tokenizer's vocabulary form)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines_core": bench_outlines_core}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the default target, fetched)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ssd.models.fetch import fetch_default_target

    path = args.model or str(fetch_default_target())
    hf_tok = AutoTokenizer.from_pretrained(path)
    vocab = len(hf_tok)
    results: dict[str, Any] = {"machine": machine_info(), "model": path, "vocab_size": vocab}
    for name, run in LIBRARIES.items():
        try:
            results[name] = run(hf_tok, vocab)
        except ImportError as exc:
            results[name] = {"missing": str(exc)}
        except Exception as exc:  # a library's failure is a result to report, not a crash
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {json.dumps(results[name], indent=1)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
