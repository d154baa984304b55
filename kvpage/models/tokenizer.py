"""`Tokenizer`: text <-> token ids and the chat template, built on the `tokenizers` library.

Built either from a Hugging Face directory (tokenizer.json + tokenizer_config.json) or from GGUF
metadata, as llama.cpp stores a vocabulary: a byte-level BPE with merges ("gpt2"), or SentencePiece's
pieces with their scores ("llama": Gemma, Llama 2, Mistral 7B), read as SentencePiece's BPE reads them.
Saved in the Hugging Face layout, so a converted GGUF loads like any model directory.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

# tokenizer.json parsed once per process and file version (a 49k-token vocabulary takes ~0.1 s to parse):
# the parsed tokenizer is never changed after it is built, so every Tokenizer of that file shares it
_PARSED: dict[tuple[str, int, int], _HFTokenizer] = {}


def _parsed(file: Path) -> _HFTokenizer:
    st = file.stat()
    key = (str(file.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _PARSED:
        _PARSED[key] = _HFTokenizer.from_file(str(file))
    return _PARSED[key]


# llama.cpp's token types (SentencePiece's): special tokens such as <|im_start|> are CONTROL
NORMAL, UNKNOWN, CONTROL_TOKEN, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space

# How llama.cpp's pre-tokenizer types split text before BPE (see its llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in (None, "default", "gpt2", "gpt-2"):
        split = [pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")]
    elif pre == "smollm":  # every digit on its own, then GPT-2's rules (as SmolLM's own tokenizer.json)
        split = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Split(Regex(_GPT2_SPLIT), "isolated")]
    elif pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe"):
        split = [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")]
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        split = [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")]
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported yet")
    return pre_tokenizers.Sequence([*split, byte_level])


class Tokenizer:
    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._template = None  # the compiled chat template
        self._variants: dict[tuple[bool, bool], _HFTokenizer] = {}
        self._space_prefix: bool | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _ids(self.backend, text)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:  # fmt: skip
        """The conversation as the model's chat text (for display; to tokenize it, use `encode_chat`)."""
        return self._render(messages, add_generation_prompt, tools)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The conversation's token ids, where only the template's own markup becomes control tokens:
        a message containing "<|im_end|>" is tokenized as that text, never as the control token (else
        a user could open a system turn of their own). `continue_final_message`: the last message is
        left open (nothing of the template after its content), so the model continues it."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self._render(marked, add_generation_prompt, tools)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        contents = [str(m.get("content") or "") for m in messages]
        plain = self._render(messages, add_generation_prompt, tools)
        if "".join(contents[int(p)] if i % 2 else p for i, p in enumerate(parts)) != plain:
            # the template transforms content (strips it, say): it cannot be split around it
            specials = [t for t in self.special_token_texts if any(t in c for c in contents)]
            if specials:
                raise ValueError(f"message content must be text; it contains the control token {specials[0]!r}")
            if continue_final_message:
                final = contents[-1].strip()
                if not final or final not in plain:
                    raise ValueError("continue_final_message: the final message's content is not in the chat text")
                plain = plain[: plain.rindex(final) + len(final)]
            return self._encode_rendered(plain)
        if continue_final_message:
            if len(parts) < 2 or int(parts[-2]) != len(messages) - 1:
                raise ValueError("continue_final_message: the chat template does not end with the final message")
            parts = parts[:-1]  # the template's text after the final message's content (its end of turn)
        ids = [self.bos_token_id] if self._needs_bos(rendered) else []
        started = False  # (a tokenizer that puts a space before the text puts it before the first part only)
        for i, part in enumerate(parts):
            if part:
                backend = self._variant(literal=bool(i % 2), continuation=started and self._prefixes)
                ids += _ids(backend, contents[int(part)] if i % 2 else part)
                started = True
        return ids

    def _needs_bos(self, rendered: str) -> bool:
        """BOS goes first when the tokenizer adds one, unless the template wrote it already."""
        if not self.add_bos_token or self.bos_token_id is None:
            return False
        bos = self.backend.id_to_token(self.bos_token_id)
        return not (bos and rendered.startswith(bos))

    def _encode_rendered(self, rendered: str) -> list[int]:
        return self.encode(rendered, add_special_tokens=self._needs_bos(rendered))

    @property
    def special_token_texts(self) -> list[str]:
        return [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]

    def _variant(self, literal: bool, continuation: bool) -> _HFTokenizer:
        """The tokenizer, or a copy that reads control-token texts as plain text (`literal`) and puts no space
        before the text (`continuation`: a part of a text after its start)."""
        if not (literal or continuation):
            return self.backend
        if (literal, continuation) not in self._variants:
            spec = json.loads(self.backend.to_str())
            if continuation:
                _no_space_prefix(spec)
            variant = _HFTokenizer.from_str(json.dumps(spec))
            variant.encode_special_tokens = literal
            self._variants[literal, continuation] = variant
        return self._variants[literal, continuation]

    @property
    def _prefixes(self) -> bool:
        """Whether the tokenizer puts a space before the text (SentencePiece's dummy prefix)."""
        if self._space_prefix is None:
            spec = json.loads(self.backend.to_str())
            self._space_prefix = json.dumps(spec) != json.dumps(_no_space_prefix(spec))
        return self._space_prefix

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        if self._template is None:  # compiled once
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        tok = self.backend.id_to_token
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,  # (OpenAI's tool definitions, for templates that show them: Hugging Face's convention)
            bos_token=tok(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=tok(self.eos_token_ids[0]) if self.eos_token_ids else "",
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if kind == "gpt2":
            vocab = {t: i for i, t in enumerate(tokens)}
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]  # (none: bytes only)
            backend = _HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
            backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
            backend.decoder = decoders.ByteLevel()
        elif kind == "llama":
            prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # (llama.cpp's default)
            backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), types, space_prefix=prefix)
        else:
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' and SentencePiece 'llama')"
            )
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL_TOKEN]
        )
        # (user-defined pieces are matched whole in any text, as llama.cpp and SentencePiece match them)
        backend.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=end_of_generation_ids(meta),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        )

    @classmethod
    def from_dir(cls, path: Path, eos_token_ids: list[int] | None = None) -> Tokenizer | None:
        """From tokenizer.json (+ tokenizer_config.json); None when the directory has no tokenizer."""
        if not (path / "tokenizer.json").exists():
            return None
        backend = _parsed(path / "tokenizer.json")
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())

        def token_id(value) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else value

        eos = list(eos_token_ids or [])
        cfg_eos = token_id(cfg.get("eos_token"))
        if cfg_eos is not None and cfg_eos not in eos:
            eos.insert(0, cfg_eos)
        return cls(
            backend,
            bos_token_id=token_id(cfg.get("bos_token")),
            eos_token_ids=eos,
            chat_template=cfg.get("chat_template"),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )

    def save(self, path: Path) -> None:
        self.backend.save(str(path / "tokenizer.json"))
        tok = self.backend.id_to_token
        cfg = {
            "bos_token": tok(self.bos_token_id) if self.bos_token_id is not None else None,
            "eos_token": tok(self.eos_token_ids[0]) if self.eos_token_ids else None,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _no_space_prefix(spec: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer.json's spec (changed in place) with no space put before the text: no Prepend normalizer, and
    a Metaspace pre-tokenizer that prepends never."""
    for key in ("normalizer", "pre_tokenizer"):
        part = spec.get(key) or {}
        for step in [part, *(part.get("normalizers") or part.get("pretokenizers") or [])]:
            if step.get("type") == "Metaspace":
                step["prepend_scheme"] = "never"
        if part.get("type") == "Prepend":
            spec[key] = None
        elif part.get("type") == "Sequence":
            kids = "normalizers" if key == "normalizer" else "pretokenizers"
            part[kids] = [step for step in part[kids] if step.get("type") != "Prepend"]
    return spec


def end_of_generation_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end a generation: the file's EOS, its end-of-turn and end-of-message tokens, and Gemma's
    <end_of_turn> (its GGUFs name no end of turn; llama.cpp finds it by its text)."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens:
        ids.append(tokens.index("<end_of_turn>"))
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, types: list[int], space_prefix: bool):
    """SentencePiece's BPE as a `tokenizers` BPE. SentencePiece joins, again and again, the adjacent pair
    whose joined piece is a normal piece of the highest score (the leftmost of equals); a BPE whose merges are
    every split of each normal piece in two normal pieces, ranked by the joined piece's score, joins the same
    pairs in the same order. A character outside the vocabulary falls back to its UTF-8 bytes' <0xXX> pieces
    (or <unk>). Spaces are SentencePiece's visible space; `space_prefix`: one is put before the text (and
    after each special token, as llama.cpp does)."""
    scores = scores if scores is not None else [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    ranked = sorted(
        (-scores[i], i, k, t[:k], t[k:])
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty == NORMAL
        for k in range(1, len(t))
        if t[:k] in normal and t[k:] in normal
    )
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    backend = _HFTokenizer(models.BPE(vocab, [(a, b) for *_, a, b in ranked], unk_token=unk, fuse_unk=True,
                                      byte_fallback=any(ty == BYTE for ty in types)))  # fmt: skip
    spaces = [normalizers.Replace(" ", SPACE)]
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), *spaces] if space_prefix else spaces)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    return backend


def _ids(backend: _HFTokenizer, text: str) -> list[int]:
    """The text's ids, without special tokens. Through encode_batch: unlike encode, it releases the GIL, so
    a long prompt tokenized in a server's worker thread does not stall its event loop (same speed)."""
    return backend.encode_batch([text], add_special_tokens=False)[0].ids
