"""`LLM`: the offline API, with vLLM's names.

llm = LLM(model="smollm2", dtype="bfloat16", kv_cache_memory="512MiB", enable_prefix_caching=True)
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
llm.chat([{"role": "user", "content": "Hi"}])
llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=4, max_tokens=16))
llm.generate([{"segments": [doc_a, doc_b, question]}])   each document's KV reused wherever it stands
llm.cache_stats()
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from kvpage.config import EngineConfig
from kvpage.core import CacheStats
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.segment_prompts import SegmentedPrompt
from kvpage.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams

# (vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts are accepted too, and {"segments": [...]}:
# a prompt whose segments reuse their own cached KV wherever they stand, engine/segment_prompts.py)
Prompt = str | list[int] | SegmentedPrompt


class LLM:
    def __init__(self, model: str = "smollm2", **kwargs) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop a tensor-parallel group's other ranks (also done at exit); a single-process LLM holds
        nothing that needs it."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def verify_kv_cache(self, sample: int = 4):
        """The KV cache checked: every used block finite and in range; in deterministic mode also
        `sample` cached prefix chains recomputed and compared bit for bit. A KVVerifyReport."""
        return self.llm_engine.verify_kv_cache(sample)

    def cache_stats(self) -> CacheStats:
        return self.llm_engine.cache_stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams | BeamSearchParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(prompt_list)} prompts; give one or one each"
                )
        return self._run(prompt_list, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        # token ids, so that message content never becomes control tokens (see Tokenizer.encode_chat)
        prompts = [tok.encode_chat(list(c), add_generation_prompt) for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, c in zip(outs, conversations, strict=True):
            out.prompt = tok.apply_chat_template(list(c), add_generation_prompt)
        return outs

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """One BeamSearchOutput per prompt: a RequestOutput whose outputs are the final beams, best
        first, and whose `sequences` are the same beams in vLLM's shape (prompt + generated tokens)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        prompt_list = _as_prompt_list(prompts)
        outs = self._run(prompt_list, [params] * len(prompt_list), use_tqdm)
        return [_beam_search_output(out, self.llm_engine.tokenizer) for out in outs]

    def _run(self, prompts: list[Prompt], params: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            for rid in ids:  # nothing half-submitted stays behind
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, generated0 = time.perf_counter(), engine.num_generation_tokens
        wanted = set(ids)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    rate = (engine.num_generation_tokens - generated0) / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]


def _beam_search_output(out: RequestOutput, tokenizer) -> BeamSearchOutput:
    fields = {name: getattr(out, name) for name in RequestOutput.__dataclass_fields__}
    sequences = []
    for c in out.outputs:
        tokens = out.prompt_token_ids + c.token_ids
        sequences.append(BeamSearchSequence(tokens, c.logprobs or [], c.cumulative_logprob or 0.0,
                                            tokenizer.decode(tokens, skip_special_tokens=False),
                                            c.finish_reason, c.stop_reason))  # fmt: skip
    return BeamSearchOutput(**fields, sequences=sequences)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [_one_prompt(prompts)]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes):
        out = [_one_prompt(p) for p in prompts]
        if not out:
            raise ValueError("prompts is empty")
        return out
    raise ValueError("prompts must be a string, a list of strings, or a list of token-id lists")


def _one_prompt(p) -> Prompt:
    """A string, a list of token ids, vLLM's {"prompt": str} / {"prompt_token_ids": [int, ...]}, or
    {"segments": [str | [int, ...], ...], "recompute_blocks": int, "recompute_ratio": float}."""
    if isinstance(p, SegmentedPrompt):
        return p
    if isinstance(p, dict) and "segments" in p:
        unknown = sorted(set(p) - {"segments", "recompute_blocks", "recompute_ratio"})
        if unknown:
            raise ValueError(f"unsupported prompt field(s) {unknown}: a prompt of segments takes 'segments', "
                             "'recompute_blocks' and 'recompute_ratio'")  # fmt: skip
        return SegmentedPrompt.parse(p["segments"], p.get("recompute_blocks", 1), p.get("recompute_ratio", 0.0))
    if isinstance(p, dict):
        unknown = sorted(set(p) - {"prompt", "prompt_token_ids"})
        if unknown:
            raise ValueError(
                f"unsupported prompt field(s) {unknown}: a prompt dict takes 'prompt' or 'prompt_token_ids'"
            )
        if ("prompt" in p) == ("prompt_token_ids" in p):
            raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        p = p.get("prompt", p.get("prompt_token_ids"))
        if isinstance(p, tuple):
            p = list(p)
    if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))):
        raise ValueError("each prompt must be a string or a list of token ids")
    return p
