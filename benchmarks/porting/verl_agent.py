"""All five methods in verl-agent: one module, `turn_credit.py`, put beside verl-agent's `gigpo/`
package, plus a few changed lines in its rollout loop and trainer (docs/porting.md, "verl-agent").

verl-agent (checked against commit 796ed310287fa605c9292a0fce07a86d79fde05e) rolls out step by
step: every env step of every trajectory is one row, its response that step's action. It vendors
its own verl (0.3.1.dev), whose core_algos has no estimator registry, so the module does not
register anything: the trainer's `compute_advantage` gets one more branch that calls
`compute_turn_advantage`. What the kernels read and verl-agent does not keep is recorded by two
calls in the rollout loop (`record_step`, `record_outcome`); `turn_arrays` turns the batch the
trainer holds (rows reordered by balance_batch, some rows copied by adjust_batch) back into each
trajectory's turns in order, and each turn's advantage goes onto every row that holds that turn.

Run by benchmarks/porting_check.py (the check below the module): docs/porting_check.md.
"""

from collections import Counter

import numpy as np
import torch

TURN_ESTIMATORS = ("graphgpo", "istar", "delta_belief", "aria", "epo")
WEBSHOP_SCORE = "webshop_task_score (not success_rate)"  # verl-agent's key for the graded score


def _per_env(values, n):
    """One object per env (strings, arrays, None) as an object array of length n."""
    out = np.empty(n, dtype=object)
    if values is None:
        return out
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    out[:] = [values[i] for i in range(n)]
    return out


def record_step(batch, step, next_obs, text_actions, infos):
    """rollout_loop.py, in vanilla_multi_turn_loop right after `envs.step(text_actions)`: the
    step's position (balance_batch reorders the rows later), where it landed (the next anchor
    observation: GraphGPO's next_state, lost otherwise for a trajectory's last step), the action
    as text (ARIA's utterances, ΔBelief's repeated flag) and the env's progress where its infos
    report one (EPO's rule marks)."""
    n = len(text_actions)
    nt = batch.non_tensor_batch
    nt["step"] = np.full(n, step, dtype=np.int64)
    nt["next_anchor_obs"] = _per_env(next_obs.get("anchor"), n)
    nt["action_text"] = _per_env(list(text_actions), n)
    if "progress" in infos[0]:
        nt["progress"] = np.array([float(info["progress"]) for info in infos], dtype=object)


def record_outcome(row, success, bs):
    """rollout_loop.py, gather_rollout_data, on each kept row of env `bs`: the trajectory's own
    win flag and score (verl-agent stores only their batch means on the rows). The score is
    WebShop's graded task score where the env reports one, else the win flag."""
    row["won"] = float(success["success_rate"][bs])
    row["episode_score"] = float(success.get(WEBSHOP_SCORE, success["success_rate"])[bs])


def state_key(x):
    """A hashable state key from an anchor observation (text, or an array for image envs)."""
    if isinstance(x, np.ndarray):
        return (x.shape, x.tobytes())
    if isinstance(x, (list, tuple)):
        return tuple(state_key(v) for v in x)
    return x


