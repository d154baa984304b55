"""`kvpage bench`: offline throughput of the engine on a seeded synthetic workload or a JSONL file."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{name} takes LOW:HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"{name} needs 1 <= LOW <= HIGH, got {text!r}")
    return low, high


@dataclass(slots=True)
class BenchResult:
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    preemptions: int
    peak_kv_usage: float
    failed: int

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(requests_per_s=self.requests / self.seconds, output_tokens_per_s=self.output_tokens / self.seconds,
                 total_tokens_per_s=(self.prompt_tokens + self.output_tokens) / self.seconds)  # fmt: skip
        return d

    def table(self) -> str:
        d = self.as_dict()
        rows = [("requests", f"{self.requests} ({self.failed} failed)"), ("prompt tokens", self.prompt_tokens),
                ("output tokens", self.output_tokens), ("seconds", f"{self.seconds:.1f}"),
                ("requests/s", f"{d['requests_per_s']:.2f}"), ("output tokens/s", f"{d['output_tokens_per_s']:.1f}"),
                ("total tokens/s", f"{d['total_tokens_per_s']:.1f}"), ("preemptions", self.preemptions),
                ("peak KV usage", f"{self.peak_kv_usage:.1%}")]  # fmt: skip
        return "\n".join(["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def run_bench(llm, *, num_requests: int, input_len: str, output_len: str, jsonl: str | None, seed: int) -> BenchResult:
    from tqdm.auto import tqdm

    from kvpage import SamplingParams

    engine = llm.llm_engine
    work: list[tuple[str | list[int], SamplingParams]] = []
    if jsonl:
        for i, line in enumerate(Path(jsonl).read_text().splitlines(), start=1):
            if line.strip():
                obj = json.loads(line)
                if "prompt" not in obj:
                    raise ValueError(f"{jsonl}:{i}: each line needs a 'prompt'")
                work.append((obj["prompt"], SamplingParams(temperature=0.0, max_tokens=obj.get("max_tokens", 128))))
    else:
        if num_requests < 1:
            raise ValueError("--num-requests must be positive")
        (i_lo, i_hi), (o_lo, o_hi) = _range(input_len, "--input-len"), _range(output_len, "--output-len")
        rng = random.Random(seed)
        vocab = engine.model_config.vocab_size
        for _ in range(num_requests):
            prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(i_lo, i_hi))]
            work.append((prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(o_lo, o_hi), ignore_eos=True)))
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"bench-{i}", prompt, params)
    done, failed, output_tokens, prompt_tokens, peak = 0, 0, 0, 0, 0.0
    start = time.perf_counter()
    with tqdm(total=len(work), desc="bench", dynamic_ncols=True) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done += 1
                    failed += out.error is not None
                    prompt_tokens += len(out.prompt_token_ids)
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
            peak = max(peak, engine.cache_stats().usage)
            bar.set_postfix_str(
                f"{output_tokens / max(time.perf_counter() - start, 1e-9):.1f} out tok/s", refresh=False
            )
    return BenchResult(len(work), prompt_tokens, output_tokens, time.perf_counter() - start,
                       engine.scheduler.num_preemptions, peak, failed)  # fmt: skip
