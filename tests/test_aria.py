"""ARIA: credit functions against hand-computed numbers, the aggregation pipeline on constructed games,
the three encoders (hash, frozen policy, an AutoModel checkpoint), and the script end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, assert_adapter_trained, assert_run_outputs, read_metrics

import aria


def partition(labels):
    """A label array as a set of frozensets of indices (label values themselves are arbitrary)."""
    groups = {}
    for i, lab in enumerate(np.asarray(labels).tolist()):
        groups.setdefault(lab, set()).add(i)
    return {frozenset(g) for g in groups.values()}


# ---------------------------------------------------------------------------------------------
# discounted_returns
# ---------------------------------------------------------------------------------------------
def test_discounted_returns_by_hand():
    # R = 1, T = 3, gamma = 0.5 -> [0.5^2, 0.5^1, 0.5^0] = [0.25, 0.5, 1.0]
    np.testing.assert_allclose(aria.discounted_returns(1.0, 3, 0.5), [0.25, 0.5, 1.0], atol=1e-15)
    # R = 0.8, T = 4, gamma = 0.95 -> 0.8 * [0.857375, 0.9025, 0.95, 1] = [0.6859, 0.722, 0.76, 0.8]
    np.testing.assert_allclose(aria.discounted_returns(0.8, 4, 0.95), [0.6859, 0.722, 0.76, 0.8], atol=1e-12)
    # a lost game gives zeros; T = 1 is the outcome itself; T = 0 is empty
    np.testing.assert_array_equal(aria.discounted_returns(0.0, 2, 0.9), [0.0, 0.0])
    np.testing.assert_array_equal(aria.discounted_returns(0.7, 1, 0.9), [0.7])
    assert aria.discounted_returns(1.0, 0, 0.9).shape == (0,)


# ---------------------------------------------------------------------------------------------
# aggregate_rewards, intention_keys
# ---------------------------------------------------------------------------------------------
def test_aggregate_rewards_over_equal_keys():
    keys = [("a", 1), ("a", 2), ("a", 1), ("b",), ("a", 2)]
    # ("a", 1): steps 0 and 2 -> (1 + 0.5) / 2 = 0.75
    # ("a", 2): steps 1 and 4 -> (0 + 0.25) / 2 = 0.125
    # ("b",):   step 3 alone  -> 0.3
    got = aria.aggregate_rewards(keys, [1.0, 0.0, 0.5, 0.3, 0.25])
    np.testing.assert_allclose(got, [0.75, 0.125, 0.75, 0.3, 0.125], atol=1e-15)
    # all keys distinct -> the returns themselves; one key -> the mean everywhere (0.6 / 3 = 0.2)
    np.testing.assert_allclose(aria.aggregate_rewards([1, 2, 3], [0.1, 0.2, 0.3]), [0.1, 0.2, 0.3])
    np.testing.assert_allclose(aria.aggregate_rewards(["k"] * 3, [0.0, 0.0, 0.6]), [0.2, 0.2, 0.2])


def test_intention_keys_are_full_label_prefixes():
    # episode 0: a1 o1 a2 o2 a3 o3 = utterances 0..5 with labels 1 -1 2 -2 1 -1; episode 1: utterances 6, 7
    labels = [1, -1, 2, -2, 1, -1, 2, -1]
    episodes = [[0, 1, 2, 3, 4, 5], [6, 7]]
    steps = [(0, 0, "agent"), (0, 2, "agent"), (0, 4, "agent"), (1, 0, "agent")]
    assert aria.intention_keys(labels, episodes, steps) == [
        ("agent", 1), ("agent", 1, -1, 2), ("agent", 1, -1, 2, -2, 1), ("agent", 2)]
    # the order matters (a sequence, not a bag): 1, -1, 2 differs from 2, -1, 1
    k = aria.intention_keys([2, -1, 1], [[0, 1, 2]], [(0, 2, "agent")])
    assert k == [("agent", 2, -1, 1)] and k[0] != ("agent", 1, -1, 2)


# ---------------------------------------------------------------------------------------------
# split_score, select_k
# ---------------------------------------------------------------------------------------------
def test_split_score_by_hand():
    # |1.0 - 0.5| + |0.0 - 0.5| + |0.2 - 0.2| + |0.4 - 0.2| = 0.5 + 0.5 + 0 + 0.2 = 1.2; / 4 steps = 0.3
    assert aria.split_score([0.5, 0.5, 0.2, 0.2], [1.0, 0.0, 0.2, 0.4]) == pytest.approx(0.3, abs=1e-15)
    assert aria.split_score([0.1, 0.9], [0.1, 0.9]) == 0.0
    with pytest.raises(ValueError):
        aria.split_score([0.1], [0.1, 0.2])


def test_select_k_on_a_constructed_sequence():
    scores = {2: 0.3, 3: 0.05, 4: 0.005, 5: 0.002, 6: 0.02, 7: 0.001, 8: 0.0, 9: 0.0}
    # eps 0.01, tau 2: k=2 window {2,3,4} has 0.3; k=3 has 0.05; k=4 window {4,5,6} has 0.02 (6);
    # k=5 and k=6 windows hold 6 too; k=7 window {7,8,9} = 0.001, 0, 0 all < 0.01 -> 7
    assert aria.select_k(scores, eps=0.01, tau=2) == 7
    # tau 1: k=4 window {4,5} = 0.005, 0.002 -> 4
    assert aria.select_k(scores, eps=0.01, tau=1) == 4
    # tau 0: the first k below eps -> 4; eps 0.1: k=3 window {3,4,5} = 0.05, 0.005, 0.002 -> 3
    assert aria.select_k(scores, eps=0.01, tau=0) == 4
    assert aria.select_k(scores, eps=0.1, tau=2) == 3
    # tau 10 (paper): windows run past the last score and keep only the ks that have one: k=7 -> {7,8,9}
    assert aria.select_k(scores, eps=0.01, tau=10) == 7


def test_select_k_none_qualifies_and_edges():
    # every score >= eps -> the largest k
    assert aria.select_k({2: 0.5, 3: 0.2, 4: 0.3}, eps=0.01, tau=10) == 4
    # only the last k is below eps; its window is just {3} -> 3
    assert aria.select_k({2: 0.5, 3: 0.005}, eps=0.01, tau=10) == 3
    # equal to eps does not count as below
    assert aria.select_k({2: 0.01, 3: 0.02}, eps=0.01, tau=0) == 3
    with pytest.raises(ValueError):
        aria.select_k({})


# ---------------------------------------------------------------------------------------------
# hac_labels
# ---------------------------------------------------------------------------------------------
def test_hac_labels_on_separated_clouds():
    # A = (0,0),(0,1); B = (10,0),(10,1); C = (0,20),(0,21)
    # average distances: A-B = mean of 10, sqrt(101), sqrt(101), 10 ≈ 10.02; A-C ≈ 20; B-C ≈ sqrt(500) ≈ 22.4
    # -> k=3: A | B | C ; k=2: A+B | C (A and B merge first) ; k=6: every point alone
    X = np.array([[0, 0], [0, 1], [10, 0], [10, 1], [0, 20], [0, 21]], dtype=float)
    for method in ("average", "ward"):
        lab = aria.hac_labels(X, [2, 3, 6], method=method)
        assert set(lab) == {2, 3, 6}
        assert partition(lab[3]) == {frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5})}, method
        assert partition(lab[2]) == {frozenset({0, 1, 2, 3}), frozenset({4, 5})}, method
        assert partition(lab[6]) == {frozenset({i}) for i in range(6)}, method
        assert lab[3].dtype.kind == "i" and len(lab[3]) == 6


def test_hac_labels_duplicates_and_tiny_inputs():
    # 3 distinct points among 5 rows: asking for 4 clusters gives the 3 distinct groups
    X = np.array([[0.0], [0.0], [5.0], [9.0], [9.0]])
    assert partition(aria.hac_labels(X, [4])[4]) == {frozenset({0, 1}), frozenset({2}), frozenset({3, 4})}
    assert aria.hac_labels(np.zeros((1, 3)), [2])[2].tolist() == [1]
    assert aria.hac_labels(np.zeros((0, 3)), [2])[2].tolist() == []


# ---------------------------------------------------------------------------------------------
# the pipeline: aria_credit and compute_advantages
# ---------------------------------------------------------------------------------------------
def test_aria_credit_by_hand():
    # two games of two turns: utterances a1 o1 a2 o2; game 0 won (R=1), game 1 lost; gamma 0.5
    # returns: game 0 [0.5, 1.0], game 1 [0, 0]. Observations exactly labelled -1 (same text).
    episodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    steps = [(0, 0, "agent"), (0, 2, "agent"), (1, 0, "agent"), (1, 2, "agent")]
    returns = [0.5, 1.0, 0.0, 0.0]
    labels = {
        2: [1, -1, 2, -1, 1, -1, 2, -1],  # both games: keys (1) and (1,-1,2)
        3: [1, -1, 2, -1, 1, -1, 3, -1],  # game 1's second action split off
        4: [1, -1, 2, -1, 4, -1, 3, -1],  # game 1's first action split off too
    }
    # k=2: (1) -> (0.5 + 0) / 2 = 0.25 ; (1,-1,2) -> (1 + 0) / 2 = 0.5        -> [0.25, 0.5, 0.25, 0.5]
    # k=3: (1) -> 0.25 ; (1,-1,2) -> 1.0 ; (1,-1,3) -> 0.0                    -> [0.25, 1.0, 0.25, 0.0]
    # k=4: every key alone                                                    -> [0.5, 1.0, 0.0, 0.0]
    # SplitScore(2) = (0 + 0.5 + 0 + 0.5) / 4 = 0.25 ; SplitScore(3) = (0.25 + 0 + 0.25 + 0) / 4 = 0.125
    res = aria.aria_credit(labels, episodes, steps, returns, eps=0.2, tau=10)
    assert res["scores"] == pytest.approx({2: 0.25, 3: 0.125})
    assert res["k"] == 3  # 0.25 >= 0.2 at k=2; k=3's window {3} holds 0.125 < 0.2
    np.testing.assert_allclose(res["values"], [0.25, 1.0, 0.25, 0.0])
    assert res["num_keys"] == {2: 2, 3: 3, 4: 4}
    # paper eps 0.01: nothing qualifies -> the largest scored k (3)
    assert aria.aria_credit(labels, episodes, steps, returns)["k"] == 3
    # a fixed k overrides the choice
    np.testing.assert_allclose(aria.aria_credit(labels, episodes, steps, returns, fixed_k=4)["values"],
                               [0.5, 1.0, 0.0, 0.0])


def _args(**kw):
    a = aria.Args()
    a.observation_labels = "exact"
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _step(player, pos):
    return {"player": player, "pos": pos, "invalid": False, "prompt": [1], "completion": [2]}


def _raw_and_weights(episodes, args):
    signal = aria.embed_utterances(aria.Embedder("hash"), episodes, args.observation_labels)
    samples, st = aria.compute_advantages(episodes, args, signal)
    raw = []  # the raw returns γ^(T-t) R of each episode's turns, per player (--no-aggregate's weights)
    for ep in episodes:
        players = [s["player"] for s in ep.steps]
        raw += aria.turn_returns([ep.traj_id] * len(players), players, [ep.outcome[p] for p in players],
                                 args.gamma).tolist()
    return raw, [s.adv for s in samples], st


def test_compute_advantages_variance_before_and_after():
    # The same two questions in both games; game 0 wins on the guess, game 1 does not.
    # gamma 0.95 -> raw returns [0.95, 1.0, 0.0, 0.0].
    # Two distinct action texts -> K = 2, one cut; keys are equal across the games:
    #   step 1: mean(0.95, 0) = 0.475 ; step 2: mean(1.0, 0) = 0.5 -> aggregated [0.475, 0.5, 0.475, 0.5]
    # raw: mean 0.4875, squared deviations 0.4625^2 + 0.5125^2 + 2 * 0.4875^2 = 0.951875 -> var 0.23796875
    # aggregated: mean 0.4875, deviations ±0.0125 -> var 0.00015625
    def game(i, last, won):
        ep = aria.Episode(traj_id=i, task_id="cat")
        ep.utterances = ["Is it an animal?", "Yes", "Is it a cat?", last]
        ep.kinds = ["action", "observation"] * 2
        ep.steps = [_step("agent", 0), _step("agent", 2)]
        ep.outcome = {"agent": float(won)}
        return ep

    episodes = [game(0, "Finished", True), game(1, "No", False)]
    raw, agg, st = _raw_and_weights(episodes, _args(gamma=0.95))
    np.testing.assert_allclose(raw, [0.95, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(agg, [0.475, 0.5, 0.475, 0.5])
    assert st["credit/reward_var_raw"] == pytest.approx(0.23796875)
    assert st["credit/reward_var_aggregated"] == pytest.approx(0.00015625)
    assert st["credit/selected_k"] == 2 and st["credit/num_distinct_utterances"] == 2
    assert st["credit/num_intentions"] == 2 and st["credit/num_steps"] == 4


def test_compute_advantages_two_players_discount_per_player():
    # Alice, Bob, Alice; Alice won (R=1), Bob lost. Alice's 2 turns: [0.9, 1.0]; Bob's 1 turn: [0.0]
    ep = aria.Episode(traj_id=0, task_id="t")
    ep.utterances = ["propose 60", "propose 55", "accept"]
    ep.kinds = ["action"] * 3
    ep.steps = [_step("Alice", 0), _step("Bob", 1), _step("Alice", 2)]
    ep.outcome = {"Alice": 1.0, "Bob": 0.0}
    raw, agg, st = _raw_and_weights([ep], _args(gamma=0.9, observation_labels="cluster"))
    np.testing.assert_allclose(raw, [0.9, 0.0, 1.0])
    np.testing.assert_allclose(agg, raw)  # one game: every key is unique (role + prefix)


def test_split_eps_flag_sets_the_stopping_rule():
    # The games of test_aria_credit_by_hand through compute_advantages, with embeddings chosen so that
    # average-linkage HAC cuts exactly as there: first actions (0, 0) and (0, 1) (distance 1), second
    # actions (10, 0) and (10, 3) (distance 3). k=2: {first}, {second}; k=3: the second actions split.
    # Observations "ok" are labelled by their text (rows unread). gamma 0.5: returns [0.5, 1, 0, 0].
    # SplitScore(2) = 0.25, SplitScore(3) = 0.125 (worked there).
    # --split-eps 0.3: both < 0.3, so k* = 2 -> weights [0.25, 0.5, 0.25, 0.5]
    # paper's 0.01: no k qualifies -> the largest scored k, 3 -> weights [0.25, 1.0, 0.25, 0.0]
    import tyro

    def game(i, won):
        ep = aria.Episode(traj_id=i, task_id="t")
        ep.utterances = [f"first {i}", "ok", f"second {i}", "ok"]
        ep.kinds = ["action", "observation"] * 2
        ep.steps = [_step("agent", 0), _step("agent", 2)]
        ep.outcome = {"agent": float(won)}
        return ep

    episodes = [game(0, True), game(1, False)]
    signal = np.array([[0, 0], [0, 0], [10, 0], [0, 0], [0, 1], [0, 0], [10, 3], [0, 0]], dtype=float)
    for flags, k, want in ((["--split-eps", "0.3"], 2, [0.25, 0.5, 0.25, 0.5]),
                           ([], 3, [0.25, 1.0, 0.25, 0.0])):
        args = tyro.cli(aria.Args, args=[*flags, "--gamma", "0.5", "--observation-labels", "exact"])
        samples, st = aria.compute_advantages(episodes, args, signal)
        assert st["credit/selected_k"] == k and st["credit/split_scores"] == [0.25, 0.125]
        np.testing.assert_allclose([x.adv for x in samples], want)


def test_reinforce_loss_by_hand():
    import torch

    # three live steps of a batch of B = 4 (the fourth had weight 0 and was skipped):
    # Σ_i w_i log π_i = 0.5 x (-1) + 0.25 x (-2) + (-1) x (-0.5) = -0.5 - 0.5 + 0.5 = -0.5
    # loss = -(-0.5) / 4 = 0.125 (dividing by the 3 live steps would give 0.1667)
    seq_logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    weights = torch.tensor([0.5, 0.25, -1.0])
    loss = aria.reinforce_loss(seq_logp, weights, 4)
    assert float(loss.detach()) == pytest.approx(0.125)
    # d loss / d log π_i = -w_i / B = [-0.125, -0.0625, 0.25]: a positive weight raises its log-prob
    loss.backward()
    np.testing.assert_allclose(seq_logp.grad.numpy(), [-0.125, -0.0625, 0.25])
    # two micro-batches of the batch add up to the whole: -(0.5 x -1) / 4 = 0.125, -(-0.5 + 0.5) / 4 = 0
    parts = [aria.reinforce_loss(seq_logp[:1], weights[:1], 4), aria.reinforce_loss(seq_logp[1:], weights[1:], 4)]
    assert [float(x.detach()) for x in parts] == pytest.approx([0.125, 0.0]) and float(sum(parts).detach()) == pytest.approx(0.125)


# ---------------------------------------------------------------------------------------------
# encoders
# ---------------------------------------------------------------------------------------------
def test_hash_embedding_is_deterministic_and_semantic_enough():
    texts = ["Is it an animal?", "is it an  ANIMAL?", "Is it an animal", "propose 60", ""]
    e1, e2 = aria.hash_embed(texts, 256), aria.hash_embed(texts, 256)
    np.testing.assert_array_equal(e1, e2)
    assert e1.shape == (5, 256)
    np.testing.assert_allclose(np.linalg.norm(e1[:4], axis=1), 1.0)
    np.testing.assert_array_equal(e1[4], 0.0)
    np.testing.assert_allclose(e1[0], e1[1])  # case and spaces are normalised
    d = lambda i, j: np.linalg.norm(e1[i] - e1[j])  # noqa: E731
    assert d(0, 2) < d(0, 3)


@pytest.fixture(scope="module")
def random_bert_dir(tmp_path_factory):
    """A randomly initialised 1-layer BERT and a word-piece tokenizer, saved locally (no network)."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("random_bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "is", "it", "an", "animal", "a", "cat", "propose",
             "accept", "?", "6", "##0", "yes", "no"]
    core = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]").save_pretrained(out)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(out)
    return out


