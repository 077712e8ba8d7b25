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
    """One call of the method's update function on the batch, sample i's advantage (weight) `sign[i]`
    (a number: the same for all). The samples are each file's `Sample`, the one training-turn format
    of all five scripts."""
    rng = np.random.default_rng(0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    signs = list(sign) if isinstance(sign, (list, tuple)) else [sign] * len(prompts)
    # four trajectories of two turns each (EPO and ΔBelief's per-game aggregation read `traj`)
    samples = [mod.Sample(p, c, group=0, traj=i // 2, turn=i % 2, adv=a)
               for i, (p, c, a) in enumerate(zip(prompts, comps, signs))]
    if name == "graphgpo":
        args = mod.Args(kl_coef=0.0, num_minibatches=1)
    elif name == "istar":  # π_θold's log-probs come with the samples; the advantage is per token
        args = mod.Args(num_minibatches=1)
        old = mod.token_logprobs(model, tok, samples, "default", 8)
        for x, o in zip(samples, old):
            x.old, x.adv = o, torch.full_like(o, x.adv)
    elif name == "delta_belief":
        args = mod.Args(num_minibatches=1, temperature=1.0)
    elif name == "aria":
        args = mod.Args(num_epochs=1, batch_size=len(prompts))
    elif name == "epo":
        # one optimizer step over all four trajectories (a constant lr: the schedule's single step is
        # its warm-up)
        args = mod.Args(num_epochs=1, warmup_ratio=0.0, learning_rate=1e-2,
                        trajectories_per_step=len(prompts) // 2)
    else:  # pragma: no cover
        raise ValueError(name)
    args.micro_batch_size = 3  # resolved by model in a run (None in Args); 3: several micro-batches
    mod.update(model, tok, optimizer, samples, args, rng)


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


def _logp_per_sample(mod, model, tok, prompts, comps):
    model.eval()
    with torch.no_grad():
        lp, m = mod.completion_logprobs(model, tok, prompts, comps)
    return ((lp * m).sum(-1) / m.sum(-1)).tolist()


MIXED = [1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0]  # both signs inside every trajectory of two turns


@pytest.mark.parametrize("name", ["graphgpo", "istar", "delta_belief", "aria", "epo"])
def test_each_sample_moves_with_its_own_advantage_sign(random_llama_dir, name):
    """Mixed signs in one batch: each completion's log-prob moves the way its own advantage says, so
    advantages attached to the wrong samples (a mis-sorted micro-batch, a shifted index) fail."""
    mod = importlib.import_module(name)
    torch.manual_seed(0)
    model, tok = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8)
    prompts, comps = _batch(mod, tok)
    before = _logp_per_sample(mod, model, tok, prompts, comps)
    _update(name, mod, model, tok, prompts, comps, MIXED)
    after = _logp_per_sample(mod, model, tok, prompts, comps)
    change = [b - a for a, b in zip(before, after)]
    up = [c for c, s in zip(change, MIXED) if s > 0]
    down = [c for c, s in zip(change, MIXED) if s < 0]
    # the shared adapter moves all samples together a little (one Adam step); what each sample's own
    # advantage adds must still rank every positive one above every negative one
    assert min(up) > max(down) and np.mean(up) > 0 > np.mean(down), (
        f"{name}: log-prob changes {change} for advantages {MIXED}")


@pytest.mark.parametrize("name", ["aria", "epo"])
def test_length_sorted_micro_batches_give_the_one_pass_gradient(random_llama_dir, name):
    """ARIA's and EPO's update take a step's turns in length order (less padding): with micro-batches of 3
    the gradient equals one pass over the whole step (graphgpo, istar and delta_belief test theirs beside
    their token_logprobs). Turns of unsorted lengths, advantages of both signs and one 0 (ARIA skips it),
    trajectories of 1-3 turns whose turns land in different micro-batches once sorted (EPO's loss splits)."""
    from tests.test_shared_blocks import _policy_with_a_trained_looking_adapter

    mod = importlib.import_module(name)
    model, tok = _policy_with_a_trained_looking_adapter(random_llama_dir)
    g = torch.Generator().manual_seed(3)
    lengths = [(9, 2), (3, 1), (14, 3), (5, 2), (11, 1), (4, 3), (8, 2)]  # unsorted on purpose
    trajs, advs = [0, 0, 1, 2, 2, 2, 3], [1.0, -0.5, 2.0, 0.0, -1.0, 0.7, -2.0]
    samples = [mod.Sample(torch.randint(5, 250, (p,), generator=g).tolist(),
                          torch.randint(5, 250, (c,), generator=g).tolist(), group=0, traj=t,
                          turn=i - trajs.index(t), adv=a)
               for i, ((p, c), t, a) in enumerate(zip(lengths, trajs, advs))]
    if name == "aria":
        args = mod.Args(num_epochs=1, batch_size=len(samples), max_grad_norm=1e9)
    else:  # one optimizer step over the four trajectories; lr 0 (update sets it from the schedule)
        args = mod.Args(num_epochs=1, warmup_ratio=0.0, learning_rate=0.0, trajectories_per_step=4,
                        max_grad_norm=1e9)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for micro in (3, 64):
        args.micro_batch_size = micro
        mod.update(model, tok, torch.optim.SGD(params, lr=0.0), samples, args, np.random.default_rng(0))
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)
