"""Pure logic of the benchmark suite: paired ratios, exactness, the headline (``latest.json``), sweep winners.

No models and no processes here, so all of it is unit-tested in seconds (tests/test_bench_suite.py).

Run keys. One measurement of one configuration on one prompt set is keyed ``"<layout>/<mode>@b<batch>"``
(e.g. ``"extra-device/ssd-jit@b1"``) or ``"hf"`` / ``"hf-assisted"`` (transformers, batch 1); a repeat is a
dict ``key -> decode tok/s``. Ratios are always computed inside one repeat (measurements seconds apart) and
summarised by their median over repeats; across prompt sets they are combined by the geometric mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from report import common_prefix_len, median

EXTRA = "extra-device"
SAME = "same-hardware"
HF = "hf"
HF_ASSISTED = "hf-assisted"

TokS = dict[str, float | None]  # run key -> decode tok/s, one repeat


def run_key(layout: str, mode: str, batch: int) -> str:
    return f"{layout}/{mode}@b{batch}"


def paired(repeats: Sequence[TokS], num: str, dens: Sequence[str]) -> float | None:
    """Median over repeats of tok/s[num] / max(tok/s[d] for d in dens); None when anything is missing.

    With several denominators the numerator is compared with the best of them *in the same repeat*
    (e.g. SSD against the better of AR and SD on the same hardware)."""
    values = []
    for rep in repeats:
        top = [rep.get(d) for d in dens]
        if rep.get(num) is None or not top or any(v is None for v in top) or max(top) <= 0:
            continue
        values.append(rep[num] / max(top))
    return median(values)


def geomean(values: Sequence[float | None]) -> float | None:
    clean = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in clean) / len(clean)) if clean else None


def mean(values: Sequence[float | None]) -> float | None:
    clean = [v for v in values if v is not None]
    return sum(clean) / len(clean) if clean else None


# ---------------------------------------------------------------------------------------------- exactness
@dataclass
class Agreement:
    """How one output list compares with a reference (per prompt): identical, and the agreeing prefixes."""

    exact: bool
    agreeing_prefix: list[int]
    output_len: int

    @classmethod
    def of(cls, reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> "Agreement":
        n = min(len(reference), len(other))
        prefixes = [common_prefix_len(reference[i], other[i]) for i in range(n)]
        return cls(exact=len(reference) == len(other) and all(list(a) == list(b) for a, b in zip(reference, other)),
                   agreeing_prefix=prefixes, output_len=max((len(r) for r in reference), default=0))


def exactness_report(tokens: dict[str, list[list[int]]], num_prompts: int) -> dict[str, Any]:
    """Greedy exactness over the outputs of one prompt set, keyed like the run keys.

    ``exact`` (the verdict) requires: every speculative mode equals AR of the same layout and batch size, and
    ``transformers`` assisted equals ``transformers`` plain. Also reported, not part of the verdict: AR at
    every batch size / layout vs the first AR (batch shape changes GEMM rounding; in float32 it should agree)
    and ``transformers`` plain vs our first AR (another implementation: near-ties may break differently).
    Only the first ``num_prompts`` outputs of each run are compared (batches are padded by cycling).
    """
    per_run: dict[str, dict[str, Any]] = {}
    verdict = True
    ar_keys = sorted(k for k in tokens if "/ar@" in k)
    first_ar = tokens[ar_keys[0]][:num_prompts] if ar_keys else None
    for key, toks in tokens.items():
        if "/" not in key or "/ar@" in key:
            continue
        layout, rest = key.split("/", 1)
        ref_key = f"{layout}/ar@{rest.split('@', 1)[1]}"
        if ref_key not in tokens:
            continue
        agreement = Agreement.of(tokens[ref_key][:num_prompts], toks[:num_prompts])
        per_run[key] = asdict(agreement)
        verdict &= agreement.exact
    cross_ar = {k: asdict(Agreement.of(first_ar, tokens[k][:num_prompts])) for k in ar_keys} if first_ar else {}
    hf_assisted = None
    if HF in tokens and HF_ASSISTED in tokens:
        hf_assisted = asdict(Agreement.of(tokens[HF][:num_prompts], tokens[HF_ASSISTED][:num_prompts]))
        verdict &= hf_assisted["exact"]
    hf_vs_ours = asdict(Agreement.of(first_ar, tokens[HF][:num_prompts])) if first_ar and HF in tokens else None
    return {
        "exact": verdict,
        "vs_ar_same_shape": per_run,
        "ar_vs_first_ar": cross_ar,
        "ar_batch_invariant": all(a["exact"] for a in cross_ar.values()),
        "hf_assisted_vs_hf": hf_assisted,
        "hf_vs_our_ar": hf_vs_ours,
    }


# ---------------------------------------------------------------------------------------------- headline
def dataset_headline(repeats: Sequence[TokS], rows: dict[str, dict[str, dict[str, Any]]], batch: int,
                     ssd_mode: str) -> dict[str, Any]:
    """Headline numbers of one prompt set at one batch size.

    ``rows``: layout -> mode -> metrics (``mean_acceptance_length``, ``cache_hit_rate``, ``decode_tok_s``),
    i.e. bench_spec's summary for that batch size. ``transformers`` runs at batch 1 only, so the ratios
    against it are None at other batch sizes.
    """
    extra = rows.get(EXTRA, {})
    out: dict[str, Any] = {
        "sd_mean_acceptance_length": extra.get("sd", {}).get("mean_acceptance_length"),
        "ssd_mean_acceptance_length": extra.get(ssd_mode, {}).get("mean_acceptance_length"),
        "ssd_cache_hit_rate": extra.get(ssd_mode, {}).get("cache_hit_rate"),
        "ssd_over_ar": paired(repeats, run_key(EXTRA, ssd_mode, batch), [run_key(EXTRA, "ar", batch)]),
        "ssd_over_sd": paired(repeats, run_key(EXTRA, ssd_mode, batch), [run_key(EXTRA, "sd", batch)]),
        "sd_over_ar": paired(repeats, run_key(EXTRA, "sd", batch), [run_key(EXTRA, "ar", batch)]),
        # the draft-free baseline (prompt lookup alone), when the run has it
        "ngram_mean_acceptance_length": extra.get("ngram", {}).get("mean_acceptance_length"),
        "ngram_over_ar": paired(repeats, run_key(EXTRA, "ngram", batch), [run_key(EXTRA, "ar", batch)]),
        "ssd_over_ngram": paired(repeats, run_key(EXTRA, ssd_mode, batch), [run_key(EXTRA, "ngram", batch)]),
        # SD with an EAGLE-3 head, when the run has it
        "eagle3_mean_acceptance_length": extra.get("eagle3", {}).get("mean_acceptance_length"),
        "eagle3_over_ar": paired(repeats, run_key(EXTRA, "eagle3", batch), [run_key(EXTRA, "ar", batch)]),
        "eagle3_over_sd": paired(repeats, run_key(EXTRA, "eagle3", batch), [run_key(EXTRA, "sd", batch)]),
        # SSD with that head as its draft, when the run has it
        "ssd_eagle3_mean_acceptance_length": extra.get("ssd-eagle3", {}).get("mean_acceptance_length"),
        "ssd_eagle3_cache_hit_rate": extra.get("ssd-eagle3", {}).get("cache_hit_rate"),
        "ssd_eagle3_over_eagle3": paired(repeats, run_key(EXTRA, "ssd-eagle3", batch),
                                         [run_key(EXTRA, "eagle3", batch)]),
        "ssd_eagle3_over_ar": paired(repeats, run_key(EXTRA, "ssd-eagle3", batch), [run_key(EXTRA, "ar", batch)]),
        "ssd_over_best_same_hardware": paired(repeats, run_key(SAME, ssd_mode, batch),
                                              [run_key(SAME, "ar", batch), run_key(SAME, "sd", batch)]),
        "sd_over_hf_assisted": None,
        "ssd_over_hf_assisted": None,
        "hf_assisted_over_hf": None,
        **perfect_ssd(extra, batch),
    }
    if batch == 1:
        out["sd_over_hf_assisted"] = paired(repeats, run_key(EXTRA, "sd", 1), [HF_ASSISTED])
        out["ssd_over_hf_assisted"] = paired(repeats, run_key(EXTRA, ssd_mode, 1), [HF_ASSISTED])
        out["hf_assisted_over_hf"] = paired(repeats, HF_ASSISTED, [HF])
    keys = sorted({k for rep in repeats for k in rep if k.endswith(f"@b{batch}") or k in (HF, HF_ASSISTED)})
    out["decode_tok_s"] = {k: median([rep.get(k) for rep in repeats]) for k in keys}
    return out


def perfect_ssd(rows: dict[str, dict[str, Any]], batch: int) -> dict[str, float | None]:
    """The speed-ups over SD and AR of a *perfect* SSD: SD's rounds (same drafts, same acceptance, same
    verification) with SD's drafting taken off the critical path, as if every round were a cache hit served
    at once. ``rows``: mode -> metrics of one layout (the extra-device one).

    An SD round of ``batch`` sequences takes ``batch * MAL / tok_s`` seconds, of which the target waited
    ``draft_wait_ms_per_round`` for the draft; a perfect SSD saves exactly that wait. So
    ``perfect_ssd_over_sd = round / (round - wait)`` and ``perfect_ssd_over_ar`` is the perfect SSD's tok/s
    over AR's. Measured SSD can beat these only by verifying different drafts (shorter on a CPU, where every
    verified position costs time); they say how far a draft/target pair lets SSD go at all: a draft that takes
    20% of an SD round caps ``perfect_ssd_over_sd`` at 1.25."""
    sd, ar = rows.get("sd", {}), rows.get("ar", {})
    tok_s, mal, wait_ms = sd.get("decode_tok_s"), sd.get("mean_acceptance_length"), sd.get("draft_wait_ms_per_round")
    out: dict[str, float | None] = {"perfect_ssd_over_sd": None, "perfect_ssd_over_ar": None}
    if not tok_s or not mal or wait_ms is None:
        return out
    round_ms = 1e3 * batch * mal / tok_s
    if wait_ms >= round_ms:
        return out
    out["perfect_ssd_over_sd"] = round_ms / (round_ms - wait_ms)
    if ar.get("decode_tok_s"):
        out["perfect_ssd_over_ar"] = tok_s * out["perfect_ssd_over_sd"] / ar["decode_tok_s"]
    return out


RATIO_KEYS = ("ssd_over_ar", "ssd_over_sd", "sd_over_ar", "ssd_over_best_same_hardware", "sd_over_hf_assisted",
              "ssd_over_hf_assisted", "hf_assisted_over_hf", "ngram_over_ar", "ssd_over_ngram", "eagle3_over_ar",
              "eagle3_over_sd", "ssd_eagle3_over_eagle3", "ssd_eagle3_over_ar", "perfect_ssd_over_sd",
              "perfect_ssd_over_ar")
RATE_KEYS = ("sd_mean_acceptance_length", "ssd_mean_acceptance_length", "ssd_cache_hit_rate",
             "ngram_mean_acceptance_length", "eagle3_mean_acceptance_length", "ssd_eagle3_mean_acceptance_length",
             "ssd_eagle3_cache_hit_rate")


def headline(by_dataset: dict[str, dict[str, Any]], exact: bool | None, exact_basis: str,
             extra: dict[str, Any]) -> dict[str, Any]:
    """``latest.json``: per-dataset headlines combined (ratios: geometric mean; rates and tok/s: mean).

    ``extra`` carries the context (command line, machine, pair, batch size, SSD mode, ...)."""
    combined: dict[str, Any] = {"exact": exact, "exact_basis": exact_basis}
    for key in RATIO_KEYS:
        combined[key] = geomean([d.get(key) for d in by_dataset.values()])
    for key in RATE_KEYS:
        combined[key] = mean([d.get(key) for d in by_dataset.values()])
    tok_keys = sorted({k for d in by_dataset.values() for k in d.get("decode_tok_s", {})})
    combined["decode_tok_s"] = {k: mean([d["decode_tok_s"].get(k) for d in by_dataset.values()]) for k in tok_keys}
    combined["by_dataset"] = by_dataset
    combined.update(extra)
    return combined


# ---------------------------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class SweepSetting:
    """One SSD configuration of the sweep."""

    k: int
    fan_out: int | str | tuple[int, ...]
    saguaro_c: float

    @property
    def label(self) -> str:
        fan = ",".join(map(str, self.fan_out)) if isinstance(self.fan_out, tuple) else str(self.fan_out)
        return f"K={self.k} F={fan} c={self.saguaro_c:g}"

    def engine_fan_out(self) -> int | str | list[int]:
        return list(self.fan_out) if isinstance(self.fan_out, tuple) else self.fan_out


def best_settings(rows: Sequence[dict[str, Any]], score: str = "speedup_vs_ar") -> dict[str, dict[str, Any]]:
    """Per dataset, the sweep row with the highest ``score`` (rows without a score are ignored; the first
    row wins a tie, so list settings from cheapest to dearest)."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        value = row.get(score)
        if value is None:
            continue
        current = best.get(row["dataset"])
        if current is None or value > current[score]:
            best[row["dataset"]] = row
    return best