def test_automodel_encoder_mean_pools_real_tokens(random_bert_dir):
    import torch
    from transformers import AutoModel, AutoTokenizer

    emb = aria.Embedder(str(random_bert_dir))
    texts = ["Is it a cat?", "propose 60", "Is it a cat?"]
    got = emb(texts)
    assert got.shape == (3, 32)
    np.testing.assert_allclose(got[0], got[2])
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    # by hand, one text at a time (no padding): mean of the last hidden states, then L2 normalise
    tok, model = AutoTokenizer.from_pretrained(random_bert_dir), AutoModel.from_pretrained(random_bert_dir).eval()
    for i, text in enumerate(texts[:2]):
        enc = tok(text, return_tensors="pt")
        assert enc["input_ids"].shape[1] == (7 if i == 0 else 5)  # [CLS] is it a cat ? [SEP] / [CLS] propose 6 ##0 [SEP]
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0].double().mean(0).numpy()
        np.testing.assert_allclose(got[i], h / np.linalg.norm(h), atol=1e-5)


def test_policy_encoder_uses_the_frozen_base(tiny_cache):
    import torch

    torch.set_num_threads(1)
    from common.models import load_policy

    model, tok = load_policy("tiny", env_id="twenty_questions", tiny_preset="micro", lora_r=4, lora_alpha=8)
    model.eval()
    emb = aria.Embedder("policy")
    emb.model, emb.tok = model, tok
    texts = ["Is it an animal?", "Is it a cat?"]
    before = emb(texts)
    hidden = model.get_base_model().config.hidden_size
    assert before.shape == (2, hidden)
    # by hand, the first text alone: mean of the base model's last hidden states, L2-normalised
    ids = torch.tensor([tok(texts[0], add_special_tokens=False)["input_ids"]])
    with torch.no_grad(), model.disable_adapter():
        h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].double().mean(0).numpy()
    np.testing.assert_allclose(before[0], h / np.linalg.norm(h), atol=1e-5)
    # changing the LoRA weights does not change the embedding (the adapter is off while embedding)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.5)
    np.testing.assert_allclose(emb(texts), before, atol=1e-6)
    assert tok.padding_side == "left"  # restored


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
SMALL = ["--num-iterations", "1", "--games-per-iteration", "12", "--eval-num-tasks", "2", "--eval-k", "1",
         "--torch-threads", "1", "--max-new-tokens", "10", "--learning-rate", "1e-3"]


