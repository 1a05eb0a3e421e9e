"""Does an exported model decode as fuseflow's engine does? ``fuseflow export --check N``.

The engine decodes the run's policy (a LoRA policy with its adapters added on the fly, as in
training) greedily on the first ``N`` held-out prompts of the run's task, through the run's
tokenizer and chat template, stopping at its end-of-turn token. The exported directory is then
loaded in Hugging Face libraries and decoded greedily for as many tokens on the same prompt ids:

- a merged or full model: ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``;
- a LoRA adapter: ``peft.PeftModel.from_pretrained`` on ``LlamaForCausalLM`` of the run's base, and
  transformers' own adapter loading (``AutoModelForCausalLM.from_pretrained(out_dir)`` reads
  ``adapter_config.json`` and fetches the base it names).

Each loader's tokens must equal the engine's, prompt by prompt. Prompts are decoded one at a
time in transformers, so no padding enters the comparison.
"""

from __future__ import annotations

from pathlib import Path

import torch


def engine_greedy(model, prompt_ids: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[list[int]]:
    """Greedy response ids of fuseflow's engine per prompt (the stop token included when reached)."""
    from fuseflow.rollout.base import RolloutRequest, SamplingParams
    from fuseflow.rollout.engine import Engine, EngineConfig

    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    engine = Engine(model.eval(), EngineConfig(max_num_seqs=max(1, len(prompt_ids))))
    with torch.no_grad():
        out = {s.uid: list(s.response_ids) for s in engine.generate(
            RolloutRequest(i, ids, params) for i, ids in enumerate(prompt_ids))}
    return [out[i] for i in range(len(prompt_ids))]


def hf_greedy(model, prompt_ids: list[list[int]], lengths: list[int], pad_id: int) -> list[list[int]]:
    """Greedy ids of a transformers (or peft) model, one prompt at a time, exactly ``lengths[i]`` new tokens.

    Stopping is left out (``eos_token_id=None``): the engine's stop token, when it has one, is then
    the last of the tokens to compare, so both must produce it at the same place.
    """
    out = []
    with torch.no_grad():
        for ids, n in zip(prompt_ids, lengths, strict=True):
            x = torch.tensor([ids])
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=pad_id)
            out.append(y[0, len(ids):].tolist())
    return out


def run_policy(run_dir: Path, ckpt: Path):
    """The checkpoint's policy as fuseflow's decoder: the base plus its adapters (LoRA), or the full model."""
    from fuseflow.models import CausalLM
    from fuseflow.models.lora import apply_lora, is_adapter_dir, load_adapter, read_adapter_spec

    actor = ckpt / "actor"
    if not is_adapter_dir(actor):
        return CausalLM.from_pretrained(actor)
    model = apply_lora(CausalLM.from_pretrained(run_dir / "reference"), read_adapter_spec(actor))
    load_adapter(model, actor)
    return model


def hf_loaders(run_dir: Path, out_dir: Path) -> dict:
    """Name -> zero-argument loader of the exported directory, for each Hugging Face path it supports."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from fuseflow.models.lora import is_adapter_dir

    if not is_adapter_dir(out_dir):
        return {"transformers": lambda: AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)}

    def with_peft():
        from peft import PeftModel

        base = LlamaForCausalLM.from_pretrained(str(run_dir / "reference"), dtype=torch.float32)
        return PeftModel.from_pretrained(base, str(out_dir))

    return {"peft": with_peft,
            "transformers": lambda: AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)}


def check_export(run_dir: str | Path, ckpt: str | Path, out_dir: str | Path, n: int, log=print) -> dict:
    """Greedy tokens of the exported directory in each Hugging Face loader vs the engine on ``n`` held-out prompts.

    Returns ``{"prompts": n, "engine_tokens": [...], "<loader>": number of prompts with equal tokens, ...}``.
    """
    from fuseflow.config import load_run_config
    from fuseflow.data.tokenizer import load_tokenizer, stop_token_ids
    from fuseflow.evaluate import encode_prompts
    from fuseflow.tasks import make_task

    run_dir, ckpt, out_dir = Path(run_dir), Path(ckpt), Path(out_dir)
    if n < 1:
        raise ValueError(f"--check {n}: the number of prompts must be >= 1")
    cfg = load_run_config(run_dir)
    tok_dir = ckpt / "actor"
    tok = load_tokenizer(tok_dir if (tok_dir / "tokenizer.json").exists() else None, cfg.task.chat_template)
    prompts = make_task(cfg.task).eval_prompts()[:n]
    ids = encode_prompts(tok, prompts, cfg.model.max_prompt_len)
    torch.manual_seed(0)
    ours = engine_greedy(run_policy(run_dir, ckpt), ids, cfg.model.max_response_len, stop_token_ids(tok))
    result: dict = {"prompts": len(ids), "engine_tokens": [len(x) for x in ours],
                    "engine_text": [tok.decode(x, skip_special_tokens=True) for x in ours]}
    for name, load in hf_loaders(run_dir, out_dir).items():
        log(f"check: greedy decoding in {name}...")
        theirs = hf_greedy(load().eval(), ids, [len(x) for x in ours], tok.pad_token_id)
        result[name] = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return result
