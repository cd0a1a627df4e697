"""`bench --peer llamacpp` without llama.cpp: its plan, the programs' command lines, their
timings parsed from logs llama.cpp 0.3.36 printed, the side-by-side ratios, and HumanEval's
problems as chat requests (`--prompt-file humaneval[:N]`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from paradraft.runtime.checkpoints import DEMO_DIR
from paradraft.runtime.tools import humaneval
from paradraft.runtime.tools.bench import BenchRow, read_prompt_file
from paradraft.runtime.tools.peer_llamacpp import (
    TOOLS,
    LlamaCppPeer,
    PeerError,
    compare,
    parse_timings,
)

# lines of real logs (llama.cpp 0.3.36, Qwen2.5-Coder-1.5B, 2 threads, "def add(a, b):")
COMPLETION_LOG = """\
0.02.307.910 I common_perf_print:        load time =     196.69 ms
0.02.307.951 I common_perf_print: prompt eval time =     196.41 ms /     6 tokens (   32.73 ms per token,    30.55 tokens per second)
0.02.308.019 I common_perf_print:        eval time =     606.92 ms /     7 runs   (   86.70 ms per token,    11.53 tokens per second)
0.02.308.032 I common_perf_print:       total time =     808.94 ms /    13 tokens
"""  # noqa: E501
SPECULATIVE_LOG = """\
0.02.501.949 I encoded    6 tokens in    0.141 seconds, speed:   42.423 t/s
0.02.502.136 I decoded    9 tokens in    0.811 seconds, speed:   11.104 t/s
0.02.502.170 I n_draft   = 16
0.02.502.201 I n_predict = 9
"""


def test_timings_come_from_the_programs_logs():
    # llama-completion: the first token comes from the prompt's pass, each run decodes one
    assert parse_timings(COMPLETION_LOG, speculative=False) == (8, pytest.approx(0.19641),
                                                                pytest.approx(0.60692))
    assert parse_timings(SPECULATIVE_LOG, speculative=True) == (9, 0.141, 0.811)
    with pytest.raises(PeerError, match="llama-completion printed no timings"):
        parse_timings("main: error", speculative=False)
    with pytest.raises(PeerError, match="llama-speculative-simple printed no timings"):
        parse_timings(COMPLETION_LOG, speculative=True)


@pytest.fixture
def peer(tmp_path: Path) -> LlamaCppPeer:
    """A peer over stand-in program files (build_tools finds them and builds nothing)."""
    for tool in TOOLS:
        (tmp_path / tool).touch()
    return LlamaCppPeer(Path("v.gguf"), Path("d.gguf"), threads=2, decode=str,
                        tools=tmp_path)


def test_plan_and_command_lines(peer: LlamaCppPeer, tmp_path: Path):
    rows = peer.plan([1, 4], [3, 16])
    assert [(r.variant, r.k) for r in rows] == [
        ("generate", 0), ("draft-simple", 3), ("draft-simple", 16), ("ngram-simple", 3),
        ("ngram-simple", 16), ("ngram-mod", 3), ("ngram-mod", 16)]
    assert {(r.system, r.backend, r.batch_size, r.sampling) for r in rows} == {
        ("llamacpp", "llamacpp", 1, False)}
    assert peer.plan([4], [3]) == []  # the programs decode one sequence
    prompt = tmp_path / "p.txt"
    plain = peer.argv(rows[0], prompt, 64, stop=True)
    assert Path(plain[0]).name == "llama-completion" and "--ignore-eos" not in plain
    assert plain[plain.index("--temp") + 1] == "0" and plain[plain.index("-t") + 1] == "2"
    draft = peer.argv(rows[2], prompt, 64, stop=False)
    assert Path(draft[0]).name == "llama-speculative-simple" and "--ignore-eos" in draft
    assert draft[draft.index("--spec-draft-n-max") + 1] == "16"
    assert draft[draft.index("-md") + 1] == "d.gguf"
    assert "-md" not in peer.argv(rows[3], prompt, 64, stop=True)
    no_draft = LlamaCppPeer(Path("v.gguf"), None, threads=2, decode=str, tools=peer.tools)
    assert "draft-simple" not in {r.variant for r in no_draft.plan([1], [3])}


def row(system: str, variant: str, k: int, tps: list[float], decode: list[float]) -> BenchRow:
    r = BenchRow(system, variant, "greedy", k, 1, False,
                 backend="llamacpp")
    r.repeat_tokens_per_second, r.repeat_decode_tokens_per_second = tps, decode
    return r


def test_compare_takes_each_sides_plain_and_best():
    rows = [row("ours", "baseline", 0, [10.0, 12.0, 11.0], [14.0, 14.0, 14.0]),
            row("ours", "ngram", 16, [20.0, 24.0, 21.0], [40.0, 44.0, 42.0]),
            row("llamacpp", "generate", 0, [11.0, 12.0, 10.0], [13.0, 14.0, 12.0]),
            row("llamacpp", "ngram-simple", 16, [25.0, 24.0, 30.0], [41.0, 40.0, 44.0])]
    out = compare(rows)
    e2e, dec = out["end_to_end"], out["decode"]
    # per-repeat ratios, then their median: 10/11, 12/12, 11/10
    assert e2e["ours_plain_over_llamacpp_plain"] == pytest.approx(1.0)
    assert e2e["ours_best"] == "llamacpp ngram k=16 (fixed)"
    assert e2e["llamacpp_best"] == "ngram-simple k=16"
    assert e2e["ours_best_over_llamacpp_best"] == pytest.approx(0.8)  # 20/25, 24/24, 21/30
    assert dec["ours_best_over_llamacpp_best"] == pytest.approx(40 / 41)  # 40/41, 44/40, 42/44
    assert compare(rows[:2]) == {}  # no llama.cpp rows: nothing to compare


def test_humaneval_problems_are_chat_requests(tmp_path: Path):
    first = humaneval.problems(3)
    assert [p["task_id"] for p in first] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert len(humaneval.problems()) == 164
    assert first[0]["prompt"] in humaneval.chat_request(first[0])["messages"][0]["content"]
    assert humaneval.parse_spec("humaneval") is None
    assert humaneval.parse_spec("humaneval:5") == 5
    assert humaneval.parse_spec("prompts/x.jsonl") is False
    with pytest.raises(ValueError, match="humaneval:N takes N in \\[1, 164\\]; got 165"):
        humaneval.problems(165)
    with pytest.raises(ValueError, match="humaneval:N takes a positive integer"):
        humaneval.parse_spec("humaneval:all")
    # through bench's prompt-file reader, with a chat template
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_DIR / "verifier" / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    prompts, _, _ = read_prompt_file("humaneval:2", tmp_path)
    assert len(prompts) == 2 and all(len(p) > 20 for p in prompts)
