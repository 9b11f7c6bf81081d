"""Offline API: ``LLM(model=...).generate(prompts, params)``, streaming, and chat."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from ssd.config import EngineConfig
from ssd.engine import LLMEngine
from ssd.outputs import RequestOutput, SpecStats
from ssd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """An engine plus the conveniences of batch generation.

    Keyword arguments are :class:`~ssd.config.EngineConfig` fields, e.g.
    ``LLM(model=path, dtype="float32", speculative_config={"method": "ssd", "model": draft, ...})``.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stats(self) -> SpecStats:
        """Engine-wide speculative counters since start."""
        return self.engine.spec_stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        request_ids = self._add_all(prompt_list, params)
        finished: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(prompt_list)) if use_tqdm else None
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[r] for r in request_ids]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield a :class:`RequestOutput` whenever a request gains tokens (``new_text`` holds the delta)."""
        prompt_list = _as_prompt_list(prompts)
        request_ids = self._add_all(prompt_list, _as_params_list(sampling_params, len(prompt_list)))
        try:
            while self.engine.has_unfinished():
                yield from self.engine.step()
        finally:  # a consumer that stops early (break, exception) must not leave requests holding KV blocks
            for request_id in request_ids:
                self.engine.abort(request_id)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        # Validate everything first so one bad prompt rejects the call without leaving half of it queued.
        encoded = [self.engine.encode_prompt(p) for p in prompts]
        return [self.engine.add_request(p, sp).request_id for p, sp in zip(encoded, params)]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single list of token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return params


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
