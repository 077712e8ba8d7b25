"""ARIA in verl: an estimator that embeds the batch's utterances and clusters them once, and
verl's "gpg" policy loss as ARIA's offline REINFORCE.

Rows are turns (verl-agent's layout). ARIA needs per row the game (`traj_uid`), the turn, the
acting player, that player's outcome R in the game, and the game's utterances: their texts in
order (actions and observations; in self-play every message), which of them are labelled by their
exact text, and where the row's action sits among them (`pos`). The rollout puts them in
non_tensor_batch (the game's lists on each of its rows). The credit is one clustering of every
utterance of the batch, so the estimator, which verl runs in its trainer process (the TaskRunner
actor) with the whole batch, embeds them there (`embed`: aria.py's model-free hash_embed, or a
sentence encoder) and calls the kernel once; `index` (the group) is not used. ARIA's loss, -(1/B) Σ_turns Ã_t Σ_tokens log π, is
verl's policy loss "gpg" (−A log π: no ratio, no clip) with loss_agg_mode "seq-mean-token-sum"
over mini-batches of B rows, and ARIA's epochs are ppo_epochs: without a ratio every epoch is
plain REINFORCE on the same weights, as in aria.py. `compute_advantage_with_turns` is
graphgpo_verl.py's.

Run by benchmarks/porting_check.py (the check below the snippet): docs/porting_check.md.
"""

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, register_adv_est

from aria import aria_advantages, hash_embed

TURN_FIELDS = ("traj_uid", "turn", "player", "outcome", "utterances", "exact", "pos")
embed = hash_embed  # texts -> [n, d] vectors: aria.py's hash, or a sentence encoder's


@register_adv_est("aria")
def compute_aria_advantage(token_level_rewards, response_mask, index=None, config=None,
                           non_tensor_batch=None, **kwargs):
    """ARIA's REINFORCE weight of every row (one row = one turn), R̃ of its intention key (§3.3),
    broadcast over its response tokens: one HAC over all the batch's clustered utterances.
    non_tensor_batch: TURN_FIELDS; config: verl's algorithm config, its `aria` entry the kernel's
    keyword arguments (gamma, max_k, linkage, split_eps, split_tau, fixed_k, aggregate)."""
    nt = non_tensor_batch
    missing = [k for k in TURN_FIELDS if nt is None or k not in nt]
    if missing:
        raise ValueError(f"aria: non_tensor_batch lacks {missing} (compute_advantage_with_turns)")
    opts = dict((config.get("aria", None) if config is not None else None) or {})
    order = np.argsort(np.asarray(nt["turn"], dtype=np.int64), kind="stable")  # turns in order
    start, texts, exact = {}, [], []  # every game's utterances once, one after the other
    for i in order:
        if nt["traj_uid"][i] not in start:
            start[nt["traj_uid"][i]] = len(texts)
            texts += list(nt["utterances"][i])
            exact += [bool(x) for x in nt["exact"][i]]
    history = [list(range(start[nt["traj_uid"][i]], start[nt["traj_uid"][i]] + nt["pos"][i] + 1))
               for i in order]  # the game's utterances up to the turn's action
    clustered = [u for u, x in enumerate(exact) if not x]
    distinct = {}  # each clustered text embedded once
    which = [distinct.setdefault(texts[u], len(distinct)) for u in clustered]
    vectors = np.asarray(embed(list(distinct)), dtype=np.float64).reshape(len(distinct), -1)
    embeddings = np.zeros((len(texts), vectors.shape[1]))
    embeddings[clustered] = vectors[which]
    adv = np.empty(len(order))
    adv[order] = aria_advantages(
        traj=nt["traj_uid"][order], player=nt["player"][order],
        outcome=nt["outcome"][order].astype(float), history=history, utterances=texts,
        exact=exact, embeddings=embeddings, **opts)
    scores = torch.as_tensor(adv, dtype=torch.float32, device=response_mask.device)
    scores = scores.unsqueeze(-1) * response_mask  # the turn's weight on each of its tokens
    return scores, scores


def compute_advantage_with_turns(data, config):
    """verl's `compute_advantage` for a registered estimator, plus the per-row fields (verl 0.9.1
    passes non_tensor_batch only to "gdpo"): the trainer calls this instead."""
    estimator = get_adv_estimator_fn(config.adv_estimator)
    advantages, returns = estimator(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"], index=data.non_tensor_batch.get("uid"),
        config=config, non_tensor_batch=data.non_tensor_batch)
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    return data


# Use: algorithm.adv_estimator=aria +algorithm.aria.gamma=0.95 and ARIA's loss:
#   actor.policy_loss.loss_mode=gpg actor.loss_agg_mode=seq-mean-token-sum actor.ppo_epochs=3
#   actor.shuffle=True actor.use_kl_loss=False actor.entropy_coeff=0 and actor.ppo_mini_batch_size
#   x rollout.n = ARIA's batch_size (turns per optimizer step); in the trainer, where it calls
#   compute_advantage(batch, ...):
#     batch = compute_advantage_with_turns(batch, self.config.algorithm)