# every end-to-end run of this module, by name: conftest's `runs` starts them together when the first test
# needs one (E2E_SCRIPT with each flag list)
E2E_SCRIPT = "aria.py"
E2E = {
    "bargaining": [*SMALL, "--env-id", "bargaining", "--game-reward", "payoff", "--eval-opponents", "fair", "tough"],
    "twenty_questions": [*SMALL, "--env-id", "twenty_questions", "--games-per-iteration", "6", "--max-turns", "3",
                         "--no-aggregate"],
    "negotiation": [*SMALL, "--games-per-iteration", "6", "--env-id", "negotiation", "--embedder", "policy",
                    "--linkage", "ward", "--eval-opponents", "fair"],
    "guess_my_city": [*SMALL, "--env-id", "guess_my_city", "--games-per-iteration", "4", "--max-turns", "3"],
}


def _check_credit_rows(run_dir):
    rows = [r for r in read_metrics(run_dir) if "credit/selected_k" in r]
    assert len(rows) == 1
    r = rows[0]
    assert 1 <= r["credit/selected_k"] <= r["credit/max_k"] <= max(1, r["credit/num_distinct_utterances"])
    assert r["credit/reward_var_raw"] >= 0 and r["credit/reward_var_aggregated"] >= 0
    # aggregation keeps the mean of the step returns (each key's mean, weighted by its count)
    assert r["credit/reward_mean_aggregated"] == pytest.approx(r["credit/reward_mean_raw"], abs=1e-9)
    assert len(r["credit/split_scores"]) == r["credit/max_k"] - 2 + (r["credit/max_k"] < 2)
    return r


