"""verl 0.9.1's default (v1) trainer: a registered trainer whose `_compute_advantage` hands the
per-row fields to the five estimators of the verl snippets (<method>_verl.py), and a setup hook
that imports it in the Ray actor where the trainer runs.

The v1 trainer (`trainer.use_v1=True`, the default) keeps the batch in TransferQueue and its
`_compute_advantage` reads a fixed list of fields (uid, response_mask, rm_scores, log-probs,
values); an agent loop's `extra_fields` are stored as one field, `extra_fields`, a dict per row,
under the key `{uid}_{session}_{i}` (i: the loop's i-th output of that session). The override
also reads `extra_fields` (and iStar's `prm_log_probs`), unpacks the estimator's fields into
non_tensor_batch (a missing `traj_uid` / `turn`: the key's `{uid}_{session}` / `i`) and calls the
snippet's `compute_advantage_with_turns`. The trainer is `TurnCreditTrainer`, registered as
`trainer.v1.trainer_mode=sync_turns`; any other estimator goes to verl's own code.

Run by benchmarks/porting_check.py (the check below the snippet): docs/porting_check.md.
"""

import importlib

import numpy as np
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

# estimator -> the snippet module that registers it, and the per-row fields it reads
TURN_ESTIMATORS = {
    "graphgpo": ("graphgpo_verl", ("traj_uid", "turn", "state", "next_state", "success",
                                   "invalid")),
    "istar": ("istar_verl", ("traj_uid", "turn", "outcome", "success")),
    "delta_belief": ("delta_belief_verl", ("traj_uid", "turn", "success", "invalid", "repeated",
                                           "log_beliefs")),
    "aria": ("aria_verl", ("traj_uid", "turn", "player", "outcome", "utterances", "exact",
                           "pos")),
    "epo": ("epo_verl", ("traj_uid", "turn", "outcome")),  # + critical, or progress (prm=rule)
}


def turn_fields(name, algorithm):
    fields = TURN_ESTIMATORS[name][1]
    if name == "epo":
        prm = (algorithm.get("epo", None) or {}).get("prm", "llm")
        fields += ("progress",) if prm == "rule" else ("critical",)
    return fields


def setup():
    """Import the estimators and this trainer in the process that runs the trainer. For Ray's
    worker_process_setup_hook: every Ray worker process runs it at start, TaskRunnerV1's too."""
    for module, _ in TURN_ESTIMATORS.values():
        importlib.import_module(module)


@register_trainer("sync_turns")
class TurnCreditTrainer(PPOTrainerSync):
    """PPOTrainerSync whose advantages of the five methods see the per-row fields."""

    def _compute_advantage(self, batch, metrics):
        algorithm = self.config.algorithm
        name = str(getattr(algorithm.adv_estimator, "value", algorithm.adv_estimator))
        if name not in TURN_ESTIMATORS:
            return super()._compute_advantage(batch, metrics)
        if algorithm.use_kl_in_reward or algorithm.get("rollout_correction", None):
            raise NotImplementedError("sync_turns: no KL in reward, no rollout correction")
        snippet = importlib.import_module(TURN_ESTIMATORS[name][0])
        tq = trainer_base.tq
        select = ["uid", "response_mask", "rm_scores", "old_log_probs", "extra_fields"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=select + (["prm_log_probs"] if name == "istar" else []))
        response_mask = data["response_mask"]
        extra = data.pop("extra_fields").tolist()
        data = DataProto(batch=data.to_padded_tensor())
        data.batch["token_level_rewards"] = data.batch["rm_scores"]
        uid = data.batch.pop("uid").tolist()
        columns = {"uid": uid}
        for field in turn_fields(name, algorithm):
            if field == "traj_uid":
                default = [key.rsplit("_", 1)[0] for key in batch.keys]  # {uid}_{session}
            elif field == "turn":
                default = [int(key.rsplit("_", 1)[1]) for key in batch.keys]  # output i
            else:
                default = [None] * len(extra)
            columns[field] = [e.get(field, d) for e, d in zip(extra, default)]
            if any(v is None for v in columns[field]):
                raise ValueError(f"{name}: extra_fields lack {field!r} on some rows")
        for field, values in columns.items():  # 1-D object arrays, whatever each value is
            data.non_tensor_batch[field] = np.empty(len(values), dtype=object)
            data.non_tensor_batch[field][:] = values
        data = snippet.compute_advantage_with_turns(data, algorithm)
        output = TensorDict({f: response_to_nested(data.batch[f], response_mask)
                             for f in ("advantages", "returns")}, batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)


# Use (the snippet modules and this one on the workers' PYTHONPATH):
#   python -m verl.trainer.main_ppo trainer.v1.trainer_mode=sync_turns \
#     algorithm.adv_estimator=graphgpo +algorithm.graphgpo.omega=0.8 \
#     +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=verl_v1.setup
# The agent loop returns the fields as extra_fields of each output (one output per turn).


