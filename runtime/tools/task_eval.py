"""What each correction rule costs on a task with a functional check: HumanEval pass@1 beside
acceptance and speed (``paradraft eval --task humaneval``).

Each row (a rule and its parameters, K) answers every problem through the verifier's chat
template at batch 1; the answer's code (``humaneval.extract_code``) runs against the problem's
tests in a child process (``code_exec.run_program``), where a hang or a crash is a failure with
its reason. Rows run interleaved, problem by problem, so that a slow spell of the machine falls
on all of them alike.

- pass@1: a greedy row (T = 0) decodes each problem once, its pass@1 is the share of problems
  solved. A sampling row decodes ``samples`` answers per problem, each with its own seed, and
  its pass@1 is the unbiased estimator of Chen et al. (2021) averaged over problems. The 95 %
  interval is a percentile bootstrap over problems (the samples of one problem are not
  independent trials, so a Wilson interval over all samples would be too narrow).
- speed: generated tokens over the decoder's wall clock (prefill included), summed over the
  row's answers; the speed-up is over the lossless rule at the same temperature and top-p
  (``greedy`` for T = 0, ``exact`` for T > 0) at the run's K, a row added to every run.
- resume: every answer is appended to a JSONL log as it finishes, keyed by row, task and
  sample; a rerun reuses what the log holds and decodes only the rest. The log's first line
  holds the settings its answers depend on, and a rerun with other settings is refused.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..correction import RuleParams
from ..drafters import AnyDrafter
from ..speculative import SpeculativeDecoder
from . import humaneval
from .code_exec import run_program

# the RuleParams fields each rule reads (besides temperature and top_p, which every rule but
# greedy samples with): what names a row and keys its answers in the log
RULE_FIELDS = {"exact": (), "greedy": (), "threshold": ("tau",), "ratio": ("gamma",),
               "dynamic": ("tau", "alpha", "top_p_membership"),
               "typical": ("epsilon", "delta")}
# a row spec's keys: generate's flag names (either spelling of the dashed ones), K and T
ROW_KEYS = {"rule": "rule", "k": "k", "t": "temperature", "temperature": "temperature",
            "top_p": "top_p", "top-p": "top_p", "tau": "tau", "gamma": "gamma",
            "alpha": "alpha", "top_p_membership": "top_p_membership",
            "top-p-membership": "top_p_membership", "epsilon": "epsilon", "delta": "delta"}
MAX_SAMPLES = 1000  # samples per problem (each sample's seed is problem * 1000 + sample)


@dataclass(frozen=True)
class RowSpec:
    """One row: a rule with its parameters, and K (0: plain decoding, no drafts)."""

    params: RuleParams
    k: int

    @property
    def greedy(self) -> bool:
        return self.params.rule == "greedy"

    @property
    def temperature(self) -> float:
        return 0.0 if self.greedy else self.params.temperature

    @property
    def sampling_key(self) -> tuple[float, float]:
        """(temperature, top_p): rows with the same key share a lossless reference."""
        return (0.0, 1.0) if self.greedy else (self.params.temperature, self.params.top_p)

    @property
    def id(self) -> str:
        p = self.params
        parts = [p.rule]
        parts += [f"{name}={getattr(p, name):g}" if not isinstance(getattr(p, name), bool)
                  else f"{name}={str(getattr(p, name)).lower()}" for name in RULE_FIELDS[p.rule]]
        if not self.greedy:
            parts += [f"T={p.temperature:g}", f"top_p={p.top_p:g}"]
        return " ".join([*parts, f"k={self.k}"])


def row_spec(rule: str, settings: dict) -> str:
    """The ``--row`` text of ``rule`` at ``settings`` (RuleParams field names), e.g.
    ``row_spec("threshold", {"tau": 0.3, "temperature": 0.8})`` →
    ``"rule=threshold,tau=0.3,temperature=0.8"``; ``parse_row`` reads it back."""
    return ",".join([f"rule={rule}", *(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in settings.items())])


def parse_row(text: str, temperature: float, top_p: float, k: int,
              defaults: dict[str, dict[str, float]] | None = None) -> RowSpec:
    """A row from ``"rule=threshold,tau=0.3,T=0.8"``: comma-separated key=value pairs with
    generate's flag names (``rule``, ``temperature`` or ``T``, ``top_p``, ``tau``, ``gamma``,
    ``alpha``, ``top_p_membership``, ``epsilon``, ``delta``) and ``k``. Unset: ``temperature``,
    ``top_p`` and ``k`` from the arguments, a rule parameter from ``defaults[rule]`` (the
    engine dir's calibrated ones), else RuleParams' fixed default."""
    given: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        name = ROW_KEYS.get(key.strip().lower())
        if not eq or name is None:
            raise ValueError(f"row {text!r}: {part!r} is not key=value with a key of "
                             f"{', '.join(sorted(set(ROW_KEYS.values())))}")
        if name in given:
            raise ValueError(f"row {text!r}: {name} given twice")
        given[name] = value.strip()
    if "rule" not in given:
        raise ValueError(f"row {text!r}: needs rule=<one of {', '.join(RULE_FIELDS)}>")
    rule = given.pop("rule")
    if rule not in RULE_FIELDS:
        raise ValueError(f"row {text!r}: rule must be one of {', '.join(RULE_FIELDS)}; "
                         f"got {rule!r}")
    values: dict = {"temperature": temperature, "top_p": top_p,
                    **(defaults or {}).get(rule, {})}
    row_k = k
    for name, value in given.items():
        try:
            if name == "k":
                row_k = int(value)
            elif name == "top_p_membership":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                values[name] = value.lower() in ("true", "1")
            else:
                values[name] = float(value)
        except ValueError:
            raise ValueError(f"row {text!r}: {name}={value!r} is not a "
                             f"{'boolean' if name == 'top_p_membership' else 'number'}"
                             ) from None
    if not 0 <= row_k <= 64:
        raise ValueError(f"row {text!r}: k must be in [0, 64]; got {row_k}")
    return RowSpec(RuleParams(rule=rule, **values), row_k)


def reference_for(row: RowSpec, k: int) -> RowSpec:
    """The lossless row ``row`` is measured against: greedy for a greedy row, ``exact`` at the
    row's temperature and top-p otherwise, both at the run's ``k``."""
    if row.greedy:
        return RowSpec(RuleParams("greedy"), k)
    return RowSpec(RuleParams("exact", temperature=row.params.temperature,
                              top_p=row.params.top_p), k)


def with_references(rows: list[RowSpec], k: int) -> list[RowSpec]:
    """``rows`` with each one's lossless reference added ahead of it where missing, and
    duplicates (the same id) dropped."""
    out: dict[str, RowSpec] = {}
    for row in rows:
        ref = reference_for(row, k)
        out.setdefault(ref.id, ref)
        out.setdefault(row.id, row)
    return list(out.values())


# -- pass@k ----------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased estimator of pass@k from ``n`` samples of which ``c``
    passed: 1 − C(n − c, k) / C(n, k), as a product (the binomials overflow for large n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def bootstrap_interval(values: list[float], resamples: int = 2000, seed: int = 0
                       ) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the mean of ``values`` (one per problem)."""
    if not values:
        raise ValueError("the bootstrap needs at least one value")
    data = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(data), (resamples, len(data)))
    low, high = np.percentile(data[picks].mean(axis=1), [2.5, 97.5])
    return float(low), float(high)


