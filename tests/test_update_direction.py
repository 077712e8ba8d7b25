"""Every method's own update moves the policy the way its advantages say: on a fixed batch, one update
with positive advantages (weights) raises the log-probs of the batch's completions and one with negative
advantages lowers them, and the base weights stay as they were (only LoRA trains). A sign error, a
detached loss, a wrong mask or an optimizer that never steps fails here in seconds; learning curves are
measured by the benchmarks, not asserted."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from common.models import load_policy
from conftest import base_fingerprint

TEXTS = ["push the box up", "is it an animal?", "left right up down", "go to the target", "propose 60",
         "accept", "is it a tool?", "move down"]
ANSWERS = ["up", "yes", "left", "down", "propose 55", "accept", "no", "right"]


def _batch(mod, tok):
    prompts = [mod.encode(tok, mod.render_prompt(tok, [{"role": "user", "content": t}])) for t in TEXTS]
    comps = [mod.encode(tok, a) + [tok.eos_token_id] for a in ANSWERS]
    return prompts, comps


def _mean_logp(mod, model, tok, prompts, comps):
    model.eval()
    with torch.no_grad():
        lp, m = mod.completion_logprobs(model, tok, prompts, comps)
    return float((lp * m).sum() / m.sum())


def _update(name, mod, model, tok, prompts, comps, sign):
    """One call of the method's update function on the batch, every advantage (weight) equal to `sign`."""
    rng = np.random.default_rng(0)
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "graphgpo":
        args = mod.Args(kl_coef=0.0, num_minibatches=1)
        samples = [{"prompt": p, "completion": c, "adv": sign} for p, c in zip(prompts, comps)]
        mod.update(model, tok, torch.optim.AdamW(params, lr=1e-2), samples, args, rng)
    elif name == "istar":
        args = mod.Args(num_minibatches=1)
        samples = [{"prompt": p, "completion": c} for p, c in zip(prompts, comps)]
        old = mod.token_logprobs(model, tok, samples, "default", args.micro_batch_size)
        for x, o in zip(samples, old):
            x["old"], x["adv"] = o, torch.full_like(o, sign)
        mod.update(model, tok, torch.optim.AdamW(params, lr=1e-2), samples, args, rng)
    elif name == "delta_belief":
        args = mod.Args(num_minibatches=1, temperature=1.0)
        samples = [{"prompt": p, "completion": c, "adv": sign, "traj": i % 3}
                   for i, (p, c) in enumerate(zip(prompts, comps))]
        mod.update(model, tok, torch.optim.AdamW(params, lr=1e-2), samples, args, rng)
    elif name == "aria":
        args = mod.Args(num_epochs=1, batch_size=len(prompts))
        samples = [{"prompt": p, "completion": c, "weight": sign} for p, c in zip(prompts, comps)]
        mod.update(model, tok, torch.optim.AdamW(params, lr=1e-2), samples, args, rng)
    elif name == "epo":
        args = mod.Args(num_epochs=1, warmup_ratio=0.0, trajectories_per_step=2)
        trajs = []
        for j in range(0, len(prompts), 2):
            tr = mod.Episode(traj_id=j, game_id=j, task_id="t", player="Alice", opponent="self")
            tr.prompts, tr.completions = prompts[j:j + 2], comps[j:j + 2]
            tr.strategies = [ANSWERS[j], ANSWERS[j + 1]]
            tr.weights = [sign, sign]
            trajs.append(tr)
        # one optimizer step over the whole batch (a constant lr: the schedule's single step is its warm-up)
        args.trajectories_per_step = len(trajs)
        mod.update(model, tok, trajs, args, 1e-2, rng)
    else:  # pragma: no cover
        raise ValueError(name)


@pytest.mark.parametrize("name", ["graphgpo", "istar", "delta_belief", "aria", "epo"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_logprobs_with_the_advantage_sign(random_llama_dir, name, sign):
    mod = importlib.import_module(name)
    torch.manual_seed(0)
    model, tok = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8)
    prompts, comps = _batch(mod, tok)
    before, base = _mean_logp(mod, model, tok, prompts, comps), base_fingerprint(model)
    _update(name, mod, model, tok, prompts, comps, sign)
    after = _mean_logp(mod, model, tok, prompts, comps)
    assert base_fingerprint(model) == base, f"{name}: the update changed the base weights"
    if sign > 0:
        assert after > before + 1e-3, f"{name}: positive advantages did not raise log-probs ({before:.4f} -> {after:.4f})"
    else:
        assert after < before - 1e-3, f"{name}: negative advantages did not lower log-probs ({before:.4f} -> {after:.4f})"