def turn_arrays(data):
    """verl-agent's batch -> the per-turn arrays the kernels read. Rows that hold the same turn
    (adjust_batch copies random rows to fill the last micro-batch) are one turn; trajectories in
    the order they first appear, each one's turns by `step`. Returns a dict of numpy arrays, one
    entry per turn, with `rows` (a row holding the turn) and `row_turn` (each row's turn)."""
    nt = data.non_tensor_batch
    need = ["uid", "traj_uid", "step", "anchor_obs", "next_anchor_obs", "is_action_valid",
            "won", "episode_score", "rewards", "action_text"]
    missing = [k for k in need if k not in nt]
    if missing:
        raise ValueError(f"verl-agent batch lacks {missing}: add record_step / record_outcome "
                         "to the rollout loop")
    key = list(zip(nt["traj_uid"], nt["step"].astype(int)))
    first, rank = {}, {}
    for i, (traj, step) in enumerate(key):
        first.setdefault((traj, step), i)
        rank.setdefault(traj, len(rank))
    turns = sorted(first, key=lambda k: (rank[k[0]], k[1]))
    index = {k: j for j, k in enumerate(turns)}
    rows = np.array([first[k] for k in turns])
    out = {"rows": rows, "row_turn": np.array([index[k] for k in key])}
    for name, field in [("group", "uid"), ("traj", "traj_uid"), ("turn", "step"),
                        ("won", "won"), ("score", "episode_score"), ("reward", "rewards"),
                        ("action", "action_text")]:
        out[name] = np.asarray(nt[field][rows])
    out["turn"] = out["turn"].astype(int)
    out["won"] = out["won"].astype(float) > 0.5
    out["score"] = out["score"].astype(float)
    out["invalid"] = ~nt["is_action_valid"][rows].astype(bool)
    out["state"] = [state_key(nt["anchor_obs"][i]) for i in rows]
    out["next_state"] = [state_key(nt["next_anchor_obs"][i]) for i in rows]
    for extra in ("progress", "critical", "log_beliefs"):
        if extra in nt:
            out[extra] = nt[extra][rows]
    return out


def _outcome(t, opts):
    """The trajectory outcome a method reads: "won" (0/1, default) or "score" (graded)."""
    which = opts.pop("outcome", "won")
    return t["won"].astype(float) if which == "won" else t["score"]


def graphgpo_turns(t, data, opts):
    """GraphGPO (binary success: the win flag, or with success_threshold the graded score at or
    above it). omega is required (graphgpo.py's OMEGA_BY_ENV)."""
    from graphgpo import graphgpo_advantages

    threshold = opts.pop("success_threshold", None)
    success = t["won"] if threshold is None else t["score"] >= float(threshold)
    return graphgpo_advantages(group=t["group"], traj=t["traj"], state=t["state"],
                               next_state=t["next_state"], success=success,
                               invalid=t["invalid"], **opts)


def istar_turns(t, data, opts):
    """iStar: the batch must hold `prm_log_probs` (the PRM group's compute_log_prob) besides the
    actor's `old_log_probs`; each turn's token log-ratios are read on its response tokens."""
    from istar import istar_turn_advantages

    opts.pop("dpo_reduce", None)
    outcome = _outcome(t, opts)
    mask = data.batch["response_mask"][t["rows"]]
    ratio = (data.batch["prm_log_probs"] - data.batch["old_log_probs"])[t["rows"]].double()
    return istar_turn_advantages(group=t["group"], traj=t["traj"], outcome=outcome,
                                 prm_log_ratios=[r[m > 0] for r, m in zip(ratio, mask)], **opts)


def delta_belief_turns(t, data, opts):
    """ΔBelief: rows carry `log_beliefs` [b_t, b_t+1] from the belief pass (delta_belief_verl.py's
    belief_batch); a turn repeats when its action text equals an earlier one of its trajectory."""
    from delta_belief import delta_belief_advantages

    seen, repeated = {}, []
    for traj, action in zip(t["traj"], t["action"]):
        said = seen.setdefault(traj, set())
        repeated.append(action.strip() in said)
        said.add(action.strip())
    return delta_belief_advantages(group=t["group"], traj=t["traj"], turn=t["turn"],
                                   success=t["won"], invalid=t["invalid"], repeated=repeated,
                                   log_beliefs=np.array(list(t["log_beliefs"]), dtype=float),
                                   **opts)