# -- the log of answers ----------------------------------------------------------------------


@dataclass
class Answer:
    """One decoded answer and its verdict: a line of the JSONL log."""

    row: str
    task_id: str
    sample: int
    seed: int
    completion: str
    passed: bool
    reason: str  # code_exec's: passed, failed, timeout, crashed, memory, exited
    detail: str
    generated_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    seconds: float  # the decoder's wall clock for this answer, prefill included
    exec_seconds: float

    @property
    def key(self) -> tuple[str, str, int]:
        return self.row, self.task_id, self.sample


class AnswerLog:
    """The JSONL log of answers at ``path``: its first line the ``setup`` the answers depend
    on, then one answer a line. A line cut short (the run killed while writing) is skipped."""

    def __init__(self, path: str | Path, setup: dict):
        self.path = Path(path)
        self.setup = json.loads(json.dumps(setup))  # as it reads back
        self.answers: dict[tuple[str, str, int], Answer] = {}
        names = {f.name for f in fields(Answer)}
        if self.path.is_file() and self.path.stat().st_size:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            try:
                header = json.loads(lines[0])["setup"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{self.path} is not an answer log (no setup line first): "
                                 "remove it or choose another --out") from None
            changed = sorted(k for k in {*header, *self.setup}
                             if header.get(k) != self.setup.get(k))
            if changed:
                diff = "; ".join(f"{k}: {header.get(k)!r} there, {self.setup.get(k)!r} now"
                                 for k in changed)
                raise ValueError(f"{self.path} holds answers from other settings ({diff}): "
                                 "remove it or choose another --out")
            if not self.path.read_bytes().endswith(b"\n"):  # a line cut short: end it
                with self.path.open("a", encoding="utf-8") as f:
                    f.write("\n")
            for line in lines[1:]:
                try:
                    data = json.loads(line)
                    answer = Answer(**{k: v for k, v in data.items() if k in names})
                except (json.JSONDecodeError, TypeError):
                    continue
                self.answers[answer.key] = answer
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"setup": self.setup}) + "\n", encoding="utf-8")

    def add(self, answer: Answer) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(answer)) + "\n")
        self.answers[answer.key] = answer


