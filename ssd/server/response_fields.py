"""The fields of the server's OpenAI responses that carry more than text: usage (with this request's speculative
counters), vLLM's per-request ``metrics``, and logprobs in the completions and chat shapes."""

from __future__ import annotations

from typing import Any

from ssd.outputs import SpecStats
from ssd.server.messages import LogprobEntry


def usage_dict(
    num_prompt_tokens: int,
    num_output_tokens: int,
    num_cached_tokens: int,
    spec: SpecStats | None,
    speculation: str,
    num_first_step_tokens: int = 0,
) -> dict[str, Any]:
    """OpenAI usage, plus ``speculative`` (this request's own speculative counters) when the engine speculates.
    ``num_first_step_tokens`` (summed over choices) is what each choice's first emitting step produced: up to
    K + 1 with speculation, so a client timing the stream can leave them out of its decode rate."""
    usage: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
    if spec is not None:
        usage["speculative"] = {
            "method": speculation,
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "num_emitted_tokens": spec.num_emitted_tokens,
            "num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
            "num_copied_tokens": spec.num_copied_tokens,
            "num_accepted_copied_tokens": spec.num_accepted_copied_tokens,
            "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length,
            "cache_lookups": spec.cache_lookups,
            "cache_hits": spec.cache_hits,
            "cache_hit_rate": spec.cache_hit_rate,
            "fallbacks": dict(spec.fallbacks),
            "num_first_step_tokens": num_first_step_tokens,
        }
    return usage


def response_metrics(spec: SpecStats | None, num_choices: int) -> dict[str, Any] | None:
    """A response's per-request ``metrics`` in vLLM's place for them: ``speculative_decoding`` (steps, draft and
    accepted tokens, mean acceptance length with the bonus token, draft acceptance rate, and the histogram of
    accepted drafts per step with its zero buckets left out), plus SSD's cache lookups and hits and the fallbacks
    that served its misses. None without speculation, and for n > 1 (as vLLM: they describe one stream)."""
    if spec is None or num_choices != 1:
        return None
    histogram = {str(k): n for k, n in enumerate(spec.acceptance_histogram) if n}
    return {"speculative_decoding": {
        "num_spec_steps": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "mean_acceptance_length": spec.mean_acceptance_length,
        "draft_acceptance_rate": spec.acceptance_rate,
        "acceptance_histogram": histogram,
        "cache_lookups": spec.cache_lookups,
        "cache_hits": spec.cache_hits,
        "fallbacks": dict(spec.fallbacks),
    }}


def completion_logprobs(entries: list[LogprobEntry], offset: int) -> dict[str, Any]:
    """Legacy completions logprobs; ``offset`` is the text offset of the first entry."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top.append({text: lp for _, text, lp in e.top} if e.top else None)
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode("utf-8")),
                "top_logprobs": [
                    {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))} for _, text, lp in e.top
                ],
            }
            for e in entries
        ]
    }