def aria_turns(t, data, opts):
    """ARIA: each trajectory's utterances are its anchor observations (labelled by their exact
    text) and its actions (clustered), in order; one clustering over the batch."""
    from aria import aria_advantages, hash_embed

    embed = opts.pop("embed", hash_embed)
    outcome = _outcome(t, opts)
    texts, exact, history, start = [], [], [], {}
    for traj, state, action in zip(t["traj"], t["state"], t["action"]):
        start.setdefault(traj, len(texts))
        texts += [str(state), action]
        exact += [True, False]
        history.append(list(range(start[traj], len(texts))))
    clustered = [u for u, x in enumerate(exact) if not x]
    distinct = {}
    which = [distinct.setdefault(texts[u], len(distinct)) for u in clustered]
    vectors = np.asarray(embed(list(distinct)), dtype=np.float64).reshape(len(distinct), -1)
    embeddings = np.zeros((len(texts), vectors.shape[1]))
    embeddings[clustered] = vectors[which]
    return aria_advantages(traj=t["traj"], player=["agent"] * len(t["traj"]), outcome=outcome,
                           history=history, utterances=texts, exact=exact,
                           embeddings=embeddings, **opts)


def epo_turns(t, data, opts):
    """EPO: marks from the judge (rows carry `critical`) or, with prm=rule, rule_critical_turns
    on the trajectory's progress (0 before its first step, then each step's `progress`). The
    weights are scaled for a REINFORCE loss with loss_agg_mode=seq-mean-token-mean: A N / (M T_j)
    (N rows, M trajectories with a weight, T_j turns), as epo_verl.py does."""
    from epo import epo_advantages, rule_critical_turns

    prm = opts.pop("prm", "llm")
    rule = {k: opts.pop(k) for k in ("k", "min_gain", "min_final") if k in opts}
    start = float(opts.pop("progress_start", 0.0))
    outcome = _outcome(t, opts)
    if prm == "rule":
        marks = {}
        for traj in dict.fromkeys(t["traj"]):
            mine = [float(p) for m, p in zip(t["traj"], t["progress"]) if m == traj]
            marks[traj] = iter(rule_critical_turns([start] + mine, **rule))
        critical = [next(marks[m]) for m in t["traj"]]
    else:
        critical = t["critical"].astype(bool)
    weights = epo_advantages(t["traj"], t["turn"], outcome, critical, **opts)
    length = Counter(t["traj"])
    live = {m for m, w in zip(t["traj"], weights) if w != 0}
    rows = len(data)
    return np.array([w * rows / (max(1, len(live)) * length[m])
                     for m, w in zip(t["traj"], weights)])


TURN_FUNCTIONS = {"graphgpo": graphgpo_turns, "istar": istar_turns,
                  "delta_belief": delta_belief_turns, "aria": aria_turns, "epo": epo_turns}


def compute_turn_advantage(data, adv_estimator, config):
    """The trainer's branch for the five methods: the kernel on the batch's turns, each turn's
    advantage on every response token of every row that holds it. config: the `algorithm` node;
    its entry named after the method holds the options (omega, beta, ...)."""
    name = str(getattr(adv_estimator, "value", adv_estimator))
    opts = dict(config.get(name, None) or {}) if config is not None else {}
    t = turn_arrays(data)
    per_turn = np.asarray(TURN_FUNCTIONS[name](t, data, opts), dtype=np.float64)
    mask = data.batch["response_mask"]
    adv = torch.as_tensor(per_turn[t["row_turn"]], dtype=torch.float32, device=mask.device)
    data.batch["advantages"] = adv.unsqueeze(-1) * mask
    data.batch["returns"] = data.batch["advantages"].clone()
    return data


