"""`Tokenizer`: text <-> token ids and the chat template, built on the `tokenizers` library.

Built either from a Hugging Face directory (tokenizer.json + tokenizer_config.json) or from GGUF
metadata (a byte-level BPE vocabulary with merges, as llama.cpp stores it). Saved in the Hugging
Face layout, so a converted GGUF loads like any model directory.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
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


CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens such as <|im_start|>

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
        self._literal: _HFTokenizer | None = None

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

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat text (for display; to tokenize it, use `encode_chat`)."""
        return self._render(messages, add_generation_prompt)

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> list[int]:
        """The conversation's token ids, where only the template's own markup becomes control tokens:
        a message containing "<|im_end|>" is tokenized as that text, never as the control token (else
        a user could open a system turn of their own). `continue_final_message`: the last message is
        left open (nothing of the template after its content), so the model continues it."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self._render(marked, add_generation_prompt)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        contents = [str(m.get("content") or "") for m in messages]
        plain = self._render(messages, add_generation_prompt)
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
        for i, part in enumerate(parts):
            if part:
                backend = self._literal_backend() if i % 2 else self.backend
                ids += _ids(backend, contents[int(part)] if i % 2 else part)
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

    def _literal_backend(self) -> _HFTokenizer:
        """A copy of the tokenizer that reads control-token texts as plain text."""
        if self._literal is None:
            literal = _HFTokenizer.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
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
            bos_token=tok(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=tok(self.eos_token_ids[0]) if self.eos_token_ids else "",
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported yet (only byte-level BPE, 'gpt2')")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]  # (none: bytes only)
        backend = _HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or []
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL_TOKEN]
        backend.add_special_tokens(special)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
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


def _ids(backend: _HFTokenizer, text: str) -> list[int]:
    """The text's ids, without special tokens. Through encode_batch: unlike encode, it releases the GIL, so
    a long prompt tokenized in a server's worker thread does not stall its event loop (same speed)."""
    return backend.encode_batch([text], add_special_tokens=False)[0].ids