def test_end_to_end_bargaining_selfplay(runs):
    run_dir = runs["bargaining"].result()
    summary = assert_run_outputs(run_dir)
    assert_adapter_trained(run_dir)
    r = _check_credit_rows(run_dir)
    assert r["credit/weight_nonzero_frac"] > 0
    ev = summary["last_eval"]
    for key in ("eval/win_rate", "eval/success_greedy", "eval/payoff_share", "eval/payoff_share_greedy"):
        assert 0.0 <= ev[key] <= 1.0, key
    # the main metric pools the same number of games per role and style (2 roles x 2 styles x 2 test tasks x
    # --eval-k 1): the mean of the per-game shares; the summary names it as the run's main metric
    games = ev["eval/payoff_share_episodes"]
    assert len(games) == 2 * 2 * 2 * 1 and ev["eval/payoff_share"] == pytest.approx(np.mean(games), abs=1e-12)
    assert summary["metric"] == "eval/payoff_share"
    train = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines() if '"train"' in x]
    assert train and {t["player"] for g in train for t in g["turns"]} <= {"Alice", "Bob"}


def test_end_to_end_twenty_questions_no_aggregate(runs):
    run_dir = runs["twenty_questions"].result()
    summary = assert_run_outputs(run_dir)
    r = _check_credit_rows(run_dir)
    # baseline: the training weights are the raw returns
    assert r["credit/weight_mean"] == pytest.approx(r["credit/reward_mean_raw"])
    for key in ("eval/success", "eval/success_greedy", "eval/return", "eval/episode_length"):
        assert key in summary["last_eval"]
    assert json.loads((run_dir / "config.json").read_text())["observation_labels"] == "exact"


