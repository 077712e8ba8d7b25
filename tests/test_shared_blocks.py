"""The blocks every method file needs the same way are the same text in all five files. Each file reads
alone (the duplication is intended), but a fix made in one copy must be made in all: the same sampled
tokens must become the same training tokens whatever the method."""

from __future__ import annotations

import ast
import functools
import json

import pytest
import torch

from conftest import REPO

METHODS = ["graphgpo.py", "istar.py", "delta_belief.py", "aria.py", "epo.py"]
SHARED = ["Sample", "render_prompt", "encode", "stop_ids", "completion_text", "CommonNoise", "SampledLogprobs", "merged_lora",
          "generate", "completion_logprobs",
          "mean_se", "Logger", "start_run", "eval_line", "write_summary", "seed_everything", "with_defaults",
          "resumed_args", "save_checkpoint", "load_checkpoint"]
SHARED_WHERE_DEFINED = ["save_adapter", "_padded", "seq_len"]


@functools.lru_cache(maxsize=None)  # one parse per file for the whole module (get_source_segment is slow)
def _blocks(name: str) -> dict[str, str]:
    text = (REPO / name).read_text()
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = ast.get_source_segment(text, node)
    return out


@pytest.mark.parametrize("block", SHARED + SHARED_WHERE_DEFINED)
def test_block_is_the_same_text_in_every_method_file(block):
    texts = {name: _blocks(name).get(block) for name in METHODS}
    if block in SHARED:
        missing = [n for n, t in texts.items() if t is None]
        assert not missing, f"{block} is missing in {missing}"
    present = {n: t for n, t in texts.items() if t is not None}
    assert len(present) >= 2
    reference = present["graphgpo.py"]
    drifted = [n for n, t in present.items() if t != reference]
    assert not drifted, f"{block} differs from graphgpo.py's in {drifted}"


