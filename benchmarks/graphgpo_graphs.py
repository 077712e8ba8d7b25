"""graphgpo.py with the graphs of its rollout groups measured: every training iteration's metrics
also describe the state-transition graph of each group (section 2's `graph_stats`, on the same graph
the credit builds), averaged over the iteration's groups.

    python benchmarks/graphgpo_graphs.py [graphgpo.py flags]    # e.g. --step-advantage none --seed 4

It runs graphgpo.py's own `main` with `compute_advantages` wrapped (`with_graph_metrics`), so the run
is the same as `python graphgpo.py` with the same flags, plus these `credit/` keys in metrics.jsonl:

- graph_nodes, graph_edges (distinct (s, s') pairs), mean_distance (over the non-goal nodes)
- singleton_frac: fraction of the steps alone in their state group (they get A^G = 0)
- group_success_frac: fraction of the groups with a success (the others have d = 1 everywhere)
- graph_step_reward_mean: the mean step reward R^G (Eq. 4)
- graph_seconds: the credit of the iteration (compute_advantages); benchmarks/graphgpo_bench.py
  divides it by perf/iteration_seconds (the paper reports 0.04% of the time)

The graph is measured in all three --step-advantage modes; it drives the advantage only in `graph`.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import graphgpo  # noqa: E402


def graph_metrics(episodes, args) -> dict:
    """The `credit/` graph metrics of a batch of episodes, one graph per group (`group_id`)."""
    by_group = defaultdict(list)
    for ep in episodes:
        by_group[ep.group_id].append(ep)
    graphs = []
    for group in by_group.values():
        node_of = None
        if args.state_match == "fuzzy":
            keys = dict.fromkeys(s for ep in group for s in ep.states)
            node_of = graphgpo.fuzzy_node_map(keys, args.similarity_threshold)
        graphs.append(graphgpo.graph_stats([ep.states for ep in group], [ep.success for ep in group],
                                           args.omega, args.r_succ, [ep.invalid for ep in group],
                                           args.invalid_penalty, node_of, args.step_cost))

    def mean(key):
        return float(np.mean([g[key] for g in graphs]))

    return {"credit/graph_nodes": mean("nodes"), "credit/graph_edges": mean("edges"),
            "credit/mean_distance": mean("mean_distance"),
            "credit/graph_step_reward_mean": mean("step_reward_mean"),
            "credit/singleton_frac": sum(g["singleton_steps"] for g in graphs)
            / max(sum(g["steps"] for g in graphs), 1),
            "credit/group_success_frac": float(np.mean([any(ep.success for ep in g)
                                                        for g in by_group.values()]))}


def with_graph_metrics(compute_advantages):
    """`compute_advantages` whose statistics also hold `graph_metrics` and `credit/graph_seconds`."""
    def wrapped(episodes, args, signal=None):
        start = time.perf_counter()
        samples, stats = compute_advantages(episodes, args, signal)
        seconds = time.perf_counter() - start
        return samples, {**graph_metrics(episodes, args), **stats, "credit/graph_seconds": seconds}
    return wrapped


def main(argv=None):
    import tyro

    from common.models import UserError

    graphgpo.compute_advantages = with_graph_metrics(graphgpo.compute_advantages)
    try:
        return graphgpo.main(tyro.cli(graphgpo.Args, args=argv))
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
