"""The environment adapters, each with its real generator and verifier on scripted answers:
reasoning-gym's procedural datasets (offline), math-verify over a local NuminaMath-style jsonl, and the
optional format and length terms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime.rl.environments import build_environment
from prime.rl.environments.math_answers import MathConfig
from prime.rl.environments.reasoning_gym import ReasoningGymConfig
from prime.rl.environments.reverse import ReverseConfig
from prime.rl.environments.terms import RewardTerms
from prime.rl.orchestrator.config import OrchestratorConfig

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "numina_sample.jsonl"


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "word_sorting"])
def test_reasoning_gym_tasks_score_their_own_answers(dataset):
    env = build_environment(ReasoningGymConfig(dataset=dataset, size=20, eval_tasks=8))
    train = [t for _, t in zip(range(20), env.tasks("train", seed=3))]
    held_out = list(env.tasks("eval", seed=3))
    assert len(held_out) == 8 and not {t.prompt for t in held_out} & {t.prompt for t in train}
    assert [t.prompt for t in env.tasks("eval", seed=3)] == [t.prompt for t in held_out]  # same seed, same tasks
    for task in train[:10]:
        assert env.reward(task, task.answer) == 1.0
        assert env.reward(task, "not an answer at all") < 1.0
    with pytest.raises(ValueError, match="no_such_dataset"):
        build_environment(ReasoningGymConfig(dataset="no_such_dataset"))


def test_math_answers_are_checked_by_equivalence_not_by_string():
    env = build_environment(MathConfig(path=SAMPLE, eval_tasks=2))
    tasks = {t.answer: t for t in env.train + env.eval}
    assert len(tasks) == 8
    half = tasks["\\frac{1}{2}"]
    assert env.reward(half, "Adding gives $\\boxed{0.5}$.") == 1.0
    assert env.reward(half, "so the result is $\\frac{2}{4}$") == 1.0
    assert env.reward(half, "$\\boxed{\\frac{1}{3}}$") == 0.0
    assert env.reward(tasks["2x+1"], "$\\boxed{1 + 2x}$") == 1.0
    assert env.reward(tasks["2x+1"], "$\\boxed{2x}$") == 0.0
    divisors = next(t for t in tasks.values() if "divisors" in t.prompt)  # no answer field: the boxed one
    assert env.reward(divisors, "There are \\boxed{6} of them.") == 1.0
    assert divisors.prompt.endswith("\\boxed{}.")
    train = [t for _, t in zip(range(12), env.tasks("train", seed=0))]
    assert not {t.id for t in train} & {t.id for t in env.tasks("eval", seed=0)}


def test_a_bad_math_file_names_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(SAMPLE.read_text().splitlines()[0] + "\n" + json.dumps({"question": "no problem key"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: not a NuminaMath row"):
        build_environment(MathConfig(path=bad))


def test_format_and_length_terms():
    terms = RewardTerms(format_regex=r"^\d+$", format_weight=0.2, max_chars=4, length_penalty=0.1)
    env = build_environment(ReverseConfig(min_digits=4, max_digits=4), terms)
    task = next(env.tasks("train", seed=0))
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, task.answer + "=") == pytest.approx(max(0.0, 0.8 * 0.8 - 0.1))  # 4 of 5 right, bad format, 1 char over
    with pytest.raises(ValueError, match="format_regex does not compile"):
        RewardTerms(format_regex="(")


def test_the_orchestrator_takes_any_environment_by_name():
    config = OrchestratorConfig.model_validate({"env": {"name": "reasoning-gym", "dataset": "chain_sum"}})
    assert isinstance(config.env, ReasoningGymConfig)
    assert isinstance(OrchestratorConfig().env, ReverseConfig)
    with pytest.raises(ValueError):
        OrchestratorConfig.model_validate({"env": {"name": "no-such-task"}})


def test_offline_filter_scores_pass_rates_and_keeps_the_window(tmp_path, capsys):
    from prime.rl import filter as offline
    from prime.rl.policy import new_digit_policy

    policy = new_digit_policy(tmp_path / "policy", seed=0)
    out = tmp_path / "scored.jsonl"
    # one-digit strings: a fresh policy solves some by chance, so every pass rate can occur
    assert offline.main(["--policy", str(policy), "--tasks", "24", "--samples", "8", "--out", str(out),
                         "--min-pass", "0", "--max-pass", "0.5", "--env.min_digits", "1",
                         "--env.max_digits", "1", "--max_tokens", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 24 and {r["pass_rate"] * 8 for r in rows} <= set(range(9))
    assert all(r["kept"] == (0 < r["pass_rate"] < 0.5) for r in rows)
    assert any(r["pass_rate"] > 0 for r in rows) and any(r["pass_rate"] == 0 for r in rows)
    assert "filter: 24 tasks" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="math problems"):
        offline.main(["--policy", str(policy), "--tasks", "2", "--samples", "2", "--out", str(out),
                      "--keep-out", str(tmp_path / "kept.jsonl")])


def test_offline_filter_writes_kept_math_problems_the_environment_reads_back(tmp_path, caplog):
    from prime.rl import filter as offline
    from prime.rl.environments.math_answers import MathAnswers
    from prime.rl.policy import new_digit_policy

    policy = new_digit_policy(tmp_path / "policy", seed=0)
    out, kept = tmp_path / "scored.jsonl", tmp_path / "kept.jsonl"
    assert offline.main(["--policy", str(policy), "--tasks", "4", "--samples", "2", "--out", str(out),
                         "--keep-out", str(kept), "--min-pass", "-1", "--set", "env.name=math",
                         "--set", f"env.path={SAMPLE}", "--set", "max_tokens=4"]) == 0
    # the old spelling still works for this release, and says what to write instead
    assert "--set env.name=math is the old spelling and goes in the next release: write --env.name math" in caplog.text
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    env = MathAnswers(MathConfig(path=kept, eval_tasks=1))
    assert sorted(t.prompt for t in env.train + env.eval) == sorted(r["prompt"] for r in scored)
    assert all(env.reward(t, f"\\boxed{{{t.answer}}}") == 1.0 for t in env.train + env.eval)
