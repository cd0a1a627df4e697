"""``eval --task humaneval``: the child-process code runner (a pass, a failing assertion, a
timeout, crashes, a memory hog, an early exit), code extraction from the answer shapes chat
models give, the pass@k estimator against brute force, the selection within a budget, the
harness going on past hangs and crashes and resuming from its log, and the whole command on 3
problems with SmolLM2 (its JSON consistent, and a rerun decoding nothing)."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from paradraft.runtime import gguf
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.metrics import GenerationResult, SpecStats
from paradraft.runtime.tools import humaneval, task_eval
from paradraft.runtime.tools.code_exec import run_program
from paradraft.runtime.tools.evaluate import tune_grid
from paradraft.runtime.tools.task_eval import (
    AnswerLog,
    EvalRow,
    bootstrap_interval,
    fastest_within_budget,
    parse_row,
    pass_at_k,
    row_spec,
    select_within,
    summarize,
    with_references,
)

# -- the code runner -------------------------------------------------------------------------


def test_a_passing_program_passes():
    r = run_program("import math\nassert math.isqrt(17) == 4\nprint('ok')", 10, 512)
    assert (r.passed, r.reason) == (True, "passed")


def test_a_failing_assertion_fails_naming_it():
    r = run_program("def f(x):\n    return x + 1\nassert f(1) == 3, 'off by one'", 10, 512)
    assert (r.passed, r.reason) == (False, "failed")
    assert r.detail == "AssertionError: off by one"


def test_an_endless_loop_is_stopped_at_the_limit():
    r = run_program("while True:\n    pass", timeout_s=1.5, memory_mb=512)
    assert (r.passed, r.reason) == (False, "timeout")
    assert 1.5 <= r.seconds < 10


@pytest.mark.parametrize("source, signal", [
    ("import os\nos.abort()", "SIGABRT"),
    ("import ctypes\nctypes.string_at(0)", "SIGSEGV"),
])
def test_a_crash_is_a_failure_with_its_signal(source, signal):
    r = run_program(source, 10, 512)
    assert (r.passed, r.reason, r.detail) == (False, "crashed", signal)


def test_a_memory_hog_hits_the_address_space_limit():
    # 2 GiB against a 256 MiB limit: refused at once, where without the limit the machine
    # would swap
    r = run_program("block = bytearray(2 << 30)\nprint(len(block))", 10, 256)
    assert (r.passed, r.reason) == (False, "memory")
    assert "MemoryError" in r.detail
    # the same program under a limit it fits in allocates what it asks for
    assert run_program("block = bytearray(16 << 20)", 10, 512).passed


@pytest.mark.parametrize("source", ["import sys\nsys.exit(0)\nassert False",
                                    "import os\nos._exit(0)\nassert False"])
def test_exiting_before_the_checks_is_not_a_pass(source):
    r = run_program(source, 10, 512)
    assert (r.passed, r.reason) == (False, "exited")


def test_the_program_runs_in_a_scratch_dir_that_is_removed(tmp_path):
    report = tmp_path / "cwd.txt"
    source = ("import os\nassert set(os.listdir('.')) <= {'program.py', 'stdout.txt', "
              f"'stderr.txt'}}\nopen({str(report)!r}, 'w').write(os.getcwd())\n")
    assert run_program(source, 10, 512).passed
    scratch = Path(report.read_text())
    assert scratch != Path.cwd() and scratch.name.startswith("paradraft-exec-")
    assert not scratch.exists()


# -- extraction ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return humaneval.problems(3)


def answer_shapes(problem: dict) -> dict[str, str]:
    """The canonical solution as chat models phrase answers."""
    body = problem["canonical_solution"]
    full = problem["prompt"] + body
    return {
        "fenced python, prose around": f"Here is the function:\n\n```python\n{full}```\n\n"
                                       "It loops over the pairs.",
        "fenced, no language": f"```\n{full}\n```",
        "fence left open (cut off)": f"Sure.\n```python\n{full}",
        "usage block first": f"```python\nprint({problem['entry_point']}([]))\n```\n"
                             f"The function:\n```py\n{full}```",
        "bare function, prose around": f"Sure! Here it is:\n{full}\nThis works because the "
                                       "loop checks every pair.",
        "body only, indented": body,
        "body only, fenced and unindented": "```python\n" + "\n".join(
            line[4:] for line in body.splitlines()) + "\n```",
    }


@pytest.mark.parametrize("shape", list(answer_shapes(humaneval.problems(1)[0])))
def test_each_answer_shape_extracts_to_a_passing_program(problems, shape):
    for problem in problems[:2]:
        code = humaneval.extract_code(answer_shapes(problem)[shape], problem["entry_point"])
        assert "Sure" not in code and "It loops" not in code and "This works" not in code
        result = run_program(humaneval.program(problem, code), 10, 512)
        assert result.passed, (problem["task_id"], shape, result, code)


def test_a_wrong_answer_fails_its_tests(problems):
    problem = problems[0]
    wrong = f"```python\ndef {problem['entry_point']}(*args):\n    return None\n```"
    code = humaneval.extract_code(wrong, problem["entry_point"])
    result = run_program(humaneval.program(problem, code), 10, 512)
    assert (result.passed, result.reason) == (False, "failed")


def test_every_prompt_is_a_valid_stub():
    # program() keeps the prompt before a whole-function answer (for its imports and
    # helpers): every prompt must compile on its own, its docstring the function's body
    for problem in humaneval.problems():
        compile(problem["prompt"], problem["task_id"], "exec")


# -- pass@k and its interval -----------------------------------------------------------------


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (c of them correct) holding a correct one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k),
                                                           abs=1e-12), (n, c, k)
    assert pass_at_k(200, 13, 1) == pytest.approx(13 / 200)
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(5, 2, 6)


def test_the_bootstrap_interval_holds_the_estimate():
    rng = random.Random(0)
    for trial in range(20):
        values = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(rng.randint(3, 60))]
        mean = sum(values) / len(values)
        low, high = bootstrap_interval(values, seed=trial)
        assert low <= mean <= high
        assert low >= 0.0 and high <= 1.0
    assert bootstrap_interval([1.0] * 10) == (1.0, 1.0)
    # more problems, a narrower interval
    wide = bootstrap_interval([0.0, 1.0] * 5)
    narrow = bootstrap_interval([0.0, 1.0] * 200)
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 3


def answer(row: str, task: str, sample: int, passed: bool, reason: str = "failed",
           tokens: int = 10, seconds: float = 1.0) -> task_eval.Answer:
    return task_eval.Answer(row=row, task_id=task, sample=sample, seed=sample, completion="",
                            passed=passed, reason="passed" if passed else reason, detail="",
                            generated_tokens=tokens, draft_tokens=8, accepted_tokens=4,
                            verify_steps=5, seconds=seconds, exec_seconds=0.1)


def test_summarize_averages_per_problem_pass_rates():
    spec = parse_row("rule=exact", 0.8, 1.0, 4)
    # problem a: 3 of 4 samples pass, problem b: 0 of 4 (one timed out)
    answers = ([answer(spec.id, "a", s, s < 3) for s in range(4)]
               + [answer(spec.id, "b", s, False, "timeout" if s == 0 else "failed")
                  for s in range(4)])
    row = summarize(spec, answers, problems=2, samples=4)
    assert row.pass_at_1 == pytest.approx((3 / 4 + 0) / 2)
    assert row.passed == 3
    assert row.failures == {"timeout": 1, "failed": 4}
    assert row.acceptance_rate == pytest.approx(4 / 8)
    assert row.mean_acceptance_length == pytest.approx((4 * 8 + 5 * 8) / (5 * 8))
    assert row.tokens_per_second == pytest.approx(10.0)
    with pytest.raises(ValueError, match="answers for"):
        summarize(spec, answers[:7], problems=2, samples=4)


# -- rows, references, selection -------------------------------------------------------------


def test_rows_parse_with_defaults_and_get_their_references():
    row = parse_row("rule=threshold, T=0.7, tau=0.25", 1.0, 0.95, 4)
    assert row.params == RuleParams("threshold", temperature=0.7, top_p=0.95, tau=0.25)
    assert row.id == "threshold tau=0.25 T=0.7 top_p=0.95 k=4"
    # an unset rule parameter takes the calibrated default (the engine dir's), then the fixed
    calibrated = parse_row("rule=dynamic", 0.8, 1.0, 2, {"dynamic": {"tau": 0.05}})
    assert (calibrated.params.tau, calibrated.params.alpha, calibrated.k) == (0.05, 0.1, 2)
    assert parse_row("rule=greedy,k=0", 0.8, 1.0, 4).id == "greedy k=0"
    rows = with_references([parse_row("rule=typical", 0.8, 1.0, 4),
                            parse_row("rule=ratio,gamma=0.5", 0.8, 1.0, 4),
                            parse_row("rule=greedy,k=2", 0.8, 1.0, 4),
                            parse_row("rule=typical", 0.8, 1.0, 4)], k=4)
    assert [r.id for r in rows] == [
        "exact T=0.8 top_p=1 k=4", "typical epsilon=0.09 delta=0.3 T=0.8 top_p=1 k=4",
        "ratio gamma=0.5 T=0.8 top_p=1 k=4", "greedy k=4", "greedy k=2"]
    for bad, message in [("tau=0.3", "needs rule"), ("rule=fast", "rule must be"),
                         ("rule=threshold,tua=0.3", "not key=value"),
                         ("rule=threshold,tau=high", "not a number"),
                         ("rule=greedy,k=99", "k must be"),
                         ("rule=threshold,tau=2", "tau")]:
        with pytest.raises(ValueError, match=message):
            parse_row(bad, 0.8, 1.0, 4)


def eval_row(id: str, pass_at_1: float, tps: float, reference: str) -> EvalRow:
    return EvalRow(id=id, rule=id.split()[0], params={}, k=4, temperature=0.8, samples=1,
                   problems=100, passed=round(100 * pass_at_1), pass_at_1=pass_at_1,
                   pass_at_1_interval=(pass_at_1, pass_at_1), acceptance_rate=0.5,
                   mean_acceptance_length=2.0, tokens_per_second=tps, generated_tokens=1,
                   seconds=1.0, reference=reference)


def test_fastest_within_budget():
    ref = eval_row("exact", 0.40, 10.0, "exact")
    rows = [ref, eval_row("typical a", 0.39, 12.0, "exact"),
            eval_row("typical b", 0.37, 15.0, "exact"),
            eval_row("threshold", 0.20, 30.0, "exact"),
            eval_row("ratio", 0.45, 11.0, "exact")]
    assert fastest_within_budget(rows, ref, 2).id == "typical a"
    assert fastest_within_budget(rows, ref, 3).id == "typical b"
    assert fastest_within_budget(rows, ref, 0).id == "ratio"  # better and faster
    assert fastest_within_budget(rows, ref, 100).id == "threshold"
    # nothing faster within the budget: the reference itself
    assert fastest_within_budget([ref, eval_row("slow", 0.40, 5.0, "exact")], ref, 1) is ref
    with pytest.raises(ValueError, match="budget_points"):
        fastest_within_budget(rows, ref, -1)
    # per reference: a greedy group and a sampling group picked apart
    greedy = eval_row("greedy", 0.30, 9.0, "greedy")
    picks = select_within([*rows, greedy, eval_row("g-lossy", 0.10, 50.0, "greedy")], 2)
    assert [(p["reference"], p["pick"]) for p in picks] == [("exact", "typical a"),
                                                            ("greedy", "greedy")]


# -- the harness, with a stand-in decoder ----------------------------------------------------


class ScriptedDecoder:
    """Stands in for SpeculativeDecoder: answers prompt [i] with token [i] (``decode`` maps it
    to a scripted answer), counting its calls."""

    calls = 0

    def __init__(self, verifier, drafter, params, k, **_):
        self.k = k

    def generate(self, prompts, max_new_tokens, seed=0, eos_token_id=None, seeds=None):
        ScriptedDecoder.calls += 1
        stats = SpecStats(verify_steps=2, draft_tokens=2 * self.k, accepted_tokens=self.k,
                          generated_tokens=self.k + 2, total_time=0.01)
        return GenerationResult([[p[0]] for p in prompts], [stats] * len(prompts), stats)


class NoDecoder:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a resumed run decoded again")


def test_the_run_goes_on_past_hangs_and_crashes_and_resumes(tmp_path, monkeypatch, problems):
    # problem 0: a right answer; 1: an endless loop; 2: a crash
    answers = [
        f"```python\n{problems[0]['prompt']}{problems[0]['canonical_solution']}```",
        "```python\nwhile True:\n    pass\n```",
        "```python\nimport os\nos.abort()\n```",
    ]
    monkeypatch.setattr(task_eval, "SpeculativeDecoder", ScriptedDecoder)
    rows = with_references([parse_row("rule=typical", 0.8, 1.0, 4)], 4)
    setup = {"task": "test", "max_new_tokens": 8}
    log = AnswerLog(tmp_path / "answers.jsonl", setup)
    kwargs = dict(samples=2, max_new_tokens=8, timeout_s=1.0, memory_mb=512, k=4,
                  progress=False)
    args = (object(), object(), rows, problems, [[0], [1], [2]], (), lambda ids: answers[ids[0]])
    ScriptedDecoder.calls = 0
    results, counts = task_eval.run_humaneval(*args, log, **kwargs)
    # 2 rows × 3 problems × 2 samples, each decoded once (plus one warm-up per row)
    assert (counts.decoded, counts.reused) == (12, 0)
    assert ScriptedDecoder.calls == 12 + 2
    for row in results:
        assert row.passed == 2 and row.pass_at_1 == pytest.approx(1 / 3)
        assert row.failures == {"timeout": 2, "crashed": 2}
        assert row.reference == "exact T=0.8 top_p=1 k=4"
    assert results[0].speedup == pytest.approx(1.0)
    lines = (tmp_path / "answers.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 12 and json.loads(lines[0]) == {"setup": setup}

    # a rerun decodes nothing; one answer cut from the log (a run killed mid-write) is redone
    (tmp_path / "answers.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    ScriptedDecoder.calls = 0
    again, counts = task_eval.run_humaneval(
        *args, AnswerLog(tmp_path / "answers.jsonl", setup), **kwargs)
    assert (counts.decoded, counts.reused) == (1, 11) and ScriptedDecoder.calls == 1 + 1
    assert [(r.id, r.passed, r.failures) for r in again] == [
        (r.id, r.passed, r.failures) for r in results]
    monkeypatch.setattr(task_eval, "SpeculativeDecoder", NoDecoder)
    _, counts = task_eval.run_humaneval(
        *args, AnswerLog(tmp_path / "answers.jsonl", setup), **kwargs)
    assert (counts.decoded, counts.reused) == (0, 12)

    # a log written with other settings is refused, naming what changed
    with pytest.raises(ValueError, match="max_new_tokens: 8 there, 16 now"):
        AnswerLog(tmp_path / "answers.jsonl", {**setup, "max_new_tokens": 16})


def test_a_batched_run_gives_each_answer_its_own_seed(tmp_path, monkeypatch, problems):
    """``batch_size``: a row answers several problems per decoder call, each with the seed
    it has alone, and the verdicts are the same."""
    answers = [f"```python\n{problems[0]['prompt']}{problems[0]['canonical_solution']}```",
               "```python\nraise ValueError\n```",
               f"```python\n{problems[2]['prompt']}{problems[2]['canonical_solution']}```"]
    monkeypatch.setattr(task_eval, "SpeculativeDecoder", ScriptedDecoder)
    rows = with_references([parse_row("rule=typical", 0.8, 1.0, 4)], 4)
    args = (object(), object(), rows, problems, [[0], [1], [2]], (), lambda ids: answers[ids[0]])
    results = {}
    for batch_size in (1, 2):
        ScriptedDecoder.calls = 0
        log = AnswerLog(tmp_path / f"b{batch_size}.jsonl", {"task": "test"})
        results[batch_size], _ = task_eval.run_humaneval(
            *args, log, samples=2, max_new_tokens=8, timeout_s=5.0, memory_mb=512, k=4,
            progress=False, batch_size=batch_size)
        calls = ScriptedDecoder.calls
        # 2 rows × 2 samples × (3 problems at batch 1, batches of 2 + 1 at batch 2), warm-ups
        assert calls == 2 * 2 * (3 if batch_size == 1 else 2) + 2
        logged = [json.loads(line) for line in log.path.read_text().splitlines()[1:]]
        assert sorted((a["row"], a["task_id"], a["sample"], a["seed"]) for a in logged) == (
            sorted((r.id, p["task_id"], s, i * task_eval.MAX_SAMPLES + s)
                   for r in rows for i, p in enumerate(problems) for s in range(2)))
    assert [(r.id, r.passed, r.failures) for r in results[1]] == [
        (r.id, r.passed, r.failures) for r in results[2]]
    assert results[2][0].passed == 4 and results[2][0].failures == {"failed": 2}


@pytest.mark.parametrize("args, message", [
    ([], "pass --verifier"),
    (["--verifier", "x", "--problems", "0"], r"problems must be N in \[1, 164\] or all"),
    (["--verifier", "x", "--row", "rule=fast"], "rule must be one of"),
    (["--verifier", "x", "--samples", "0"], r"samples must be in \[1,"),
    (["--verifier", "x", "--timeout", "0"], "timeout must be in"),
    (["--verifier", "x", "--reference-engines", "y"], "weights comparison"),
])
def test_eval_humaneval_refuses_bad_settings_naming_them(args, message, capsys, tmp_path):
    from paradraft.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--task", "humaneval", "--out", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("command, args, refused", [
    ("eval", ["--row", "rule=greedy"], "--row"),
    ("eval", ["--problems", "3", "--select-within", "2"], "--problems, --select-within"),
    ("tune", ["--samples", "2"], "--samples"),
    ("tune", ["--engines", "x"], "--engines"),
])
def test_humaneval_options_without_the_task_are_refused_naming_them(command, args, refused,
                                                                    capsys, tmp_path):
    from paradraft.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--out", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert refused in capsys.readouterr().err


def test_row_spec_reads_back_as_the_same_row():
    for rule in ("dynamic", "threshold", "ratio", "typical"):
        for settings in tune_grid(rule):
            row = parse_row(row_spec(rule, settings), 1.0, 1.0, 4)
            assert row.params == RuleParams(rule, **{"top_p": 1.0, **settings})


# -- the command, with SmolLM2 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path) -> Path:
    # the default cache, as the command's own .gguf argument would use
    return gguf.cached_import(smollm2_gguf)


def test_eval_humaneval_with_smollm2_writes_consistent_json_and_resumes(smol, tmp_path,
                                                                        monkeypatch):
    from paradraft.cli.main import main

    out = tmp_path / "eval_humaneval.json"
    argv = ["eval", "--task", "humaneval", "--verifier", str(smol), "--drafters", "ngram",
            "--problems", "2", "--max-new-tokens", "32", "--row", "rule=threshold,T=0.8",
            "--row", "rule=greedy", "--select-within", "5", "--no-progress",
            "--out", str(out)]
    main(argv)
    first = json.loads(out.read_text())
    assert (first["problems"], first["decoded"], first["reused"]) == (2, 6, 0)
    rows = {r["id"]: r for r in first["rows"]}
    assert list(rows) == ["exact T=0.8 top_p=1 k=4", "threshold tau=0.3 T=0.8 top_p=1 k=4",
                          "greedy k=4"]
    log = [json.loads(line) for line in Path(first["answers_log"]).read_text().splitlines()]
    assert log[0]["setup"]["max_new_tokens"] == 32 and len(log) == 1 + 6
    for r in first["rows"]:
        answers = [a for a in log[1:] if a["row"] == r["id"]]
        assert len(answers) == 2 and {a["task_id"] for a in answers} == {
            "HumanEval/0", "HumanEval/1"}
        assert r["passed"] == sum(a["passed"] for a in answers)
        assert r["pass_at_1"] == pytest.approx(r["passed"] / 2)
        low, high = r["pass_at_1_interval"]
        assert low <= r["pass_at_1"] <= high
        assert sum(r["failures"].values()) == 2 - r["passed"]
        assert all(a["generated_tokens"] <= 32 and a["completion"] for a in answers)
        assert 0.0 <= r["acceptance_rate"] <= 1.0
        assert 1.0 <= r["mean_acceptance_length"] <= 5.0
        assert r["tokens_per_second"] == pytest.approx(
            sum(a["generated_tokens"] for a in answers) / sum(a["seconds"] for a in answers))
    assert rows["greedy k=4"]["reference"] == "greedy k=4"
    threshold = rows["threshold tau=0.3 T=0.8 top_p=1 k=4"]
    assert threshold["reference"] == "exact T=0.8 top_p=1 k=4"
    assert threshold["speedup"] == pytest.approx(
        threshold["tokens_per_second"] / rows["exact T=0.8 top_p=1 k=4"]["tokens_per_second"])
    assert {p["reference"] for p in first["selection"]} == {"exact T=0.8 top_p=1 k=4",
                                                           "greedy k=4"}
    assert out.with_suffix(".png").stat().st_size > 0

    # the rerun decodes nothing: every answer comes from the log
    monkeypatch.setattr(task_eval, "SpeculativeDecoder", NoDecoder)
    main(argv)
    second = json.loads(out.read_text())
    assert (second["decoded"], second["reused"]) == (0, 6)
    assert second["rows"] == first["rows"]
    assert len(Path(first["answers_log"]).read_text().splitlines()) == 1 + 6


def test_tune_humaneval_picks_the_fastest_grid_setting_within_the_budget(smol, tmp_path):
    """`tune --task humaneval`: --rule's grid, each temperature's lossless reference, and per
    reference the fastest setting whose pass@1 is within 2 points (the default budget)."""
    from paradraft.cli.main import main

    main(["tune", "--task", "humaneval", "--rule", "ratio", "--verifier", str(smol),
          "--drafters", "ngram", "--problems", "1", "--max-new-tokens", "8", "--no-progress",
          "--out", str(tmp_path)])
    result = json.loads((tmp_path / "tune_humaneval.json").read_text())
    rows = {r["id"]: r for r in result["rows"]}
    grid = tune_grid("ratio")
    assert len(rows) == len(grid) + 2
    references = {r["reference"] for r in rows.values()}
    assert references == {"exact T=0.8 top_p=1 k=4", "exact T=1 top_p=1 k=4"}
    assert sorted(p["reference"] for p in result["selection"]) == sorted(references)
    for pick in result["selection"]:
        ref, best = rows[pick["reference"]], rows[pick["pick"]]
        assert pick["budget_points"] == 2.0
        within = [r for r in rows.values()
                  if r["reference"] == ref["id"] and r["pass_at_1"] >= ref["pass_at_1"] - 0.02]
        assert best in within
        assert best["tokens_per_second"] == max(r["tokens_per_second"] for r in within)