# -- rows ------------------------------------------------------------------------------------


@dataclass
class EvalRow:
    id: str
    rule: str
    params: dict
    k: int
    temperature: float  # 0 for greedy
    samples: int  # per problem
    problems: int
    passed: int  # answers that passed, over problems × samples
    pass_at_1: float
    pass_at_1_interval: tuple[float, float]  # 95 %, bootstrap over problems
    acceptance_rate: float
    mean_acceptance_length: float  # tokens per verifier call, the bonus token included
    tokens_per_second: float
    generated_tokens: int
    seconds: float
    reference: str = ""  # the id of the lossless row the speed-up is over
    speedup: float | None = None
    failures: dict = field(default_factory=dict)  # reason: answers

    @property
    def spec(self) -> RowSpec:
        return RowSpec(RuleParams(**self.params), self.k)


def summarize(spec: RowSpec, answers: list[Answer], problems: int, samples: int) -> EvalRow:
    """A row's figures from its answers (``samples`` per problem, ``problems`` problems)."""
    if len(answers) != problems * samples or not answers:
        raise ValueError(f"row {spec.id}: {len(answers)} answers for {problems} problems × "
                         f"{samples} samples")
    by_task: dict[str, list[bool]] = {}
    for a in answers:
        by_task.setdefault(a.task_id, []).append(a.passed)
    per_problem = [pass_at_k(len(v), sum(v), 1) for v in by_task.values()]
    drafted = sum(a.draft_tokens for a in answers)
    steps = sum(a.verify_steps for a in answers)
    accepted = sum(a.accepted_tokens for a in answers)
    tokens = sum(a.generated_tokens for a in answers)
    seconds = sum(a.seconds for a in answers)
    return EvalRow(
        id=spec.id, rule=spec.params.rule, params=asdict(spec.params), k=spec.k,
        temperature=spec.temperature, samples=samples, problems=problems,
        passed=sum(a.passed for a in answers),
        pass_at_1=sum(per_problem) / len(per_problem),
        pass_at_1_interval=bootstrap_interval(per_problem),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_acceptance_length=(accepted + steps) / max(steps, 1),
        tokens_per_second=tokens / seconds if seconds else 0.0,
        generated_tokens=tokens, seconds=seconds,
        failures=dict(Counter(a.reason for a in answers if not a.passed)))


def fastest_within_budget(rows: list[EvalRow], reference: EvalRow, budget_points: float
                          ) -> EvalRow:
    """The fastest of ``rows`` (tokens/s) whose pass@1 is at most ``budget_points``
    percentage points below ``reference``'s; the reference itself when none is faster."""
    if budget_points < 0:
        raise ValueError(f"budget_points must be >= 0; got {budget_points}")
    floor = reference.pass_at_1 - budget_points / 100.0
    # a hair of tolerance: pass@1 values are sums of fractions
    ok = [r for r in rows if r.pass_at_1 >= floor - 1e-12]
    return max([reference, *ok], key=lambda r: r.tokens_per_second)