def istar_prm_batch(data, config):
    """The PRM's DPO step (istar.py, Eq. 2) as a batch for the PRM worker group's update_actor:
    each distinct turn once, advantages −β dL/dr on its tokens (L the trajectory-DPO loss of the
    success/failure pairs of a group at the log-ratios the advantages used), old_log_probs = the
    PRM's own (ratio 1). With a no-ratio loss summed over tokens this is one step on L.
    Returns (batch, L)."""
    from istar import trajectory_dpo_loss

    opts = dict(config.get("istar", None) or {})
    beta, reduce = float(opts.get("beta", 0.05)), opts.get("dpo_reduce", "mean")
    t = turn_arrays(data)
    rows = torch.as_tensor(t["rows"])
    part = data.select_idxs(rows)
    mask = part.batch["response_mask"].float()  # verl-agent's is the attention mask's dtype
    traj = np.unique(t["traj"].astype(str), return_inverse=True)[1]
    first = np.unique(traj, return_index=True)[1]
    group = np.unique(t["group"].astype(str), return_inverse=True)[1]
    log_ratio = part.batch["prm_log_probs"] - part.batch["old_log_probs"]
    rewards = beta * (log_ratio * mask).sum(-1).double().requires_grad_(True)  # Eq. 1, r_s
    loss = trajectory_dpo_loss(rewards, torch.as_tensor(traj), torch.as_tensor(t["won"][first]),
                               torch.as_tensor(group[first]), reduce)
    (grad,) = torch.autograd.grad(loss, rewards)
    part.batch["advantages"] = -beta * grad.float()[:, None] * mask
    part.batch["old_log_probs"] = part.batch["prm_log_probs"]
    return part, float(loss.detach())


# ---- check (not part of the snippet) ----------------------------------------------------------
# Five games in two groups, each step with every method's signal; rolled out into rows the way
# verl-agent's TrajectoryCollector lays them out (per step, per env; inactive rows dropped),
# then adjust_batch's copies and balance_batch's reorder; the five branches against the kernels
# called directly on the games' turns.
# (name, task, steps, won, score); a step: (anchor obs, action, next anchor obs, valid, env reward,
# progress after it, [b_t, b_t+1], the action's token log-ratios, judge's mark)
NAN = float("nan")
GAMES = [
    ("A0", "A", [("a", "go right", "b", True, 0.0, 0.5, [-3, -2], [1.0, 1.0], True),
                 ("b", "go up", "win", True, 10.0, 1.0, [-2, NAN], [2.0, 2.0], True)], 1, 1.0),
    ("A1", "A", [("a", "go left", "c", True, 0.0, 0.0, [-3, -3], [-2.0, -2.0], False),
                 ("c", "go left", "c", True, 0.0, 0.0, [-3, -3], [0.5, 0.0], False),
                 ("c", "go up", "c", True, 0.0, 0.2, [-3, -2.5], [0.0, 1.0], False)], 0, 0.2),
    ("A2", "A", [("a", "go right", "b", True, 0.0, 0.5, [-3, -2], [0.0, 2.0], False),
                 ("b", "go down", "d", True, 0.0, 0.5, [-2, -2.5], [-1.0, 0.0], False)], 0, 0.5),
    ("B0", "B", [("x", "push box", "y", True, 0.0, 0.4, [-2, -1.5], [0.5, 0.5], True),
                 ("y", "push box", "z", True, 10.0, 1.0, [-1.5, NAN], [1.0, -0.5], True)], 1, 1.0),
    ("B1", "B", [("x", "push box", "y", True, 0.0, 0.4, [-2, -1.5], [-1.0, 0.2], False),
                 ("y", "go back", "x", True, 0.0, 0.0, [-1.5, -2], [0.3, 0.3], False),
                 ("x", "jump", "q", False, 0.0, 0.0, [-2, -2.5], [-0.5], False)], 0, 0.0),
    ("B2", "B", [("x", "jump", "q", True, 0.0, 0.1, [-2, -2.2], [0.2], False)], 0, 0.3),
]
OPTIONS = {"graphgpo": {"omega": 0.5, "eps": 0.0},
           "istar": {"beta": 0.05, "alpha": 1.0, "dpo_reduce": "mean"},
           "delta_belief": {"lam": 0.1},
           "aria": {"gamma": 0.5},
           "epo": {"prm": "llm", "gamma": 0.5, "outcome": "score"}}


