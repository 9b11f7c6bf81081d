"""The ``transformers`` baseline inside a benchmark worker: plain and assisted ``generate`` on the same ids."""

from __future__ import annotations

import os
import time
from typing import Any

from report import median


class HFRunner:
    """``transformers`` baseline: ``AutoModelForCausalLM.generate`` (optionally assisted) on the same ids."""

    def __init__(
        self,
        model: str,
        assistant: str | None = None,
        num_assistant_tokens: int = 4,
        warmup_prompt: list[int] | None = None,
        warmup_batch: int = 1,
        dtype: str = "bfloat16",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch = torch
        torch_dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
        config = self.model.generation_config
        eos = config.eos_token_id
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        )
        self.assistant = None
        if assistant is not None:
            # A separate copy even when assistant == model: HF keeps separate caches, as our SD does.
            self.assistant = load_hf_assistant(assistant, torch_dtype)
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = num_assistant_tokens  # same K as our engine ...
            gc.num_assistant_tokens_schedule = "constant"  # ... kept fixed (HF's default adapts it)
            gc.assistant_confidence_threshold = 0.0  # never stop drafting early on low confidence
        self._target_calls = 0
        self.model.register_forward_hook(self._count_target_call)
        if warmup_prompt is not None:
            self.generate([warmup_prompt] * warmup_batch, output_len=8, batch=warmup_batch)
            if self.assistant is not None:
                self.generate([warmup_prompt], output_len=8, batch=1, assisted=True)

    def _count_target_call(self, module, args, output) -> None:
        self._target_calls += 1

    def generate(self, prompts: list[list[int]], output_len: int, batch: int, assisted: bool = False,
                 temperature: float = 0.0, seed: int | None = None) -> dict[str, Any]:
        """Exactly ``output_len`` new tokens (EOS ignored via min_new_tokens), left padding for batches; greedy
        unless ``temperature`` > 0 (then sampled, torch seeded with ``seed + chunk index`` when a seed is given).

        A streamer timestamps every emission. As for our engine, decode throughput counts the tokens after
        the first emission (assisted decoding's first round already emits up to K+1) over the time after it.
        """
        torch = self.torch
        from transformers.generation.streamers import BaseStreamer

        if assisted and (self.assistant is None or batch != 1):
            raise ValueError("assisted generation needs an assistant model and batch 1")

        class Clock(BaseStreamer):
            def __init__(self) -> None:
                self.puts = 0
                self.first: tuple[float, int] | None = None  # (time, tokens per row) of the first emission

            def put(self, value) -> None:
                self.puts += 1
                if self.puts == 1:
                    return  # the prompt
                if self.first is None:
                    self.first = (time.perf_counter(), value.shape[-1] if value.dim() == 2 else 1)

            def end(self) -> None:
                pass

        tokens: list[list[int]] = []
        decode_s = 0.0
        decode_tokens = 0
        ttft: list[float] = []
        calls0 = self._target_calls
        cpu0 = time.process_time()
        wall_start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # [B, L]
            mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, L]
            for row, p in enumerate(chunk):
                input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            clock = Clock()
            kwargs: dict[str, Any] = dict(
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=temperature > 0,
                pad_token_id=self.pad_id,
                streamer=clock,
            )
            if temperature > 0:
                kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
                if seed is not None:
                    torch.manual_seed(seed + i)
            if assisted:
                kwargs["assistant_model"] = self.assistant
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids, **kwargs)  # [B, L + N]
            end = time.perf_counter()
            new = out[:, width:].tolist()
            tokens.extend(new)
            if clock.first is not None:
                first_time, first_tokens = clock.first
                ttft.append(first_time - start)
                decode_s += end - first_time
                decode_tokens += sum(len(t) - first_tokens for t in new)
        wall_s = time.perf_counter() - wall_start
        cpu_s = time.process_time() - cpu0
        total = sum(len(t) for t in tokens)
        calls = self._target_calls - calls0
        result: dict[str, Any] = {
            "tokens": tokens,
            "decode_tokens": decode_tokens,
            "decode_s": decode_s,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
            "wall_s": wall_s,
            "e2e_tok_s": total / wall_s,
            "ttft_s": median(ttft),
            "cpu_share": cpu_s / (wall_s * torch.get_num_threads()),
            "load_avg_1m": os.getloadavg()[0],
            "target_forward_calls": calls,
        }
        if assisted:
            # Every assisted round is one target forward over the candidates (the first one includes the
            # prompt), emitting accepted + 1 tokens: tokens per target call is HF's mean acceptance length.
            result["mean_acceptance_length"] = total / calls if calls else None
        return result


def load_hf_assistant(path: str, torch_dtype: Any) -> Any:
    """A ``transformers`` model for assisted generation from one of our draft folders.

    A draft with a reduced vocabulary (``draft_vocab.json``, ``ssd.models.draft_vocab``) embeds and predicts
    only a subset of the target's ids, and ``generate(assistant_model=...)`` rejects an assistant whose vocab
    size differs from the target's (it would then need two tokenizers and retokenise text). So the model is
    wrapped with two hooks that keep its own small head: target ids are mapped to draft ids before the
    embedding, and the [.., Vd] logits are scattered into [.., V_target] logits with every id the draft cannot
    produce at the dtype's minimum. Greedy drafts are then exactly our engine's (argmax over the subset);
    sampled drafts give those ids probability 0, as our engine's q does.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from ssd.models.draft_vocab import DraftVocab

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    vocab = DraftVocab.load(path)
    if vocab is None:
        return model
    to_draft = torch.from_numpy(vocab.target_to_draft())  # [V_target]
    known = torch.from_numpy(vocab.draft_to_target >= 0)  # [Vd]
    columns = torch.from_numpy(vocab.draft_to_target[vocab.draft_to_target >= 0])  # [Vd - 1] target ids
    target_vocab = vocab.target_vocab_size

    def map_inputs(module, args):
        return (to_draft[args[0]],) + tuple(args[1:])  # [B, L] target ids -> draft ids

    def widen_logits(module, args, output):
        full = output.new_full((*output.shape[:-1], target_vocab), torch.finfo(output.dtype).min)  # [B, L, V]
        full[..., columns] = output[..., known]
        return full

    model.get_input_embeddings().register_forward_pre_hook(map_inputs)
    model.get_output_embeddings().register_forward_hook(widen_logits)
    model.config.get_text_config().vocab_size = target_vocab  # what generate() compares with the target's
    return model
