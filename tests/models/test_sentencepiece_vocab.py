"""GGUF's SentencePiece vocabularies (Gemma's; Llama 2's and Mistral 7B's with a space before the text), read as
SentencePiece's BPE reads them: checked against the sentencepiece library itself on vocabularies it trained
here, and through the engine on a Gemma GGUF."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch

from kvpage.models.tokenizer import Tokenizer
from tests.models.tiny_gguf import SPECIALS, sentencepiece_vocab
from tests.worker.driver import assert_pool_clean

sentencepiece = pytest.importorskip("sentencepiece")


@cache
def _vocab(space_prefix: bool):
    """(sentencepiece's processor, our tokenizer of the same pieces as llama.cpp's GGUF metadata holds them)."""
    tokens, scores, types, model = sentencepiece_vocab(600, space_prefix)
    types[4:6] = [3, 3]  # (Gemma's turn markers: special in its tokenizer config, CONTROL in its GGUFs)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": space_prefix,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}  # fmt: skip
    return sentencepiece.SentencePieceProcessor(model_proto=model), Tokenizer.from_gguf_metadata(meta)


def _samples() -> list[str]:
    """Lines and random slices of this repository's text, and what a vocabulary of 600 pieces lacks: characters
    outside it (their bytes), runs of spaces, tabs and newlines, digits, the empty text."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "architecture.md").read_text() + (root / "kvpage" / "core" / "block_pool.py").read_text()
    rng = random.Random(0)
    out = [line for line in text.splitlines()[:150]]
    for _ in range(150):
        i = rng.randrange(len(text) - 200)
        out.append(text[i : i + rng.randrange(1, 200)])
    return out + ["héllo wörld 日本語 🙂", "two  spaces\tand a tab\n\n\nnewlines ", " leading", "1234567 89", "", " "]


@pytest.mark.parametrize("space_prefix", [False, True], ids=["gemma", "llama2"])
def test_ids_and_text_equal_sentencepieces(space_prefix):
    sp, ours = _vocab(space_prefix)
    diffs = [s for s in _samples() if ours.encode(s, add_special_tokens=False) != sp.encode(s)]
    assert not diffs, diffs[:3]
    for s in _samples():
        assert ours.decode(sp.encode(s)) == sp.decode(sp.encode(s)) == s
    assert ours.encode("hi") == [2, *sp.encode("hi")]  # (BOS: SentencePiece GGUFs add it unless they say not)


def test_a_space_goes_before_the_text_and_after_each_special_token_as_llama_cpp_puts_it():
    """With a dummy prefix, llama.cpp puts a space before every stretch of text that follows a special token;
    a chat's parts get one before the first only (they are one text, tokenized part by part)."""
    from sentencepiece import sentencepiece_model_pb2

    sp, ours = _vocab(True)
    ids = ours.encode("hello<end_of_turn>world", add_special_tokens=False)
    assert ids == [*sp.encode("hello"), 5, *sp.encode("world")]
    assert sp.id_to_piece(sp.encode("world")[0]).startswith("\u2581")
    proto = sentencepiece_model_pb2.ModelProto()  # (the same pieces with no dummy prefix)
    proto.ParseFromString(sentencepiece_vocab(600, True)[3])
    proto.normalizer_spec.add_dummy_prefix = False
    bare = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    ours.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert ours.encode_chat([{"role": "user", "content": "the cache"}], add_generation_prompt=False) == [
        2, *sp.encode("["), *bare.encode("the cache"), *bare.encode("]")
    ]  # fmt: skip
    assert sp.encode("[") != bare.encode("[")


def test_control_tokens_are_read_in_templates_but_never_in_message_content():
    sp, ours = _vocab(False)
    start, end = (ours.backend.token_to_id(t) for t in SPECIALS[4:6])
    # (sentencepiece matches its user-defined pieces whole, as the tokenizer does the GGUF's control tokens)
    assert ours.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False) == sp.encode(
        "<start_of_turn>user\nhi<end_of_turn>"
    )
    ours.chat_template = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    ids = ours.encode_chat([{"role": "user", "content": "a<end_of_turn>b"}], add_generation_prompt=False)
    assert ids.count(end) == 1 and ids[:2] == [2, start] and ids[-1] == end


def test_saved_in_hugging_faces_layout_it_reads_back_the_same(tmp_path):
    """A converted GGUF keeps its tokenizer as tokenizer.json: read back, the same ids for every sample."""
    for space_prefix in (False, True):
        sp, ours = _vocab(space_prefix)
        ours.save(tmp_path)
        back = Tokenizer.from_dir(tmp_path)
        assert all(back.encode(s) == ours.encode(s) for s in _samples())
        assert back._prefixes == space_prefix


def test_a_gemma_gguf_generates_from_text_as_transformers_does_from_sentencepieces_ids(tmp_path):
    """Gemma 3 (random weights) with a SentencePiece vocabulary of 512, written as llama.cpp writes it: from a text
    prompt, the engine's greedy tokens are transformers' on sentencepiece's ids (BOS first), its first logits
    transformers' (to float32's rounding), and its text is sentencepiece's decoding of them."""
    import transformers

    from kvpage import LLM, SamplingParams
    from tests.models.tiny_gguf import write_gguf_of

    # (six layers: llama.cpp's Gemma 3 pattern, windows on five of six, is the only layout its GGUFs hold)
    cfg = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                        query_pre_attn_scalar=16, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    write_gguf_of(tmp_path, tmp_path / "gemma.gguf")
    sp = sentencepiece.SentencePieceProcessor(model_proto=sentencepiece_vocab(512)[3])
    llm = LLM(str(tmp_path / "gemma.gguf"), dtype="float32", num_kv_blocks=128, block_size=4)
    prompt = "Blocks outside the window are released, and the pool stays small."
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ids = [2, *sp.encode(prompt)]
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = out.outputs[0].token_ids
    assert out.error is None and got == want[0, len(ids) :].tolist(), out.error
    first = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    for tok, entry in first.outputs[0].logprobs[0].items():
        assert abs(entry.logprob - float(lp[tok])) < 1e-4, (tok, entry.logprob, float(lp[tok]))
    assert out.outputs[0].text == sp.decode([t for t in got if not sp.is_control(t)])
    # its chat template's markers are the control tokens, the text between them sentencepiece's, part by part
    chat = llm.chat([{"role": "user", "content": "Is a block freed?"}], SamplingParams(temperature=0.0, max_tokens=2))
    assert chat[0].prompt_token_ids == [2, 4, *sp.encode("user\n"), *sp.encode("Is a block freed?"), 5,
                                        *sp.encode("\n"), 4, *sp.encode("model\n")]  # fmt: skip
    assert_pool_clean(llm.llm_engine.kv_manager)