# ---- check (not part of the snippet) ----------------------------------------------------------
def check():
    """The estimator through verl's registry on a hand-made DataProto (three Twenty Questions
    games); verl's actor loss with the weights, on a tiny random Llama, against aria.py's
    reinforce_loss."""
    from omegaconf import OmegaConf
    from tiny_lm import tiny_causal_lm, tiny_tokenizer, verl_log_probs, verl_rows
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from aria import completion_logprobs, reinforce_loss

    torch.manual_seed(0)
    # The kernel's doctest games (0 and 1; γ 0.5), and a third that wins on its second try
    games = [(["Is it an animal?", "Yes", "Is it a cat?", "Finished"], 1.0),
             (["Is it an animal?", "Yes", "Is it a dog?", "No"], 0.0),
             (["Is it a bird?", "No", "Is it a cat?", "Finished"], 1.0)]
    turns = []  # (uid, traj_uid, turn, player, outcome, utterances, exact, pos)
    for g, (texts, outcome) in enumerate(games):
        for t, pos in enumerate(range(0, len(texts), 2)):  # actions at 0, 2; observations after
            turns.append(("twenty", f"g{g}", t, "agent", outcome, texts,
                          [False, True] * (len(texts) // 2), pos))
    n = len(turns)
    config = OmegaConf.create({"adv_estimator": "aria", "aria": {"gamma": 0.5}})
    assert get_adv_estimator_fn("aria") is compute_aria_advantage
    print("registry: get_adv_estimator_fn('aria') returns the registered estimator")
    # direct: every utterance of the games hashed (aria.py's --embedder hash), one kernel call
    texts = [u for g in games for u in g[0]]
    info = {}
    kernel = aria_advantages(
        traj=[t[1] for t in turns], player=[t[3] for t in turns], outcome=[t[4] for t in turns],
        history=[list(range(4 * g, 4 * g + p + 1)) for g, p in
                 zip([int(t[1][1]) for t in turns], [t[7] for t in turns])],
        utterances=texts, exact=[False, True] * (len(texts) // 2), embeddings=hash_embed(texts),
        gamma=0.5, info=info)
    tok = tiny_tokenizer("is it an animal a cat dog bird yes no finished".split())
    rows = verl_rows([tok.encode(" ".join(g[0][:t[7]]).lower().replace("?", ""),
                                 add_special_tokens=False) or [3] for t in turns
                      for g in [games[int(t[1][1])]]],
                     [tok.encode(games[int(t[1][1])][0][t[7]].lower().replace("?", ""),
                                 add_special_tokens=False) + [tok.eos_token_id] for t in turns])
    columns = {}
    perm = torch.randperm(n)  # rows in any order, as after balance_batch
    for key, values in zip(("uid",) + TURN_FIELDS, zip(*turns)):
        columns[key] = np.empty(n, dtype=object)  # one object per row (the game's lists)
        columns[key][:] = [values[i] for i in perm.tolist()]
    mask = rows["response_mask"]
    data = DataProto.from_dict(
        tensors={**{k: v[perm] for k, v in rows.items()}, "token_level_rewards": mask[perm] * 0},
        non_tensors=columns)
    adv = compute_advantage_with_turns(data, config).batch["advantages"]
    expected = torch.tensor(kernel, dtype=torch.float32)[perm].unsqueeze(-1) * mask[perm]
    assert torch.allclose(adv, expected, atol=1e-6), (adv, expected)
    print(f"advantages [{n}, {mask.shape[1]}] (rows shuffled) == kernel per turn x response_mask: "
          f"max |diff| {float((adv - expected).abs().max()):.1e}")
    scores = ", ".join(f"{k}: {s:.3f}" for k, s in info["scores"].items())
    print(f"  one HAC over the {len(set(texts[0::2]))} distinct questions (hash_embed), k* = "
          f"{info['k']} (SplitScores {scores})")
    print("  game turn question            R   raw return  weight")
    for t, r, k in zip(turns, info["returns"], kernel):
        print(f"  {t[1]:>4} {t[2]:>4} {t[5][t[7]]:<20} {t[4]:.0f}   {r:8.2f}  {k:6.3f}")

    # ARIA's loss through verl's actor loss: ppo_loss with gpg, seq-mean-token-sum, B = n rows
    model = tiny_causal_lm(tok)
    weights = torch.tensor(kernel).float()[:, None] * mask
    data = DataProto.from_dict(tensors={**rows, "advantages": weights,
                                        "old_log_probs": torch.zeros_like(mask)})
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=n)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=n,
                        loss_agg_mode="seq-mean-token-sum",
                        policy_loss=PolicyLossConfig(loss_mode="gpg"), use_torch_compile=False)
    verl_loss, _ = ppo_loss(actor, {"log_probs": verl_log_probs(model, rows)[0]}, td)
    P = rows["prompts"].shape[1]
    lp, _ = completion_logprobs(model, tok, [p[m.bool()].tolist() for p, m in
                                             zip(rows["prompts"], rows["attention_mask"][:, :P])],
                                [r[m.bool()].tolist() for r, m in zip(rows["responses"], mask)])
    reference = reinforce_loss(lp.sum(-1), torch.tensor(kernel).float(), n)
    params = list(model.parameters())
    grads = torch.autograd.grad(verl_loss, params)
    ref_grads = torch.autograd.grad(reference, params)
    err = max(float((a - b).abs().max() / (b.abs().max() + 1e-12))
              for a, b in zip(grads, ref_grads))
    assert abs(float(verl_loss) - float(reference)) < 1e-5 and err < 1e-4, (verl_loss, err)
    print(f"loss: verl's ppo_loss (gpg, seq-mean-token-sum) {float(verl_loss):.6f} == aria.py's "
          f"reinforce_loss {float(reference):.6f};\n  gradients: max relative diff {err:.1e} "
          f"over {len(params)} tensors")
    print("PASS aria_verl")


if __name__ == "__main__":
    torch.set_num_threads(1)
    check()