def rollout_like_verl_agent(tok, n, max_steps, seed=0):
    """The rows verl-agent's vanilla_multi_turn_loop and gather_rollout_data build for GAMES (one
    env per game, env.rollout.n = n consecutive envs per task), with record_step/record_outcome:
    a DataProto of one row per active step, trajectory after trajectory, each in step order."""
    from verl import DataProto
    from verl.utils.dataset.rl_dataset import collate_fn

    rng = np.random.default_rng(seed)
    envs = len(GAMES)
    uid = np.array([f"task-{GAMES[i - i % n][1]}" for i in range(envs)], dtype=object)
    traj_uid = np.array([f"traj-{g[0]}" for g in GAMES], dtype=object)  # uuids in verl-agent
    done = np.zeros(envs, dtype=bool)
    per_env = [[] for _ in range(envs)]
    episode_rewards = np.zeros(envs, dtype=np.float32)
    won_last = np.zeros(envs)
    for step in range(max_steps):
        active = ~done
        steps = [g[2][min(step, len(g[2]) - 1)] for g in GAMES]  # a done env repeats; dropped
        obs = [s[0] for s in steps]
        actions = [s[1] for s in steps]
        prompts = [tok.encode(f"see {o}", add_special_tokens=False) for o in obs]
        responses = [tok.encode(a, add_special_tokens=False) for a in actions]
        P, R = max(map(len, prompts)), max(map(len, responses))
        rows = []
        for i in range(envs):
            p, r = prompts[i], responses[i]
            pm = [0] * (P - len(p)) + [1] * len(p)
            rm = [1] * len(r) + [0] * (R - len(r))
            ids = [tok.pad_token_id] * (P - len(p)) + p + r + [tok.pad_token_id] * (R - len(r))
            attention = torch.tensor(pm + rm)
            rows.append({"input_ids": torch.tensor(ids), "attention_mask": attention,
                         "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                         "prompts": torch.tensor(ids[:P]), "responses": torch.tensor(ids[P:]),
                         "anchor_obs": obs[i], "index": i, "data_source": "scripted"})
        batch = DataProto.from_single_dict(collate_fn(rows))
        batch.non_tensor_batch["uid"] = uid
        batch.non_tensor_batch["traj_uid"] = traj_uid
        dones = np.array([step >= len(g[2]) - 1 for g in GAMES])
        dones[1] = False  # A1: never done, cut off by max_steps
        rewards = np.array([s[4] for s in steps], dtype=np.float32)
        infos = [{"won": bool(g[3]) and step >= len(g[2]) - 1, "is_action_valid": s[3],
                  "progress": s[5]} for g, s in zip(GAMES, steps)]
        next_obs = {"text": None, "image": None, "anchor": [s[2] for s in steps]}
        batch.non_tensor_batch["is_action_valid"] = np.array(
            [info["is_action_valid"] for info in infos], dtype=bool)
        episode_rewards[active] += rewards[active]
        batch.non_tensor_batch["rewards"] = np.array(list(rewards), dtype=object)
        batch.non_tensor_batch["active_masks"] = np.array(list(active), dtype=object)
        record_step(batch, step, next_obs, actions, infos)  # the recipe's line
        # per-row signals a user's passes add (iStar's PRM, ΔBelief's belief pass, EPO's judge)
        batch.non_tensor_batch["log_beliefs"] = np.array([None] * envs, dtype=object)
        batch.non_tensor_batch["log_beliefs"][:] = [list(s[6]) for s in steps]
        batch.non_tensor_batch["critical"] = np.array([s[8] for s in steps], dtype=object)
        old = -torch.as_tensor(rng.uniform(0.1, 3.0, (envs, R)), dtype=torch.float32)
        ratio = torch.tensor([list(s[7]) + [0.0] * (R - len(s[7])) for s in steps])
        batch.batch["old_log_probs_rollout"] = old
        batch.batch["prm_minus_old"] = ratio
        for i in range(envs):
            row = {k: v[i] for k, v in batch.batch.items()}
            row.update({k: v[i] for k, v in batch.non_tensor_batch.items()})
            per_env[i].append(row)
        won_last[active] = [float(infos[i]["won"]) for i in np.flatnonzero(active)]
        done |= dones
        if done.all():
            break
    success = {"success_rate": won_last,
               "webshop_task_score (not success_rate)": np.array([g[4] for g in GAMES])}
    kept = []
    for bs in range(envs):  # gather_rollout_data: trajectory after trajectory, active rows only
        for row in per_env[bs]:
            if row["active_masks"]:
                row["episode_rewards"] = episode_rewards[bs]
                row["success_rate"] = float(np.mean(success["success_rate"]))  # a batch mean
                record_outcome(row, success, bs)  # the recipe's line
                kept.append(row)
    return DataProto.from_single_dict(collate_fn(kept))


