"""ARIA's two-player evaluation per role and scripted style: the payoff share and the win rate of each
cell, sampled and greedy. `aria.py` logs them pooled over the cells (its main metric `eval/payoff_share`,
`eval/win_rate`, docs/aria.md, "Evaluation"); this splits them up again.

    python benchmarks/aria_cells.py RUN_DIR              # the run's last evaluation (its adapter/)
    python benchmarks/aria_cells.py RUN_DIR --before     # its first evaluation (the policy before training)
    python benchmarks/aria_cells.py RUN_DIR --metrics    # sampled shares of every evaluation, plays nothing

A replay plays the evaluation's own games (`aria.eval_games`: the run's arguments, test tasks and common
random numbers), so its pooled numbers are the run's `eval/payoff_share`, `eval/payoff_share_greedy` and
`eval/win_rate` (on the run's torch thread count) and it costs one evaluation. `--metrics` reads the
sampled shares from each evaluation's per-game list (`eval/payoff_share_episodes`, the cells' games in
order); the greedy games and the win rates need a replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aria  # noqa: E402


def run_args(run_dir: Path) -> aria.Args:
    """The run's arguments, as resolved (its config.json)."""
    saved = json.loads((Path(run_dir) / "config.json").read_text())
    names = {f.name for f in dataclasses.fields(aria.Args)}
    args = aria.Args(**{k: v for k, v in saved.items() if k in names})
    return dataclasses.replace(args, eval_opponents=tuple(args.eval_opponents))


def cell_names(args: aria.Args, probe) -> list[str]:
    """The evaluation's cells in the order `aria.eval_games` plays them: each role against each style."""
    styles = list(args.eval_opponents) or list(probe.opponent_styles())
    return [f"{role}_vs_{style}" for role in probe.players for style in styles]


def cells(games) -> dict:
    """Per cell of `aria.eval_games`' [(name, sampled, greedy)]: `eval/win_rate[_greedy]_<cell>` and
    `eval/payoff_share[_greedy]_<cell>`; per role, `eval/win_rate_<role>`: the mean over its styles."""
    out, roles = {}, {}
    for name, sampled, greedy in games:
        for kind, eps in (("", sampled), ("_greedy", greedy)):
            out[f"eval/win_rate{kind}_{name}"] = float(np.mean([ep.success for ep in eps]))
            out[f"eval/payoff_share{kind}_{name}"] = float(np.mean([ep.share for ep in eps]))
        roles.setdefault(name.split("_vs_")[0], []).append(out[f"eval/win_rate_{name}"])
    return {**out, **{f"eval/win_rate_{role}": float(np.mean(v)) for role, v in roles.items()}}


def shares_from_metrics(run_dir: Path) -> list[dict]:
    """Per evaluation in metrics.jsonl: its iteration and the sampled payoff share of each cell, the mean
    of the cell's stretch of `eval/payoff_share_episodes` (every cell plays the same number of games)."""
    args = run_args(run_dir)
    _, _, probe, _ = aria.make_env(args)
    names = cell_names(args, probe)
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        games = row.get("eval/payoff_share_episodes")
        if games is None:
            continue
        n = len(games) // len(names)
        out.append({"iteration": row["iteration"], **{f"eval/payoff_share_{name}": float(np.mean(games[i * n:(i + 1) * n]))
                                                       for i, name in enumerate(names)}})
    return out


def replay(run_dir: Path, before: bool = False) -> dict:
    """The run's last evaluation (its saved adapter) or, `before`, its first (the policy as loaded), played
    again: `cells` of its games and the pooled `eval/payoff_share`, `eval/payoff_share_greedy`,
    `eval/win_rate` as `aria.evaluate` computes them."""
    import torch
    from common.models import load_policy

    run_dir = Path(run_dir)
    args = run_args(run_dir)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    aria.seed_everything(args.seed)
    args, new_env, probe, _ = aria.make_env(args)
    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                             lora_dropout=args.lora_dropout)
    if not before:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(run_dir / "adapter" / "adapter_model.safetensors")))
    tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]
    games = aria.eval_games(model, tok, new_env, probe, tasks, args, two_player=True)
    sampled, greedy = ([ep for g in games for ep in g[i]] for i in (1, 2))
    return {**cells(games), "eval/payoff_share": float(np.mean([ep.share for ep in sampled])),
            "eval/payoff_share_greedy": float(np.mean([ep.share for ep in greedy])),
            "eval/win_rate": float(np.mean([np.mean([ep.success for ep in g[1]]) for g in games]))}


def table(res: dict) -> str:
    names = [k.removeprefix("eval/payoff_share_") for k in res
             if k.startswith("eval/payoff_share_") and "_vs_" in k and "_greedy_" not in k]
    lines = ["| cell | payoff share, sampled | greedy | win rate, sampled | greedy |", "|---|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n.replace('_vs_', ' vs ')} | {res[f'eval/payoff_share_{n}']:.3f} | "
                     f"{res[f'eval/payoff_share_greedy_{n}']:.3f} | {res[f'eval/win_rate_{n}']:.3f} | "
                     f"{res[f'eval/win_rate_greedy_{n}']:.3f} |")
    lines.append(f"| **mean (the main metric)** | **{res['eval/payoff_share']:.3f}** | "
                 f"**{res['eval/payoff_share_greedy']:.3f}** | {res['eval/win_rate']:.3f} | |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a two-player aria.py run directory (config.json, adapter/, metrics.jsonl)")
    p.add_argument("--before", action="store_true", help="replay the first evaluation (no adapter)")
    p.add_argument("--metrics", action="store_true", help="only the sampled shares, from metrics.jsonl")
    p.add_argument("--out", help="also write the numbers to this JSON file")
    args = p.parse_args()
    if args.metrics:
        res = shares_from_metrics(args.run_dir)
        for row in res:
            print(f"iteration {row.pop('iteration')}: "
                  + ", ".join(f"{k.removeprefix('eval/payoff_share_')} {v:.3f}" for k, v in row.items()))
    else:
        res = replay(args.run_dir, before=args.before)
        summary = Path(args.run_dir) / "summary.json"
        if summary.is_file():
            logged = json.loads(summary.read_text())["first_eval" if args.before else "last_eval"]
            print(f"the run logged eval/payoff_share {logged['eval/payoff_share']:.4f}, replayed "
                  f"{res['eval/payoff_share']:.4f}")
        print(table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
