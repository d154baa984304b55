"""vLLM's POST /tokenize and /detokenize: the server's own tokenizer and chat template, so a client
counts tokens (and finds the prefix it shares with another prompt) exactly as the engine will."""

from __future__ import annotations

from jinja2 import TemplateError

from kvpage.server.errors import APIError
from kvpage.server.protocol import DetokenizeRequest, TokenizeRequest
from kvpage.server.serving import OpenAIServing


class TokenServing(OpenAIServing):
    def tokenize(self, req: TokenizeRequest) -> dict:
        if req.model is not None:
            self.check_model(req.model)
        tok = self.tokenizer
        if req.messages is not None:
            try:
                messages = [m.template_dict() for m in req.messages]
                ids = tok.encode_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                      continue_final_message=req.continue_final_message)  # fmt: skip
            except (ValueError, TemplateError) as e:
                raise APIError(400, f"messages: {e}", param="messages") from None
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)  # type: ignore[arg-type]
        strs = [tok.token_text(t) for t in ids] if req.return_token_strs else None  # the vocabulary's pieces
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        if req.model is not None:
            self.check_model(req.model)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}