def kernels_on_games(rows):
    """The kernels called directly on GAMES' turns (EPO's weights scaled by N = rows as its branch
    does). Returns (turns, per-turn columns, {method: per-turn values}, EPO's rule-mark values)."""
    from aria import aria_advantages, hash_embed
    from delta_belief import delta_belief_advantages
    from epo import epo_advantages, rule_critical_turns
    from graphgpo import graphgpo_advantages
    from istar import istar_turn_advantages

    turns = [(g[0], s) for g in GAMES for s in range(len(g[2]))]
    game = {g[0]: g for g in GAMES}
    col = {name: [] for name in ("group", "traj", "turn", "state", "next", "won", "score",
                                 "invalid", "ratio", "beliefs", "critical", "action")}
    for name, s in turns:
        g, st = game[name], game[name][2][s]
        for k, v in zip(col, (g[1], name, s, st[0], st[2], bool(g[3]), g[4], not st[3],
                              torch.tensor(st[7], dtype=torch.float64), st[6], st[8], st[1])):
            col[k].append(v)
    repeated = [any(col["action"][j] == col["action"][i] and col["traj"][j] == col["traj"][i]
                    for j in range(i)) for i in range(len(turns))]
    texts, exact, history = [], [], []
    for i, (name, s) in enumerate(turns):
        if s == 0:
            first = len(texts)
        texts += [col["state"][i], col["action"][i]]
        exact += [True, False]
        history.append(list(range(first, len(texts))))
    progress = {g[0]: [0.0] + [st[5] for st in g[2]] for g in GAMES}
    rule = [bool(rule_critical_turns(progress[n])[s]) for n, s in turns]
    weights = epo_advantages(col["traj"], col["turn"], col["score"], col["critical"], gamma=0.5)
    live = {m for m, w in zip(col["traj"], weights) if w != 0}
    epo_scaled = [w * rows / (len(live) * len(game[m][2]))
                  for m, w in zip(col["traj"], weights)]
    rule_w = epo_advantages(col["traj"], col["turn"], col["score"], rule, gamma=0.5)
    rule_live = {m for m, w in zip(col["traj"], rule_w) if w != 0}
    rule_scaled = [w * rows / (len(rule_live) * len(game[m][2]))
                   for m, w in zip(col["traj"], rule_w)]
    kernel = {
        "graphgpo": graphgpo_advantages(col["group"], col["traj"], col["state"], col["next"],
                                        col["won"], col["invalid"], omega=0.5, eps=0.0),
        "istar": istar_turn_advantages(col["group"], col["traj"],
                                       [float(w) for w in col["won"]], col["ratio"],
                                       beta=0.05, alpha=1.0),
        "delta_belief": delta_belief_advantages(col["group"], col["traj"], col["turn"],
                                                col["won"], col["invalid"], repeated,
                                                np.array(col["beliefs"], dtype=float), lam=0.1),
        "aria": aria_advantages(col["traj"], ["agent"] * len(turns),
                                [float(w) for w in col["won"]], history, texts, exact,
                                hash_embed(texts), gamma=0.5),
        "epo": np.array(epo_scaled),
    }
    col["repeated"], col["texts"], col["exact"], col["history"] = repeated, texts, exact, history
    return turns, col, kernel, rule_scaled