def test_end_to_end_negotiation_policy_encoder_ward(runs):
    run_dir = runs["negotiation"].result()
    summary = assert_run_outputs(run_dir)
    _check_credit_rows(run_dir)
    # --eval-opponents fair: 2 roles x 1 style x 2 test tasks x --eval-k 1 sampled games (all 4 styles: 16)
    assert len(summary["last_eval"]["eval/payoff_share_episodes"]) == 2 * 1 * 2 * 1


def test_end_to_end_guess_my_city(runs):
    run_dir = runs["guess_my_city"].result()
    assert_run_outputs(run_dir)
    _check_credit_rows(run_dir)
    assert json.loads((run_dir / "config.json").read_text())["observation_labels"] == "cluster"


@pytest.mark.parametrize("flags, words", [
    (["--env-id", "no_such_env"], ["no_such_env"]),
    (["--embedder", "./no/such/encoder"], ["--embedder", "hash"]),
    (["--gamma", "1.5"], ["--gamma"]),
])
def test_user_errors_are_one_clear_line(tiny_cache, tmp_path, flags, words):
    proc = subprocess.run([sys.executable, str(REPO / "aria.py"), "--tiny-preset", "micro", "--output-dir",
                           str(tmp_path), *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr, proc.stderr[-2000:]
    for w in words:
        assert w in proc.stderr


def test_make_env_gives_seated_games_and_a_bare_probe():
    import envs

    from common.models import policy_kind

    args, new_env, probe, kw = aria.make_env(aria.Args(tiny_preset="micro", history=2))
    assert not isinstance(probe, envs.Seated) and policy_kind(args.model_name) == "tiny"
    assert kw["history"] == 2 and args.learning_rate == aria.DEFAULTS["tiny"]["learning_rate"]
    # what the tiny row leaves at None comes from the game's BY_GAME row (two-player here)
    assert (args.num_iterations, args.games_per_iteration, args.batch_size) == (8, 64, 32)
    assert args.observation_labels == "cluster"
    game = new_env()  # default seats: self-play
    assert isinstance(game, envs.Seated) and set(game.seats.values()) == {"policy"}
    p0, p1 = probe.players
    style = probe.opponent_styles()[0]
    assert new_env({p0: "policy", p1: style}).seats == {p0: "policy", p1: style}
    args, new_env, _, _ = aria.make_env(aria.Args(tiny_preset="micro", env_id="twenty_questions", max_turns=3))
    game = new_env()
    assert game.players == ("agent",) and game.env.max_turns == 3
    assert (args.num_iterations, args.games_per_iteration, args.batch_size) == (3, 32, 16)
    assert args.observation_labels == "exact"  # closed-set answers (OBSERVATION_LABELS)
    args, *_ = aria.make_env(aria.Args(model_name="smollm2-135m", env_id="twenty_questions", num_iterations=2))
    assert (args.num_iterations, args.games_per_iteration, args.batch_size) == (2, 8, 8)  # a flag, the row
