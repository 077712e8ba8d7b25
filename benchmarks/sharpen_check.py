"""Can the LoRA adapter the RL scripts train sharpen a tiny policy at all? An upper bound on RL's gain.

Supervised training of the adapter on the expert's own labels, with the log-probs taken at the RL
sampling temperature (as every method file scores them), and the sampled success at that temperature on
the env's test tasks (or train tasks) before and every `--eval-every` steps. The labels are perfect supervision (the
expert's move at demonstration states of the train tasks), far more signal per step than a policy
gradient gets; if this does not raise sampled success, RL on the same adapter at the same budget
cannot either (docs/learning.md, "Twenty Questions and Negotiation").

    python benchmarks/sharpen_check.py --env-id twenty_questions --lr 5e-4 --steps 300   # at the RL temperature
    python benchmarks/sharpen_check.py --env-id twenty_questions --train lora+norm      # final norm trainable too
    python benchmarks/sharpen_check.py --env-id twenty_questions --model-name DIR --temperature 1.0

`--train lora`: the adapter only (what the scripts train); `lora+norm`: also the final RMSNorm's weight,
the one place where a frozen tiny model can scale all its logits at once. Appends one JSON line per run
to runs/sharpen_check/results.jsonl. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import delta_belief as D  # noqa: E402  (its shared encode / render_prompt / completion_logprobs)
import envs  # noqa: E402
from common import tiny  # noqa: E402
from common.models import load_policy, policy_defaults  # noqa: E402

OUT = REPO / "runs" / "sharpen_check"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-id", default="twenty_questions")
    p.add_argument("--model-name", default="tiny", help="'tiny' (the env's default tiny policy) or a checkpoint dir")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling and scoring temperature (default: the policy's RL temperature, common.tiny.RL_TEMPERATURE)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train", choices=["lora", "lora+norm"], default="lora")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-k", type=int, default=4, help="sampled episodes per evaluation task")
    p.add_argument("--eval-split", choices=["test", "train"], default="test",
                   help="evaluate on the test tasks, or on the train tasks the labels come from")
    p.add_argument("--eval-num-tasks", type=int, default=0,
                   help="evaluation tasks: N spread evenly over the split (0: all of it)")
    p.add_argument("--demo-episodes", type=int, default=600)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)

    model, tok = load_policy(a.model_name, env_id=a.env_id)
    if a.train == "lora+norm":
        for name, q in model.named_parameters():
            if name.endswith("model.norm.weight"):
                q.requires_grad_(True)
    d = policy_defaults(a.model_name, a.env_id, learning_rate=a.lr, max_new_tokens=24)
    kw, max_new = dict(d.env_kwargs), d.max_new_tokens
    if a.temperature is None:
        a.temperature = d.temperature
    # the checkpoint load_policy loaded (the shipped weights, else the cached build)
    ckpt = tiny.ensure_tiny(a.env_id, progress=False) if a.model_name == "tiny" else Path(a.model_name)
    # demonstrations of the build's kind on the train tasks only (another seed), labels = the expert's move
    recipe = dict(tiny.read_meta(ckpt)["recipe"], demo_split="train", demo_episodes=a.demo_episodes,
                  seed=123, label_noise=0.0)
    demos, _ = tiny.collect_demos(a.env_id, recipe, progress=False)
    examples = [(D.encode(tok, D.render_prompt(tok, m)), D.encode(tok, act) + [tok.eos_token_id])
                for m, act in demos]
    split = list(envs.make(a.env_id, **kw).task_ids(a.eval_split))
    n = a.eval_num_tasks or len(split)
    test = [split[i * len(split) // n] for i in range(min(n, len(split)))]  # spread over the split's order

    def evaluate():
        torch.manual_seed(1000)  # the same sampling draws at every evaluation of every run
        ids = [t for t in test for _ in range(a.eval_k)]
        s = tiny.rollout_success(model, tok, [envs.make(a.env_id, **kw) for _ in ids], ids, max_new,
                                 greedy=False, temperature=a.temperature)
        g = tiny.rollout_success(model, tok, [envs.make(a.env_id, **kw) for _ in test], test, max_new, greedy=True)
        se = (s["success"] * (1 - s["success"]) / max(1, len(ids) - 1)) ** 0.5
        return dict(sampled=round(s["success"], 4), sampled_se=round(se, 4), greedy=round(g["success"], 4),
                    invalid=round(s["invalid_rate"], 4))

    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    rng = random.Random(a.seed)
    t0 = time.time()
    curve = [dict(step=0, **evaluate())]
    print(f"{len(examples)} examples, {sum(q.numel() for q in params)} trainable parameters", curve[-1], flush=True)
    for step in range(1, a.steps + 1):
        model.train()
        batch = rng.sample(examples, min(a.batch_size, len(examples)))
        logp, mask = D.completion_logprobs(model, tok, [x for x, _ in batch], [y for _, y in batch],
                                           temperature=a.temperature)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % a.eval_every == 0 or step == a.steps:
            curve.append(dict(step=step, loss=round(float(loss.detach()), 4), **evaluate()))
            print(curve[-1], flush=True)
    row = dict(vars(a), checkpoint=ckpt.name, examples=len(examples), seconds=round(time.time() - t0), curve=curve)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