def check():
    from omegaconf import OmegaConf
    from tiny_lm import tiny_tokenizer
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    from graphgpo import graphgpo_advantages

    tok = tiny_tokenizer("see a b c d x y z q win go right left up down push box back jump"
                         .split())
    data = rollout_like_verl_agent(tok, n=3, max_steps=3)
    data.batch["response_mask"] = data.batch["attention_mask"][:, -data.batch["responses"].shape[1]:]
    data.batch["old_log_probs"] = data.batch.pop("old_log_probs_rollout") * data.batch["response_mask"]
    data.batch["prm_log_probs"] = (data.batch["old_log_probs"]
                                   + data.batch.pop("prm_minus_old") * data.batch["response_mask"])
    data.batch["token_level_rewards"] = torch.zeros_like(data.batch["old_log_probs"])
    turns = [(g[0], s) for g in GAMES for s in range(len(g[2]))]
    order = [(str(traj)[5:], int(s)) for traj, s in zip(data.non_tensor_batch["traj_uid"],
                                                         data.non_tensor_batch["step"])]
    assert order == turns, order  # gather_rollout_data: trajectory after trajectory, step order
    print(f"rollout: {len(GAMES)} envs (env.rollout.n 3), max_steps 3 -> {len(data)} rows, one per "
          f"active step,\n  trajectory after trajectory; fields: "
          f"{', '.join(sorted(data.non_tensor_batch))}")
    # adjust_batch (mode "copy"): random rows copied until the size divides the micro-batches
    rng = np.random.default_rng(1)
    copies = rng.choice(len(data), 16 - len(data), replace=False)
    data = type(data).concat([data, data.select_idxs(copies)])
    # balance_batch: verl's seqlen-balanced partitions over 2 ranks, then DataProto.reorder
    seqlen = data.batch["attention_mask"].sum(-1).tolist()
    parts = get_seqlen_balanced_partitions(seqlen, k_partitions=2, equal_size=True)
    data.reorder(torch.tensor([j for p in parts for j in p]))
    row_turn = [turns.index((str(traj)[5:], int(s))) for traj, s in
                zip(data.non_tensor_batch["traj_uid"], data.non_tensor_batch["step"])]
    print(f"adjust_batch copied {len(copies)} rows (16 in all), balance_batch reordered them: "
          f"row -> turn {row_turn}")

    turns, col, kernel, rule_scaled = kernels_on_games(rows=len(data))
    mask = data.batch["response_mask"].float()
    failed = []
    print("  traj step  state->next  action      won score  " + "  ".join(
        f"{m:>12}" for m in TURN_ESTIMATORS))
    for i, (name, s) in enumerate(turns):
        print(f"  {name:>4} {s:>4}  {col['state'][i]:>5}->{col['next'][i]:<5} "
              f"{col['action'][i]:<10} {int(col['won'][i]):>3} {col['score'][i]:5.1f}  "
              + "  ".join(f"{kernel[m][i]:12.3f}" for m in TURN_ESTIMATORS))
    for method in TURN_ESTIMATORS:
        config = OmegaConf.create({"adv_estimator": method, method: OPTIONS[method]})
        out = compute_turn_advantage(data, method, config).batch["advantages"]
        expected = torch.tensor([kernel[method][t] for t in row_turn]).float()[:, None] * mask
        err = float((out - expected).abs().max())
        ok = err < 1e-5 and bool(torch.any(expected != 0))
        if method == "epo":  # the rule marks from the recorded progress
            config.epo.prm = "rule"
            out = compute_turn_advantage(data, method, config).batch["advantages"]
            rule_exp = torch.tensor([rule_scaled[t] for t in row_turn]).float()[:, None] * mask
            err = max(err, float((out - rule_exp).abs().max()))
            ok = ok and err < 1e-5
        print(f"{method}: advantages [{len(data)}, {mask.shape[1]}] (copies, rows reordered) == "
              f"kernel per turn x response_mask: max |diff| {err:.1e}")
        if method == "graphgpo":  # the graded option: success = score >= 0.5 (A2 and B0 too)
            config.graphgpo.success_threshold = 0.5
            out = compute_turn_advantage(data, method, config).batch["advantages"]
            graded = graphgpo_advantages(col["group"], col["traj"], col["state"], col["next"],
                                         np.array(col["score"]) >= 0.5, col["invalid"],
                                         omega=0.5, eps=0.0)
            g_exp = torch.tensor([graded[t] for t in row_turn]).float()[:, None] * mask
            g_err = float((out - g_exp).abs().max())
            print(f"  with success_threshold 0.5 on the graded score: max |diff| {g_err:.1e}")
            ok = ok and g_err < 1e-5
        if not ok:
            failed.append(method)

    # what the adapter undoes: the kernel on the rows as the trainer holds them
    nt = data.non_tensor_batch
    naive = graphgpo_advantages(nt["uid"], nt["traj_uid"], list(nt["anchor_obs"]),
                                list(nt["next_anchor_obs"]), nt["won"].astype(bool),
                                ~nt["is_action_valid"].astype(bool), omega=0.5, eps=0.0)
    right = np.array([kernel["graphgpo"][t] for t in row_turn])
    print(f"graphgpo on the rows as held (copies kept, balance_batch's order): max |diff| "
          f"{np.abs(naive - right).max():.2f} from the kernel on the turns")

    # iStar's PRM step: the batch for the PRM group's update, against the DPO loss directly
    from istar import implicit_step_rewards, trajectory_dpo_loss
    config = OmegaConf.create({"istar": OPTIONS["istar"]})
    prm_batch, dpo = istar_prm_batch(data, config)
    t = turn_arrays(data)
    prm_lp = prm_batch.batch["prm_log_probs"].clone().requires_grad_(True)
    pmask = prm_batch.batch["response_mask"].float()
    surrogate = -(prm_batch.batch["advantages"] * prm_lp * pmask).sum()  # no ratio, token-sum
    (g1,) = torch.autograd.grad(surrogate, prm_lp)
    traj = np.unique(t["traj"].astype(str), return_inverse=True)[1]
    first = np.unique(traj, return_index=True)[1]
    group = np.unique(t["group"].astype(str), return_inverse=True)[1]
    direct = trajectory_dpo_loss(
        implicit_step_rewards(prm_lp.double(), data.batch["old_log_probs"][t["rows"]].double(),
                              pmask, 0.05),
        torch.as_tensor(traj), torch.as_tensor(t["won"][first]), torch.as_tensor(group[first]))
    (g2,) = torch.autograd.grad(direct, prm_lp)
    err = float((g1 - g2).abs().max() / g2.abs().max())
    print(f"istar PRM batch: {len(prm_batch)} rows (each turn once); -Σ A log π_φ has the gradient "
          f"of the\n  trajectory-DPO loss ({dpo:.4f} == {float(direct.detach()):.4f}): max relative diff "
          f"{err:.1e}")
    if err > 1e-5 or abs(dpo - float(direct.detach())) > 1e-6 or len(prm_batch) != len(turns):
        failed.append("istar")
    for method in TURN_ESTIMATORS:
        if method not in failed:
            print(f"PASS {method}_verl_agent")
    if failed:
        raise SystemExit(f"FAILED: {sorted(set(failed))}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    check()