# ---- check (not part of the snippet) ----------------------------------------------------------
class KVStandIn:
    """TransferQueue's kv_batch_put / kv_batch_get in memory (the real one starts Ray actors,
    which did not come up on this 2-core machine): fields stored per key; a get returns them as
    verl's list_of_dict_to_tensordict builds them (nested response tensors, non-tensor stacks),
    the layout the agent loop's put makes."""

    def __init__(self):
        self.rows = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        from tensordict import NonTensorStack

        for i, key in enumerate(keys):
            row = self.rows.setdefault((partition_id, key), {})
            for name, value in (fields.items() if fields is not None else ()):
                if isinstance(value, NonTensorStack):
                    row[name] = value.tolist()[i]
                elif getattr(value, "is_nested", False):
                    row[name] = value.unbind()[i]
                else:
                    row[name] = value[i]
        return trainer_base.KVBatchMeta(keys=list(keys), tags=[{} for _ in keys],
                                        partition_id=partition_id)

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        rows = [self.rows[(partition_id, k)] for k in keys]
        names = [n for n in (select_fields or list(rows[0])) if n in rows[0]]  # stored ones
        return list_of_dict_to_tensordict([{n: r[n] for n in names} for r in rows])


def check():
    import torch
    from omegaconf import OmegaConf
    from verl_agent import GAMES, OPTIONS, kernels_on_games

    setup()  # what the worker_process_setup_hook runs in the trainer's process
    store = KVStandIn()
    trainer_base.tq = store  # the module-level name the trainer reads
    turns, col, kernel, rule_scaled = kernels_on_games(rows=len([1 for g in GAMES for _ in g[2]]))
    n = len(turns)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    print(f"v1: {n} agent-loop outputs (one per turn of verl_agent.py's games), keys "
          f"'{{uid}}_{{session}}_{{turn}}', stored in shuffled order")
    cfg_base = {"use_kl_in_reward": False, "adv_estimator": None, "gamma": 1.0, "lam": 1.0}
    failed = []
    for method in TURN_ESTIMATORS:
        keys, fields = [], []
        texts = {}
        for i in perm:
            name, s = turns[i]
            g = next(g for g in GAMES if g[0] == name)
            length = 1 + (i * 7) % 3  # response lengths 1..3
            mine = [j for j, (m, _) in enumerate(turns) if m == name]
            utter = [x for j in mine for x in (col["state"][j], col["action"][j])]
            extra = {"state": col["state"][i], "next_state": col["next"][i],
                     "success": bool(col["won"][i]), "invalid": bool(col["invalid"][i]),
                     "repeated": bool(col["repeated"][i]), "log_beliefs": list(col["beliefs"][i]),
                     "outcome": float(col["score"][i] if method == "epo" else col["won"][i]),
                     "player": "agent", "utterances": utter,
                     "exact": [True, False] * len(mine), "pos": 2 * s + 1,
                     "critical": bool(col["critical"][i]), "progress": [0.0] + [
                         st[5] for st in g[2]]}
            texts[name] = utter
            keys.append(f"task{g[1]}_{name}_{s}")
            ratio = col["ratio"][i].float()
            r = torch.zeros(length)
            r[:min(length, len(ratio))] = ratio[:length]
            old = -torch.rand(length) - 0.1
            fields.append({"response_mask": torch.ones(length, dtype=torch.int64),
                           "rm_scores": torch.zeros(length), "old_log_probs": old,
                           "prm_log_probs": old + r, "uid": f"task{g[1]}",
                           "extra_fields": extra, "len": length})
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        lengths = [f.pop("len") for f in fields]
        store.kv_batch_put(keys, "train", list_of_dict_to_tensordict(fields))
        meta = store.kv_batch_put(keys, "train", None, tags=[{} for _ in keys])
        algorithm = {**cfg_base, "adv_estimator": method, method: dict(OPTIONS[method])}
        if method == "epo":  # outcome: the rows carry it (the score); verl_agent.py's option
            algorithm["epo"]["prm"] = "llm"
            algorithm["epo"].pop("outcome")
        config = OmegaConf.create({"algorithm": algorithm,
                                   "actor_rollout_ref": {"rollout": {"n": 3}}})
        trainer = TurnCreditTrainer.__new__(TurnCreditTrainer)  # no workers: the method alone
        trainer.config = config
        if method == "istar":  # iStar's kernel reads each turn's tokens: the stored lengths
            col_ratio = {turns[i]: torch.cat([col["ratio"][i].float(), torch.zeros(3)])[:ln]
                         for i, ln in zip(perm, lengths)}
            from istar import istar_turn_advantages
            expected_turn = istar_turn_advantages(col["group"], col["traj"],
                                                  [float(w) for w in col["won"]],
                                                  [col_ratio[t].double() for t in turns],
                                                  beta=0.05, alpha=1.0)
        else:
            expected_turn = kernel[method]
        if method == "graphgpo":  # verl's own v1 code, unchanged, does not pass the fields
            try:
                trainer_base.PPOTrainer._compute_advantage(trainer, meta, {})
                print("graphgpo: verl's own _compute_advantage ran without the fields")
                failed.append(method)
            except ValueError as e:
                print(f"verl's own v1 _compute_advantage does not pass them: ValueError "
                      f"'{str(e)[:36]}...'")
        trainer._compute_advantage(meta, {})
        got = store.kv_batch_get(keys, "train", ["advantages", "returns"])
        adv = [a for a in got["advantages"].unbind()]
        err = max(float((a - float(expected_turn[i])).abs().max()) for a, i in zip(adv, perm))
        same_len = all(len(a) == ln for a, ln in zip(adv, lengths))
        print(f"{method}: advantages written back (nested, one per response token) == kernel per "
              f"turn: max |diff| {err:.1e}")
        if err > 1e-5 or not same_len:
            failed.append(method)
    for method in TURN_ESTIMATORS:
        if method not in failed:
            print(f"PASS {method}_verl_v1")
    if failed:
        raise SystemExit(f"FAILED: {failed}")


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    check()