# -- the run ---------------------------------------------------------------------------------


@dataclass
class RunCounts:
    decoded: int = 0  # answers decoded and run in this call
    reused: int = 0  # answers taken from the log


def run_humaneval(verifier, drafter: AnyDrafter | None, rows: list[RowSpec],
                  problems: list[dict], prompts: list[list[int]], eos: tuple[int, ...],
                  decode: Callable[[list[int]], str], log: AnswerLog, *, samples: int = 1,
                  max_new_tokens: int = 512, seed: int = 0, timeout_s: float = 10.0,
                  memory_mb: int = 1024, k: int = 4, fused_correction: str = "auto",
                  progress: bool = True, batch_size: int = 1
                  ) -> tuple[list[EvalRow], RunCounts]:
    """Answer every problem with every row (``samples`` answers per problem for a sampling
    row, one for a greedy row), run each answer's tests, and summarise the rows; answers the
    log holds are reused. ``k``: the run's K, that of the lossless references the speed-ups
    are over (``with_references``); a row whose reference is not among ``rows`` has none.
    ``batch_size``: a row answers up to this many problems in one batch (each answer with
    its own seed, as alone; greedy answers are the same at any batch size); an answer's
    seconds are its share of its batch's wall clock, by generated tokens."""
    if len(prompts) != len(problems) or not problems:
        raise ValueError(f"{len(prompts)} prompts for {len(problems)} problems")
    if not 1 <= samples <= MAX_SAMPLES:
        raise ValueError(f"samples must be in [1, {MAX_SAMPLES}]; got {samples}")
    if drafter is None and any(r.k for r in rows):
        raise ValueError("rows with k > 0 need a drafter")
    n_samples = {r.id: 1 if r.greedy else samples for r in rows}
    max_seq_len = max(map(len, prompts)) + max_new_tokens
    decoders: dict[str, SpeculativeDecoder] = {}

    def decoder(spec: RowSpec) -> SpeculativeDecoder:
        if spec.id not in decoders:
            dec = SpeculativeDecoder(verifier, drafter if spec.k else None, spec.params,
                                     k=spec.k, max_batch_size=batch_size,
                                     max_seq_len=max_seq_len,
                                     acceptance_floor=0.0, fused_correction=fused_correction)
            # warm-up, untimed: first calls pay one-off costs (sessions, kernel choices)
            dec.generate([prompts[0][:16]], 4, seed=seed)
            decoders[spec.id] = dec
        return decoders[spec.id]

    todo = [(i, spec, s) for i in range(len(problems)) for spec in rows
            for s in range(n_samples[spec.id])]
    counts = RunCounts()
    pending = [t for t in todo if (t[1].id, problems[t[0]]["task_id"], t[2]) not in log.answers]
    counts.reused = len(todo) - len(pending)
    bar = tqdm(total=len(todo), initial=counts.reused, desc="humaneval", unit="answer",
               disable=not progress)
    # rows interleaved batch by batch of problems: a slow spell falls on every row alike
    batches: dict[tuple[int, str, int], list[tuple[int, RowSpec, int]]] = {}
    for i, spec, sample in pending:
        batches.setdefault((i // batch_size, spec.id, sample), []).append((i, spec, sample))
    for batch in batches.values():
        spec, sample = batch[0][1], batch[0][2]
        seeds = [seed + i * MAX_SAMPLES + sample for i, _, _ in batch]
        dec = decoder(spec)
        t0 = time.perf_counter()
        result = dec.generate([prompts[i] for i, _, _ in batch], max_new_tokens,
                              eos_token_id=eos, seeds=seeds)
        seconds = time.perf_counter() - t0
        tokens = max(sum(len(t) for t in result.token_ids), 1)
        for (i, _, _), answer_seed, ids, stats in zip(batch, seeds, result.token_ids,
                                                      result.row_stats, strict=True):
            problem = problems[i]
            completion = decode(ids)
            code = humaneval.extract_code(completion, problem["entry_point"])
            verdict = run_program(humaneval.program(problem, code), timeout_s, memory_mb)
            log.add(Answer(
                row=spec.id, task_id=problem["task_id"], sample=sample, seed=answer_seed,
                completion=completion, passed=verdict.passed, reason=verdict.reason,
                detail=verdict.detail, generated_tokens=stats.generated_tokens,
                draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                verify_steps=stats.verify_steps, seconds=seconds * len(ids) / tokens,
                exec_seconds=verdict.seconds))
            counts.decoded += 1
            bar.update(1)
        bar.set_postfix_str(spec.id, refresh=False)
    bar.close()
    out = []
    for spec in rows:
        answers = [log.answers[(spec.id, p["task_id"], s)] for p in problems
                   for s in range(n_samples[spec.id])]
        out.append(summarize(spec, answers, len(problems), n_samples[spec.id]))
    fill_speedups(out, k)
    return out, counts


def fill_speedups(rows: list[EvalRow], k: int) -> None:
    """Each row's speed-up over its lossless reference at the run's ``k``
    (``reference_for``), where that row is among ``rows``."""
    by_id = {r.id: r for r in rows}
    for r in rows:
        ref = by_id.get(reference_for(r.spec, k).id)
        if ref is not None:
            r.reference = ref.id
            r.speedup = (r.tokens_per_second / ref.tokens_per_second
                         if ref.tokens_per_second else None)


def select_within(rows: list[EvalRow], budget_points: float) -> list[dict]:
    """Per lossless reference among ``rows``: the fastest row measured against it whose
    pass@1 stays within ``budget_points`` of it (``fastest_within_budget``)."""
    picks = []
    for ref in (r for r in rows if r.reference == r.id):
        group = [r for r in rows if r.reference == ref.id and r is not ref]
        best = fastest_within_budget(group, ref, budget_points)
        picks.append({"reference": ref.id, "pick": best.id, "pass_at_1": best.pass_at_1,
                      "reference_pass_at_1": ref.pass_at_1, "speedup": best.speedup,
                      "budget_points": budget_points})
    return picks


def print_rows(rows: list[EvalRow], title: str) -> None:
    print(title)
    print(f"{'row':50s} {'pass@1':>7s} {'95% interval':>15s} {'passed':>9s} {'accept':>6s} "
          f"{'len':>5s} {'tok/s':>7s} {'speed-up':>8s}  failures")
    for r in rows:
        low, high = r.pass_at_1_interval
        speedup = f"{r.speedup:7.2f}x" if r.speedup is not None else f"{'-':>8s}"
        failures = ", ".join(f"{k} {v}" for k, v in sorted(r.failures.items()))
        print(f"{r.id:50s} {r.pass_at_1:7.1%} [{low:5.1%}, {high:5.1%}] "
              f"{r.passed:4d}/{r.problems * r.samples:<4d} {r.acceptance_rate:6.2f} "
              f"{r.mean_acceptance_length:5.2f} {r.tokens_per_second:7.1f} {speedup}  "
              f"{failures}")


def frontier_plot(rows: list[EvalRow], path: str | Path) -> str | None:
    """Speed-up against pass@1 (with its interval), one point per row that has a reference,
    as a PNG at ``path``; returns why it was skipped (matplotlib missing), else None."""
    try:
        import matplotlib
    except ImportError:
        return "the frontier plot needs matplotlib (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = sorted({r.reference for r in rows if r.speedup is not None})
    for n, ref in enumerate(groups):
        group = [r for r in rows if r.reference == ref and r.speedup is not None]
        xs = [100 * r.pass_at_1 for r in group]
        err = [[100 * (r.pass_at_1 - r.pass_at_1_interval[0]) for r in group],
               [100 * (r.pass_at_1_interval[1] - r.pass_at_1) for r in group]]
        ax.errorbar(xs, [r.speedup for r in group], xerr=err, fmt="o", capsize=3,
                    color=f"C{n}", label=f"against {ref}")
        for r, x in zip(group, xs, strict=True):
            ax.annotate(r.id, (x, r.speedup), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="pass@1 (%), 95 % interval", ylabel="speed-up over the lossless rule",
           title="HumanEval: speed-up against pass@1 per rule")
    if groups:
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
