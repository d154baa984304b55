"""`kvpage generate` (prompts from the command line or a file) and `kvpage chat` (interactive, streamed):
an engine in this process answers, then the KV-cache statistics are printed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpage.cli.engine import add_engine_options, make_llm


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete prompts and print the cache statistics",
                       description="Complete prompts given as arguments or in a file (one per line), "
                       "print the completions and the KV-cache statistics.")  # fmt: skip
    p.add_argument("prompts", nargs="*", help="prompts to complete")
    p.add_argument("--file", help="a text file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _sampling_args(p)
    add_engine_options(p)
    p.set_defaults(func=_generate)


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat interactively, streaming; /stats shows the cache",
                       description="An interactive chat with the model's chat template, streamed token by token. "
                       "Commands: /stats (cache statistics), /reset (forget the conversation), /exit.")  # fmt: skip
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    add_engine_options(p)
    p.set_defaults(func=_chat)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens per completion at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="0 turns top-k off (default 0)")
    g.add_argument("-n", type=int, default=1, help="completions per prompt (default 1)")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling (default: none)")


def _sampling(args):
    from kvpage import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, n=args.n, seed=args.sampling_seed)  # fmt: skip


def _print_stats(st, out=sys.stdout) -> None:
    print(f"cache: {st.used_blocks}/{st.total_blocks} blocks used, {st.shared_blocks} shared, "
          f"{st.cached_blocks} cached, waste {st.waste:.1%}, prefix hits {st.prefix_hit_tokens}/"
          f"{st.prefix_query_tokens} tokens ({st.prefix_hit_rate:.0%})", file=out)  # fmt: skip


def _generate(args) -> int:
    prompts = list(args.prompts)
    if args.file:
        prompts += [line for line in Path(args.file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give prompts as arguments or with --file")
    params = _sampling(args)
    llm = make_llm(args)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for p, out in zip(prompts, outs, strict=True):
        print(f"=== {p}")
        if out.error:
            print(f"(failed: {out.error})")
        for c in out.outputs:
            label = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{label}{c.text}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    _print_stats(llm.cache_stats())
    return 0


def _chat(args) -> int:
    from kvpage import SamplingParams

    llm = make_llm(args)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kvpage chat: type a message; /stats shows the cache, /reset starts over, /exit or Ctrl-D quits")
    turn = 0
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/stats":
            _print_stats(llm.cache_stats())
            continue
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, tok.encode_chat(history), params)
        print("assistant> ", end="", flush=True)
        shown, text = 0, ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                print(text[shown:], end="", flush=True)
                shown = len(text)
        print()
        history.append({"role": "assistant", "content": text})
