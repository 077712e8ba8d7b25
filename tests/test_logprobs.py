"""Prompts and scoring, the same in every method file. Scoring agrees with sampling: `completion_logprobs` at the sampling temperature gives the log-probs
of the distribution `generate` sampled from (softmax(logits / T)), in every method file. At T = 0.5 the
raw logits (T = 1) would not: the ratio pi/pi_old of the first update would start away from 1."""

from __future__ import annotations

import importlib

import pytest
import torch

from common.models import load_policy

METHODS = ["graphgpo", "istar", "delta_belief", "aria", "epo"]
TEXTS = ["push the box up", "is it an animal?", "left right up down"]


@pytest.fixture(scope="module")
def sampled(random_llama_dir):
    """Completions sampled by HF generate at T = 0.5 with the log-probs of its own processed scores."""
    import graphgpo

    torch.manual_seed(0)
    model, tok = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    model.eval()
    prompts = [graphgpo.encode(tok, graphgpo.render_prompt(tok, [{"role": "user", "content": t}])) for t in TEXTS]
    comps, logps = [], []
    for p in prompts:  # one prompt at a time: no padding, the scores are exactly what was sampled from
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=True, temperature=0.5, top_k=0, top_p=1.0, max_new_tokens=6,
                                 min_new_tokens=6, pad_token_id=tok.pad_token_id, eos_token_id=None,
                                 output_scores=True, return_dict_in_generate=True)
        c = out.sequences[0, len(p):].tolist()
        scores = torch.stack(out.scores, 0)[:, 0].float()  # [C, V], logits / T
        comps.append(c)
        logps.append(scores.log_softmax(-1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1))
    return model, tok, prompts, comps, torch.stack(logps)


@pytest.mark.parametrize("name", METHODS)
def test_logprobs_at_the_sampling_temperature(sampled, name):
    mod = importlib.import_module(name)
    model, tok, prompts, comps, want = sampled
    with torch.no_grad():
        lp, m = mod.completion_logprobs(model, tok, prompts, comps, temperature=0.5)
        raw, _ = mod.completion_logprobs(model, tok, prompts, comps)
    assert m.sum() == want.numel()
    torch.testing.assert_close(lp, want, rtol=1e-4, atol=1e-4)
    assert (raw - want).abs().max() > 1e-2  # T = 1 scores a different distribution


QWEN3_LIKE = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
              "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}"
              "{%- endif -%}{%- endif -%}")


@pytest.mark.parametrize("name", METHODS)
def test_render_prompt_turns_thinking_off(random_llama_dir, name):
    """A Qwen3-style template gets enable_thinking=False (the empty think block ΔBelief's official code
    elicits beliefs after); a template without the variable renders as before."""
    from transformers import AutoTokenizer

    mod = importlib.import_module(name)
    tok = AutoTokenizer.from_pretrained(str(random_llama_dir))
    msgs = [{"role": "user", "content": "Is it an animal?"}]
    plain = mod.render_prompt(tok, msgs)
    assert plain.endswith("<|im_start|>assistant\n") and "<think>" not in plain
    tok.chat_template = QWEN3_LIKE
    assert mod.render_prompt(tok, msgs) == plain + "<think>\n\n</think>\n\n"
