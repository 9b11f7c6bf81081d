"""Per-request sampling options.

Names and defaults follow vLLM so that users and the OpenAI-compatible server can pass options through
unchanged. Everything is validated here, once, at the API boundary: the sampler and the speculative
verifier then trust these values and never re-check them on the hot path.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from ssd.structured.spec import StructuredOutputs

MAX_LOGPROBS = 20  # the most top-n logprobs a request may ask for (OpenAI's limit)
_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts seeds up to this value


def _is_int(value: Any) -> bool:
    """True for real integers; bools are rejected because `True` as a token id or k is always a bug."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request samples its tokens and when it stops.

    temperature: 0 means greedy (argmax). top_k: 0 or -1 disables it (-1 is normalised to 0); top_k == 1
    is greedy too. top_p: nucleus mass in (0, 1]; 1 disables it. min_p: drop tokens whose probability is below
    min_p times the likeliest one's (0 disables it). seed: a per-request generator so the request's tokens do not
    depend on which other requests share its batch. stop: normalised to a list. logprobs: None for none, 0 for
    the chosen token's logprob only, n > 0 for the top-n as well.

    Penalties change the target's logits before any of that (``ssd/sample/penalties.py``), greedy requests
    included, at every position a step computes, a verified draft position counting the drafts before it as
    generated: logit_bias (token id -> added to its logit, in [-100, 100]), repetition_penalty (> 0, 1 = off:
    a token already in the prompt or the output has a positive logit divided by it, a negative one multiplied),
    frequency_penalty and presence_penalty (in [-2, 2], 0 = off: subtract the penalty times the token's count in
    the output, and once for any token in the output), in that order.

    structured_outputs (a :class:`StructuredOutputs` or its fields as a dict) constrains the output to a JSON
    schema, any JSON object, a regex, a grammar or a choice: every position's logits are masked to the tokens the
    grammar allows after the tokens before it (penalties first, then the mask), and the request ends as soon as
    the grammar is complete and allows nothing more (a grammar that allows only EOS also overrides min_tokens).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.from_value(self.structured_outputs)
        self._validate_numbers()
        self._validate_lengths()
        self._normalise_stops()
        self._validate_flags()

    def _validate_numbers(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}"
            )
        self.temperature = float(t)
        p = self.top_p
        if not _is_number(p) or not (0.0 < p <= 1.0):  # NaN fails both comparisons
            raise ValueError(f"top_p must be a number in (0, 1] (1 disables it), got {p!r}")
        self.top_p = float(p)
        k = self.top_k
        if not _is_int(k) or k < -1:
            raise ValueError(
                f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {k!r}"
            )
        if k == -1:
            self.top_k = 0
        m = self.min_p
        if not _is_number(m) or not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1] (0 disables it), got {m!r}")
        self.min_p = float(m)
        self._validate_penalties()
        s = self.seed
        if s is not None and (not _is_int(s) or not (0 <= s <= _MAX_SEED)):
            raise ValueError(f"seed must be None or an integer in [0, 2**64 - 1], got {s!r}")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not (0 <= lp <= MAX_LOGPROBS)):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] "
                f"(0 = the chosen token's logprob only), got {lp!r}"
            )

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 disables it), got {value!r}")
            setattr(self, name, float(value))
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {r!r}")
        self.repetition_penalty = float(r)
        bias = self.logit_bias
        if bias is None or bias == {}:
            self.logit_bias = None
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a map of token ids to numbers in [-100, 100], got {bias!r}")
        normalised = {}
        for token, value in bias.items():
            if isinstance(token, str) and token.strip().isdigit():  # JSON object keys are strings
                token = int(token)
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _is_number(value) or not (-100.0 <= value <= 100.0):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
            normalised[token] = float(value)
        self.logit_bias = normalised

    @property
    def has_penalties(self) -> bool:
        """Whether the target's logits change with the tokens before a position (or by a fixed bias)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0

    def _validate_lengths(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > "
                f"max_tokens={self.max_tokens}"
            )

    def _normalise_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)):
            stops = list(stop)
        else:
            raise ValueError(
                f"stop must be None, a string or a list of strings, got {stop!r}"
            )
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r} in stop={stop!r}")
        self.stop = stops
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of integers >= 0, got {ids!r}"
            )
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be a list of integers >= 0, got {t!r} in {list(ids)!r}"
                )
        self.stop_token_ids = list(ids)

    def _validate_flags(self) -> None:
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")

    @property
    def is_greedy(self) -> bool:
        """Greedy requests need no random draws and verify by argmax match."""
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self) -> SamplingParams:
        """A deep copy, so an engine may normalise its copy without touching the caller's object."""
        return copy.deepcopy(self)
