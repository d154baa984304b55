"""Jump-forward decoding: where a grammar allows exactly one continuation (a key's name, `":"`), its tokens are
appended to the sequence at once and computed in the next step as one chunk, instead of one decode step each.

The retokenization problem (SGLang's name for it): the forced text must become the tokens the model's own
tokenizer would give it in context, or the model reads a spelling it never saw. So the forced text is tokenized
together with the token sampled last, and kept so where that tokenization keeps that token as it is. Where the two
would merge (`{` sampled, `"name"` forced: the tokenizer spells `{"`), the token already sampled stands (SGLang
re-tokenizes it and recomputes its KV; here no computed token ever changes) and the forced text is spelled on its
own, as the model itself must then spell it. The last token is left out: it might merge with what follows the
forced text (`"` with the `:` after it), so the model samples it, under the grammar's mask, as it would have. Every
token appended is one the grammar accepts (checked on a copy of the sequence's matcher), none a stop token.

Forced tokens count as generated, pass the output processor's checks (max_tokens, stop strings) and are cached
like any others: the scheduler sees a sequence with several uncomputed tokens, as after a preemption.
"""

from __future__ import annotations

from kvpage.structured.matchers import Matcher


def forced_tokens(matcher: Matcher, last_token: int, tokenizer) -> list[int]:
    """The tokens to append after `last_token` (which `matcher` has accepted), in the tokenizer's own spelling;
    [] where the grammar forces nothing (or less than two tokens' worth)."""
    text = matcher.forced_text()
    if not text:
        return []
    before = tokenizer.decode([last_token], skip_special_tokens=False)
    if "\ufffd" in before:  # (half a character: its bytes merge with what follows)
        return []
    joint = tokenizer.encode(before + text, add_special_tokens=False)
    if joint[:1] == [last_token] and tokenizer.decode(joint, skip_special_tokens=False) == before + text:
        ids = joint[1:]
    else:  # the boundary would merge: the sampled token stands, the forced text is spelled on its own
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.decode([last_token, *ids], skip_special_tokens=False) != before + text:
            return []  # (a space the tokenizer adds before a text's start, as SentencePiece's does)
    out = []
    probe = matcher.copy()
    for t in ids[:-1]:  # (the last one left to the model)
        if not probe.accept(t):
            break
        out.append(t)
    return out