def test_mean_se_and_eval_line_by_hand():
    import graphgpo as g

    # 4 successes of 10: p 0.4, sample std sqrt(0.4 * 0.6 * 10 / 9) = 0.516398, SE 0.163299
    m, se = g.mean_se([1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    assert m == 0.4 and abs(se - 0.163299) < 1e-6
    assert g.mean_se([]) == (0.0, 0.0) and g.mean_se([1]) == (1.0, 0.0)
    # one short line: the metrics with a standard error, not the per-opponent cells nor the episode lists
    ev = {"eval/success": 0.25, "eval/success_se": 0.05, "eval/return": 1.5, "eval/win_rate_Bob_vs_fair": 0.5,
          "eval/win_rate_Bob_vs_fair_se": 0.1, "eval/success_episodes": [0.0, 1.0]}
    assert g.eval_line(3, ev) == "eval @ iteration 3: success 0.250 ± 0.050"


# The tiny default run of every script, as it was before the run sizes moved into RUN_SIZES (the committed
# results were measured with these), and the env of each script's SmolLM2 run.
TINY_RUN = {"graphgpo": dict(env_id="sokoban", num_iterations=40, tasks_per_iteration=4, group_size=8,
                             eval_num_tasks=200, eval_every=10, checkpoint_every=10),
            "istar": dict(env_id="sokoban", num_iterations=40, tasks_per_iteration=4, group_size=8,
                          eval_num_tasks=200, eval_every=10, checkpoint_every=10),
            "delta_belief": dict(env_id="twenty_questions", max_turns=20, num_iterations=64, tasks_per_iteration=8,
                                 group_size=4, eval_num_tasks=0, eval_k=5, eval_every=32, checkpoint_every=50),
            "aria": dict(env_id="bargaining", num_iterations=None, games_per_iteration=None, eval_num_tasks=0,
                         eval_k=2, eval_every=2, checkpoint_every=1),
            "epo": dict(env_id="negotiation", num_iterations=40, episodes_per_iteration=64, eval_num_tasks=0,
                        eval_every=10, checkpoint_every=5)}
SMOLLM2_ENV = {"graphgpo": "webshop", "istar": "webshop", "delta_belief": "twenty_questions",
               "aria": "bargaining", "epo": "negotiation"}


@pytest.mark.parametrize("script", sorted(TINY_RUN))
def test_with_defaults_fills_only_what_is_left_at_none(script, capsys):
    import importlib

    mod = importlib.import_module(script)
    args = mod.with_defaults(mod.Args())  # the default run: the tiny row, nothing printed
    assert {k: getattr(args, k) for k in TINY_RUN[script]} == TINY_RUN[script]
    assert capsys.readouterr().out == ""
    for model in ("Qwen/Qwen2.5-1.5B-Instruct", "smollm2-135m-instruct"):  # no own row: "*"
        args = mod.with_defaults(mod.Args(model_name=model))
        assert args.env_id == TINY_RUN[script]["env_id"]
        assert args.max_new_tokens == mod.DEFAULTS["*"]["max_new_tokens"]  # no policy budget: the row's
        assert "row '*'" in capsys.readouterr().out  # a real model's defaults are said
    args = mod.with_defaults(mod.Args(model_name="smollm2-135m", num_iterations=3, env_id="alfworld"))
    assert (args.num_iterations, args.env_id) == (3, "alfworld")  # a flag given wins
    assert "num_iterations" not in capsys.readouterr().out  # and is not announced as the row's
    args = mod.with_defaults(mod.Args(model_name="smollm2-135m"))
    assert args.env_id == SMOLLM2_ENV[script] and args.learning_rate == 1e-4
    assert all(getattr(args, k) is not None for k in mod.DEFAULTS["smollm2-135m"])
    assert args.num_iterations < (TINY_RUN[script]["num_iterations"] or 8)  # a SmolLM2 iteration costs minutes
    assert f"env_id={SMOLLM2_ENV[script]}" in capsys.readouterr().out
    assert mod.with_defaults(args) == args  # filled already: nothing changes, nothing to say
    assert capsys.readouterr().out == ""


def test_write_summary_pairs_the_episodes_by_hand(tmp_path, capsys):
    import graphgpo as g

    # the same 10 episodes before and after: 4 of 10 won before, 8 after; the differences are
    # [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]: mean 0.4, SE 0.163299 (as above)
    before = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    after = [1, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    first = {"eval/success": 0.4, "eval/success_se": g.mean_se(before)[1], "eval/success_episodes": before}
    last = {"eval/success": 0.8, "eval/success_se": g.mean_se(after)[1], "eval/success_episodes": after}
    summary = g.write_summary(tmp_path, g.Args(num_iterations=5), 90.0, first, last, "eval/success", extra=1)
    out = capsys.readouterr().out
    assert "eval/success: 0.400 ± 0.163 before -> 0.800 ± 0.133 after (+0.400 ± 0.163, paired)" in out
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (summary["metric"], summary["iterations"], summary["extra"]) == ("eval/success", 5, 1)
    # episodes that cannot be paired: the two SEs in quadrature, sqrt(0.163299^2 + 0.133333^2) = 0.210819
    g.write_summary(tmp_path, g.Args(), 90.0, first, {**last, "eval/success_episodes": after[:9]}, "eval/success")
    assert "(+0.400 ± 0.211)" in capsys.readouterr().out


def test_common_noise_samples_softmax_at_the_temperature():
    import graphgpo as g

    # logits 2 * log([0.5, 0.3, 0.2]) at temperature 2: the sampling distribution is [0.5, 0.3, 0.2]
    n, width, T = 20000, 3, 2.0
    scores = (T * torch.log(torch.tensor([0.5, 0.3, 0.2]))).repeat(n, 1)
    noise = g.CommonNoise([(7, i) for i in range(n)], T, width)
    first = noise(torch.zeros(n, width, dtype=torch.long), scores.clone()).argmax(-1)
    freq = torch.bincount(first, minlength=3).double() / n
    # binomial SE of a frequency near 0.5 over 20000 draws: 0.0035; 0.015 is over 4 SE
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.015), freq
    # the next token of the same rows draws fresh noise: it agrees with the first about
    # 0.5^2 + 0.3^2 + 0.2^2 = 0.38 of the time, not always
    second = noise(torch.zeros(n, width + 1, dtype=torch.long), scores.clone()).argmax(-1)
    assert abs(float((first == second).double().mean()) - 0.38) < 0.02
    # the same key and step give the same noise, again
    again = g.CommonNoise([(7, i) for i in range(n)], T, width)(torch.zeros(n, width, dtype=torch.long),
                                                               scores.clone()).argmax(-1)
    assert torch.equal(first, again)


def test_common_noise_samples_do_not_depend_on_the_batch(random_llama_dir):
    """A row's completion depends on its prompt and key only: not on the other rows of the batch nor on
    the global random state, which is what lets two evaluations play the same episodes."""
    import graphgpo as g
    from common.models import load_policy

    model, tok = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    prompts = [g.encode(tok, text) for text in ["push the box up", "is it an animal?", "left right", "#P_B#"]]
    keys = [(3, 0, i, 0) for i in range(4)]
    torch.manual_seed(0)
    batch = g.generate(model, tok, prompts, 1.0, 6, noise_keys=keys)
    torch.manual_seed(1)
    alone = [g.generate(model, tok, [p], 1.0, 6, noise_keys=[k])[0] for p, k in zip(prompts, keys)]
    assert batch == alone
    torch.manual_seed(0)
    reordered = g.generate(model, tok, prompts[::-1], 1.0, 6, noise_keys=keys[::-1])
    assert reordered == batch[::-1]
    # other keys, other samples (a random 2-layer model is close to uniform over ~300 tokens)
    other = g.generate(model, tok, prompts, 1.0, 6, noise_keys=[(4, 0, i, 0) for i in range(4)])
    assert other != batch


def _policy_with_a_trained_looking_adapter(random_llama_dir):
    """The random Llama with a LoRA whose B matrices are not zero, so merging it changes the weights."""
    from common.models import load_policy

    model, tok = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.eval()
    return model, tok


def test_sampled_logprobs_draws_generates_own_tokens_and_keeps_their_logprobs(random_llama_dir):
    """Sampling through `SampledLogprobs` gives the very tokens of generate's own sampler
    (do_sample=True, top_k=0, top_p=1) for the same torch seed, and the kept log-probs are the
    log-probs a separate forward computes (what `update` used to recompute as π_θold's)."""
    import graphgpo as g

    model, tok = _policy_with_a_trained_looking_adapter(random_llama_dir)
    prompts = [g.encode(tok, t) for t in ["push the box up", "is it an animal?", "left right", "#P_B#"]]
    width, pad = max(map(len, prompts)), tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    for temperature in (1.0, 0.7):
        kw = dict(input_ids=ids, attention_mask=attention, max_new_tokens=6, pad_token_id=pad,
                  eos_token_id=tok.eos_token_id)
        torch.manual_seed(3)
        own = model.generate(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **kw)
        torch.manual_seed(3)
        recorder = g.SampledLogprobs(temperature)
        ours = model.generate(do_sample=False, logits_processor=[recorder], **kw)
        assert torch.equal(own, ours)
        torch.manual_seed(3)
        rows, kept = g.generate(model, tok, prompts, temperature, 6, logprobs=True)  # LoRA merged
        assert rows == [r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r
                        for r in own[:, width:].tolist()]
        lp, _ = g.completion_logprobs(model, tok, prompts, rows, temperature=temperature)
        for b, r in enumerate(rows):
            assert kept[b].shape == (len(r),)
            assert torch.allclose(kept[b], lp[b, lp.shape[1] - len(r):], atol=1e-5)
            assert kept[b].max() < 0  # log-probs of ~300-way draws, not logits
    # greedy and common-noise rows were not drawn by the recorder: nothing kept, `update` recomputes
    assert g.generate(model, tok, prompts, 1.0, 6, greedy=True, logprobs=True)[1] == [None] * 4
    keys = [(1, i) for i in range(4)]
    assert g.generate(model, tok, prompts, 1.0, 6, noise_keys=keys, logprobs=True)[1] == [None] * 4


def test_merged_lora_samples_the_adapter_and_restores_the_weights_exactly(random_llama_dir):
    """While `generate` samples, the adapter is merged into the base weights; afterwards every weight
    is bit-for-bit what it was. The merged model scores like the unmerged one; with the adapter
    disabled nothing is merged, so the base model samples (EPO's frozen agent)."""
    import graphgpo as g

    model, tok = _policy_with_a_trained_looking_adapter(random_llama_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = [g.encode(tok, t) for t in ["push the box up", "is it an animal?"]]
    rows = g.generate(model, tok, prompts, 1.0, 8, greedy=True)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    lp, _ = g.completion_logprobs(model, tok, prompts, rows)
    with g.merged_lora(model):
        assert all(m.merged for m in model.modules() if hasattr(m, "lora_A"))
        merged_lp, _ = g.completion_logprobs(model, tok, prompts, rows)
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        assert changed and all("base_layer" in n for n in changed)
    assert torch.allclose(lp, merged_lp, atol=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(m.merged for m in model.modules() if hasattr(m, "lora_A"))
    with model.disable_adapter():
        base_rows = g.generate(model, tok, prompts, 1.0, 8, greedy=True)
        with g.merged_lora(model):
            assert not any(m.merged for m in model.modules() if hasattr(m, "lora_A"))
    for m in model.modules():
        if hasattr(m, "lora_A"):
            m.lora_B["default"].weight.data.zero_()  # the adapter made a no-op: the base model
    assert g.generate(model, tok, prompts, 1.0, 8, greedy=True) == base_rows


def test_static_cache_generates_the_same_tokens_for_any_batch_size(random_llama_dir):
    """`--static-cache` (`load_policy(static_cache=True)`): generate pads the batch to a power of two
    (5 rows -> 8) so that a compiled static cache sees few shapes, and returns only the real rows: the
    same greedy and common-noise completions as the dynamic cache, and sampled log-probs that a
    separate forward reproduces. On a CPU transformers does not compile; the cache itself is what runs."""
    import graphgpo as g
    from common.models import load_policy

    model, tok = _policy_with_a_trained_looking_adapter(random_llama_dir)
    fast, _ = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu",
                          static_cache=True)
    fast.load_state_dict(model.state_dict())
    fast.eval()
    assert fast.generation_config.cache_implementation == "static"
    assert model.generation_config.cache_implementation is None
    texts = ["push the box up", "is it an animal?", "left right", "#P_B#", "up"]
    prompts = [g.encode(tok, t) for t in texts]
    shapes = []
    hook = fast.get_base_model().model.embed_tokens.register_forward_hook(
        lambda mod, inp, out: shapes.append(tuple(inp[0].shape)))
    greedy = g.generate(fast, tok, prompts, 1.0, 7, greedy=True)
    hook.remove()
    assert len(greedy) == 5 and {s[0] for s in shapes} == {8}  # padded to 8 rows, 5 returned
    assert greedy == g.generate(model, tok, prompts, 1.0, 7, greedy=True)
    keys = [(2, 0, i) for i in range(5)]
    assert (g.generate(fast, tok, prompts, 1.0, 7, noise_keys=keys)
            == g.generate(model, tok, prompts, 1.0, 7, noise_keys=keys))
    assert g.generate(fast, tok, prompts[:4], 1.0, 7, greedy=True) == greedy[:4]  # a power of two: as is
    torch.manual_seed(5)
    rows, kept = g.generate(fast, tok, prompts, 0.7, 7, logprobs=True)
    lp, _ = g.completion_logprobs(model, tok, prompts, rows, temperature=0.7)
    assert len(rows) == len(kept) == 5
    for b, r in enumerate(rows):
        assert kept[b].shape == (len(r),) and torch.allclose(kept[b], lp[b, lp.shape[1] - len(r):], atol=1e-5)


def test_the_checkpoints_generation_config_does_not_reach_sampling(random_qwen2_dir):
    """The checkpoint's generation config asks for a repetition penalty of 1.3, top-k 5, temperature 0.3
    and sampling: none of it may reshape the policy's distribution. Sampled turns keep the log-probs a
    forward of the policy gives, and greedy turns pick the forward's argmax at every token (a repetition
    penalty would move both)."""
    import graphgpo as g
    from common.models import load_policy

    model, tok = load_policy(str(random_qwen2_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    assert model.generation_config.repetition_penalty == 1.3  # the trap is there
    prompts = [g.encode(tok, t) for t in ["push push push the box", "is it is it an animal?", "left left"]]
    torch.manual_seed(0)
    rows, kept = g.generate(model, tok, prompts, 1.0, 12, logprobs=True)
    lp, _ = g.completion_logprobs(model, tok, prompts, rows)
    for b, r in enumerate(rows):
        assert torch.allclose(kept[b], lp[b, lp.shape[1] - len(r):], atol=1e-5)
    greedy = g.generate(model, tok, prompts, 1.0, 12, greedy=True)
    for p, r in zip(prompts, greedy):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        assert logits.argmax(-1).tolist() == r
    assert model.generation_config.repetition_penalty == 1.3  # restored after sampling


def test_a_turn_ends_at_any_stop_id_the_checkpoint_lists(random_qwen2_dir):
    """A turn ends at the first id of the tokenizer's EOS or the checkpoint's generation_config.eos_token_id
    list (Llama 3's <|eot_id|> beside <|end_of_text|>), and the env then reads its text; a turn without
    one was cut and reads as ""."""
    import graphgpo as g
    from common.models import load_policy

    model, tok = load_policy(str(random_qwen2_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    other = tok.convert_tokens_to_ids("<|endoftext|>")
    assert g.stop_ids(model, tok) == {tok.eos_token_id, other}
    prompt = g.encode(tok, "push the box up")
    free = g.generate(model, tok, [prompt], 1.0, 10, greedy=True)[0]
    third = free[2]
    assert third not in g.stop_ids(model, tok)
    model.generation_config.eos_token_id = [tok.eos_token_id, third]  # the greedy turn's third token ends it
    cut = g.generate(model, tok, [prompt], 1.0, 10, greedy=True)[0]
    assert cut == free[: free.index(third) + 1]
    stops = g.stop_ids(model, tok)
    assert g.completion_text(tok, cut, stops) == tok.decode(cut, skip_special_tokens=True) != ""
    assert g.completion_text(tok, cut[:-1], stops) == ""  # no stop id: cut at max_new_tokens
    assert g.completion_text(tok, [5, 6, other], {tok.eos_token_id, other}) == tok.decode([5, 6])


def test_a_template_without_system_role_gets_the_system_text_in_the_first_user_turn(random_llama_dir):
    """Gemma's template raises on a system message: the prompt then opens the first user turn with the
    system text; a template that accepts it renders the messages as they are."""
    import graphgpo as g
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Move?"},
                {"role": "assistant", "content": "up"}, {"role": "user", "content": "Again?"}]
    as_is = g.render_prompt(tok, messages)
    assert as_is.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nMove?")
    tok.chat_template = ("{%- if messages[0]['role'] == 'system' -%}{{ raise_exception('System role not "
                         "supported') }}{%- endif -%}" + tok.chat_template)
    folded = g.render_prompt(tok, messages)
    assert folded == ("<|im_start|>user\nBe brief.\n\nMove?<|im_end|>\n<|im_start|>assistant\nup<|im_end|>\n"
                      "<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(Exception):  # nothing to fold: the template's own error
        g.render_prompt(tok, [{"role": "system", "content": "only a system turn"}])
