"""``paradraft bench``: speed-up and acceptance side by side with the peers, in one run.

Every variant decodes the same held-out prompts with the same models: our autoregressive
baseline, speculative decoding per drafter / rule / K, ``transformers`` greedy ``generate()``
and ``transformers`` assisted generation at the same K: ``assistant_model=`` beside our draft
model, prompt lookup (``prompt_lookup_num_tokens=``, ``max_matching_ngram_size=`` our
``ngram_max``; its smallest n-gram is always 1) beside our ngram drafter. Prompts are token
prompts cut from held-out text, or a JSONL prompt file (``read_prompt_file``: chat messages
or plain prompts, whose requests stop at the end of the turn). Speed-ups are ratios within
this run (the machines are noisy; compare ratios, not absolute tokens/s).
With ``repeats`` > 1 the whole plan runs that many times in turn; a row's tokens/s is its
median and each ratio the median of the per-repeat ratios, so a slow spell during one
variant (the baseline, say) moves one repeat, not the result.

With several ``fused_modes`` (engine backends), the rows at K = 0 and the default K run once
per mode of ``SpeculativeDecoder(fused_correction=...)``: verify and correct in one engine
call, or logits out of the engine and ``correct()`` after; ``summary`` sets them side by side.

Each speculative row is also set against Leviathan et al.'s bound for its measured acceptance
α and draft cost ratio c (``distance_to_bound``), and every row of ours shows where a round's
time goes: draft, verify, correct, prefill and the rest ("other": Python between the phases).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from ..checkpoints import chat_stop_token_ids, format_chat, load_tokenizer
from ..correction import RULES, RuleParams
from ..drafters import MODEL_FREE_DRAFTERS, AnyDrafter
from ..grammar import Guide, RowGrammar, compile_guide, response_format_guide
from ..k_policy import analytic_length
from ..metrics import SpecStats, aggregate
from ..model import Transformer
from ..speculative import EosIds, SpeculativeDecoder
from . import humaneval


@dataclass
class BenchRow:
    system: str  # "ours" | "hf"
    variant: str  # baseline | model | parallel | self | ngram | generate | assisted |
    # prompt_lookup
    rule: str
    k: int
    batch_size: int
    sampling: bool
    schedule: str = "fixed"  # "fixed": K every round | "auto": the goodput policy, K <= k
    tokens: int = 0
    seconds: float = 0.0
    acceptance_rate: float | None = None
    # the i.i.d. α whose expected accepted drafts per round, Σ_{i=1..K} α^i, equal the measured
    # mean (``alpha_from_mean_accepted``): Leviathan's tokens per round then equal the measured
    alpha: float | None = None
    alpha_per_position: float | None = None  # accepted / (accepted + rejections)
    mean_acceptance_length: float | None = None
    mean_k: float | None = None  # draft tokens per verify step (the K the rounds used)
    analytic_acceptance_length: float | None = None  # Leviathan's length at alpha_per_position
    per_position_acceptance: list[float] = field(default_factory=list)
    # c: draft seconds per drafted token over the plain baseline's seconds per step (same batch)
    cost_ratio: float | None = None
    verify_vs_plain_step: float | None = None  # this row's verify pass over a plain step
    bound: float | None = None  # Leviathan's speed-up bound at (alpha, mean_k, cost_ratio)
    # the bound counts decoding rounds only (c is per plain step, prefill excluded), so the
    # speed-up set against it excludes the prefill in both runs: the tokens after each row's
    # first over the seconds after the prefill, median of the per-repeat ratios
    decode_speedup: float | None = None
    efficiency: float | None = None  # decode_speedup / bound
    efficiency_end_to_end: float | None = None  # speedup_vs_baseline / bound (prefill in)
    # the bound with the verify pass at its measured cost (verify_vs_plain_step plain steps,
    # not one): what is left below it is the loop's own cost (correction, bookkeeping)
    bound_at_verify_cost: float | None = None
    loop_efficiency: float | None = None  # decode_speedup / bound_at_verify_cost
    occupancy: float | None = None  # rows per round / batch size (rows finish apart)
    # where the time goes, summed over batches and repeats: draft, verify, correct, prefill,
    # other (the rest of the wall clock: Python between the phases); rounds = decoder steps
    rounds: int = 0
    memory_tokens: int = 0  # tokens in the model-free drafter's memory of ended requests
    phase_seconds: dict = field(default_factory=dict)
    phase_share: dict = field(default_factory=dict)  # of the wall clock; sums to 1
    phase_ms_per_round: dict = field(default_factory=dict)
    # per-row decoder stats over batches and repeats (the counts behind α, over the same
    # rounds as the phase times: the goodput policy's K varies between repeats); not in JSON
    spec_stats: list[SpecStats] = field(default_factory=list, repr=False)
    speedup_vs_baseline: float | None = None
    # over transformers' assisted generation of the same kind and K: assistant_model for a
    # draft model, prompt lookup for the ngram drafter
    speedup_vs_hf_assisted: float | None = None
    # the engine the "ours" rows ran on (torch, onnx, tensorrt, llamacpp); torch for "hf",
    # llamacpp for llama.cpp's own programs
    backend: str = "torch"
    speedup_vs_torch: float | None = None  # this row's tok/s over the torch row's (same config)
    repeat_tokens_per_second: list[float] = field(default_factory=list)  # one per repeat
    repeat_decode_tokens_per_second: list[float] = field(default_factory=list)
    decode_tokens: int = 0  # this repeat's (as tokens, seconds)
    decode_seconds: float = 0.0
    fused_correction: str = "off"  # the decoder's fused_correction: on | off | auto
    fused_rounds: int = 0  # rounds verified and corrected in one engine call
    fused_fallback: dict = field(default_factory=dict)  # rounds run unfused, by reason

    @property
    def tokens_per_second(self) -> float:
        if self.repeat_tokens_per_second:
            return statistics.median(self.repeat_tokens_per_second)
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        d = self.__dict__.copy()
        del d["spec_stats"]
        d["tokens_per_second"] = self.tokens_per_second
        return d


def median_ratio(row: BenchRow, reference: BenchRow,
                 per_repeat: str = "repeat_tokens_per_second") -> float:
    """The median over repeats of row / reference tokens/s (``per_repeat``: the field with
    one figure per repeat), each ratio within one repeat."""
    return statistics.median(a / b for a, b in zip(
        getattr(row, per_repeat), getattr(reference, per_repeat), strict=True))


PHASES = ("draft", "verify", "correct", "prefill", "other")


def read_prompt_file(path: str | Path, model_dir: str | Path
                     ) -> tuple[list[list[int]], tuple[int, ...], list[Guide | None]]:
    """The token prompts of a JSONL file, one request per line: ``{"messages": [...]}``
    (through ``model_dir``'s chat template, ending in the assistant's turn) or
    ``{"prompt": "..."}`` (text, with the tokenizer's special tokens), optionally with
    OpenAI's ``"response_format"`` (``json_object``, or ``json_schema`` with its
    ``json_schema.schema``: the output follows it); the end-of-turn ids its chat requests
    stop at (none without one); and each request's guide (None: unconstrained). Blank lines
    are skipped; a bad line is refused naming its number and the field. ``humaneval[:N]``
    instead of a path: the first N HumanEval problems as chat requests (``humaneval.py``)."""
    tokenizer = load_tokenizer(model_dir)
    prompts, chat, guides = [], False, []
    count = humaneval.parse_spec(path)
    lines = (Path(path).read_text(encoding="utf-8").splitlines() if count is False else
             [json.dumps(humaneval.chat_request(p)) for p in humaneval.problems(count)])
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(request, dict) or len({"messages", "prompt"} & set(request)) != 1 or (
                set(request) - {"messages", "prompt", "response_format"}):
            fields = sorted(request) if isinstance(request, dict) else type(request).__name__
            raise ValueError(f"{where}: a request is an object with exactly one of "
                             f"'messages' and 'prompt' (and optionally 'response_format'); "
                             f"got {fields}")
        guides.append(format_guide(request.get("response_format"), where))
        if "prompt" in request:
            if not isinstance(request["prompt"], str) or not request["prompt"]:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            ids = tokenizer.encode(request["prompt"]).ids
        else:
            messages = request["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError(f"{where}: 'messages' must be a non-empty list")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or (
                        not isinstance(m.get("content"), str)):
                    raise ValueError(f"{where}: messages[{i}] must be an object with string "
                                     "'role' and 'content'")
            try:
                text = format_chat(model_dir, messages)
            except ValueError as e:
                raise ValueError(f"{where}: 'messages': {e}") from None
            # the template writes the special tokens itself
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            chat = True
        if not ids:
            raise ValueError(f"{where}: the request encodes to no tokens")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no requests (one JSON object per line)")
    return prompts, chat_stop_token_ids(model_dir) if chat else (), guides


def format_guide(response_format: object, where: str) -> Guide | None:
    """A prompt file line's ``response_format`` as a grammar guide (None: text); a
    ``json_schema`` must give its schema."""
    try:
        return response_format_guide(response_format, schema_required=True)
    except ValueError as e:
        raise ValueError(f"{where}: 'response_format' {str(e).removeprefix('response_format ')}"
                         ) from None


def matchers(guides: list[Guide | None], tokenizer_json: str, verifier: Transformer
             ) -> list[RowGrammar | None]:
    """A fresh matcher per constrained request (its guide compiled once: cached)."""
    vocab = verifier.config.vocab_size
    return [None if g is None else RowGrammar(compile_guide(g, tokenizer_json, vocab),
                                              tokenizer_json, vocab) for g in guides]


def leviathan_bound(alpha: float, k: float, c: float) -> float:
    """Leviathan et al.'s speed-up over plain decoding for i.i.d. acceptance ``alpha``, ``k``
    drafts per round and draft cost ``c`` per token (in plain decoding steps):
    (1 − α^(K+1)) / ((1 − α)(K·c + 1)); α = 1 is the limit (K+1)/(K·c + 1)."""
    if not 0.0 <= alpha <= 1.0 or k < 0 or c < 0:
        raise ValueError(f"need 0 <= alpha <= 1, k >= 0, c >= 0; got {alpha}, {k}, {c}")
    return analytic_length(alpha, k) / (k * c + 1.0)


def alpha_from_mean_accepted(mean_accepted: float, k: float) -> float:
    """The i.i.d. α whose expected accepted drafts per round, Σ_{i=1..K} α^i =
    (α − α^(K+1)) / (1 − α), equal ``mean_accepted`` (bisection: the sum grows with α)."""
    if k <= 0 or mean_accepted <= 0.0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # 2^-60: below float resolution near α
        mid = (lo + hi) / 2
        if analytic_length(mid, k) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def run_ours(verifier: Transformer, drafter: AnyDrafter | None, params: RuleParams, k: int,
             prompts: list[list[int]], max_new_tokens: int, batch_size: int, seed: int,
             row: BenchRow, token_ids: list[list[int]] | None = None,
             eos_token_id: EosIds = None, guides: list[Guide | None] | None = None,
             tokenizer_json: str | None = None) -> BenchRow:
    """Decode ``prompts`` in batches into ``row``'s counts; ``token_ids``: a list to extend
    with each prompt's generated tokens (to compare outputs across variants). The phase
    times add to ``row``'s (over batches and repeats). ``eos_token_id``: where requests stop
    (None: each decodes ``max_new_tokens``). ``guides``: each prompt's grammar (None:
    unconstrained), over ``tokenizer_json``; a request's fresh matcher is made before its
    batch's clock starts, as a server makes it off the decode loop."""
    dec = SpeculativeDecoder(verifier, drafter, params, k=k, max_batch_size=batch_size,
                             max_seq_len=max(map(len, prompts)) + max_new_tokens,
                             acceptance_floor=0.0,
                             draft_len_schedule="auto" if row.schedule == "auto" else None,
                             fused_correction=row.fused_correction)
    dec.generate(prompts[:batch_size], 4, seed=seed)  # warm-up (and "auto"'s calibration)
    dec.clear_memory()  # the warm-up's answers would leak into the first prompts' drafts
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i: i + batch_size]
        row_stats: list[SpecStats] = []
        out: list[list[int]] = [[] for _ in batch]
        rounds, prefill = -1, 0.0  # the first yield is the prefill's token
        grammars = None if guides is None else matchers(guides[i: i + batch_size],
                                                         tokenizer_json, verifier)
        t0 = time.perf_counter()
        for new in dec.stream(batch, max_new_tokens, seed=seed, eos_token_id=eos_token_id,
                              stats=row_stats, grammars=grammars):
            if rounds < 0:
                prefill = time.perf_counter() - t0
            rounds += 1
            for tokens, gained in zip(out, new, strict=True):
                tokens.extend(gained)
        wall = time.perf_counter() - t0
        row.spec_stats += row_stats
        fused = dec.fused_stats()  # since this batch's reset
        row.fused_rounds += fused["fused_rounds"]
        for why, n in fused["fused_fallback"].items():
            row.fused_fallback[why] = row.fused_fallback.get(why, 0) + n
        if token_ids is not None:
            token_ids += out
        # every round adds its phase times to each running row, so the row that ran longest
        # holds the batch's totals (aggregate() takes row 0's, short when row 0 ends early)
        last = max(row_stats, key=lambda s: s.draft_time + s.verify_time + s.correct_time)
        phases = {"draft": last.draft_time, "verify": last.verify_time,
                  "correct": last.correct_time, "prefill": prefill}
        phases["other"] = wall - sum(phases.values())
        for name, seconds in phases.items():
            row.phase_seconds[name] = row.phase_seconds.get(name, 0.0) + seconds
        row.rounds += rounds
        row.tokens += sum(s.generated_tokens for s in row_stats)
        row.seconds += wall
        row.decode_tokens += sum(s.generated_tokens for s in row_stats) - len(batch)
        row.decode_seconds += wall - prefill
    total = aggregate(row.spec_stats)
    if drafter is not None:
        row.acceptance_rate = total.acceptance_rate
        row.mean_acceptance_length = total.mean_acceptance_length
        steps = max(total.verify_steps, 1)
        row.mean_k = total.draft_tokens / steps
        row.alpha = alpha_from_mean_accepted(total.accepted_tokens / steps, row.mean_k)
        # per reached position: each step ends in one rejection or K accepts
        reached = total.accepted_tokens + total.rollbacks
        row.alpha_per_position = total.accepted_tokens / reached if reached else 1.0
        if row.schedule == "fixed":  # the analytic length assumes one K for every round
            row.analytic_acceptance_length = analytic_length(row.alpha_per_position, k)
        row.per_position_acceptance = total.per_position_acceptance
    row.occupancy = total.verify_steps / max(row.rounds * batch_size, 1)
    row.memory_tokens = dec.memory_tokens  # the lookup's memory of ended requests, at the end
    return row


def phase_breakdown(row: BenchRow) -> None:
    """Shares of the wall clock and milliseconds per round, from the summed phase times."""
    wall = sum(row.phase_seconds.values())
    row.phase_share = {p: row.phase_seconds[p] / wall if wall else 0.0 for p in PHASES}
    row.phase_ms_per_round = {p: 1e3 * row.phase_seconds[p] / max(row.rounds, 1)
                              for p in PHASES}


def step_seconds(row: BenchRow) -> float:
    """Seconds per round outside the prefill (for the baseline: one plain decoding step)."""
    seconds = sum(row.phase_seconds[p] for p in PHASES if p != "prefill")
    return seconds / max(row.rounds, 1)


def distance_to_bound(row: BenchRow, base: BenchRow) -> None:
    """``row``'s cost ratio, Leviathan bound and efficiency against its plain ``base`` (same
    batch size and sampling). The bound is relative to plain decoding, so the unit of cost is
    the baseline's step, Python around it included: c = (draft seconds per round / K) / (plain
    seconds per step). The draft phase opens with the round's setup, which a plain step has
    too (its own draft phase): that part is in the unit already, so c counts the rest. K is
    the mean K the rounds drafted (the fixed K, or the policy's mean). The bound counts
    decoding rounds, so efficiency sets the decode-phase speed-up against it
    (``decode_speedup``: the prefill out of both runs, as it is out of c)."""
    if row.alpha is None or not row.mean_k or not row.rounds or not base.rounds:
        return
    plain = step_seconds(base)
    drafting = max(row.phase_seconds["draft"] / row.rounds
                   - base.phase_seconds["draft"] / base.rounds, 0.0)
    row.cost_ratio = drafting / row.mean_k / plain
    row.verify_vs_plain_step = row.phase_seconds["verify"] / row.rounds / plain
    row.bound = leviathan_bound(row.alpha, row.mean_k, row.cost_ratio)
    row.efficiency = row.decode_speedup / row.bound
    row.efficiency_end_to_end = row.speedup_vs_baseline / row.bound
    # the same bound with a round costing K·c + v plain steps instead of K·c + 1
    row.bound_at_verify_cost = row.bound * (row.mean_k * row.cost_ratio + 1.0) / (
        row.mean_k * row.cost_ratio + row.verify_vs_plain_step)
    row.loop_efficiency = row.decode_speedup / row.bound_at_verify_cost


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[Tensor, Tensor]:
    """transformers' batch of ``prompts``: ids and attention mask, left-padded to the
    longest (decoder-only models generate from the right end)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generated_count(new: Tensor, eos: frozenset[int]) -> int:
    """Tokens a row of transformers' output generated: up to and including its first end id
    (rows that ended early are padded after it)."""
    tokens = new.tolist()
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


@torch.no_grad()
def run_hf(hf_verifier, hf_draft, prompts: list[list[int]], max_new_tokens: int,
           batch_size: int, k: int, row: BenchRow, lookup_ngram: int | None = None,
           eos_token_id: EosIds = None) -> BenchRow:
    """transformers generate (greedy), assisted generation with ``hf_draft``, or prompt
    lookup with n-grams up to ``lookup_ngram`` (both batch 1 only in transformers).
    ``eos_token_id``: where requests stop (None: each decodes ``max_new_tokens``)."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    eos = frozenset() if eos_token_id is None else frozenset(
        [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    if eos:
        kwargs.update(eos_token_id=sorted(eos))
    else:
        kwargs.update(min_new_tokens=max_new_tokens)
    if hf_draft is not None:
        kwargs.update(assistant_model=hf_draft, num_assistant_tokens=k,
                      num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
    if lookup_ngram is not None:
        kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=lookup_ngram)
    ids, mask = left_padded(prompts[:batch_size])
    hf_verifier.generate(ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 4,
                                                      "min_new_tokens": 0})
    for i in range(0, len(prompts), batch_size):
        ids, mask = left_padded(prompts[i: i + batch_size])
        t0 = time.perf_counter()
        out = hf_verifier.generate(ids, attention_mask=mask, **kwargs)
        row.seconds += time.perf_counter() - t0
        row.tokens += sum(generated_count(new, eos) for new in out[:, ids.shape[1]:])
    return row


def plan(batch_sizes: list[int], ks: list[int], drafters: list[str], with_hf: bool,
         fused_modes: tuple[str, ...] = ("off",), sampling_rows: bool = True
         ) -> list[BenchRow]:
    """The variants: a full K sweep at the first batch size (greedy), K <= 4 at the others,
    K=4 for sampling with every sampling rule (exact and the lossy ones, their default
    parameters); per drafter also the goodput policy (K chosen per round, up to 4; not for
    the ngram drafter, which drafts only where it matches). Our rows run with
    ``fused_modes[0]``; those at K = 0 and K=4 (fixed) once more per other mode.
    ``sampling_rows`` False: greedy rows only."""
    rows: list[BenchRow] = []
    k_default = 4 if 4 in ks else ks[len(ks) // 2]
    for bs in batch_sizes:
        for sampling in (False, True):
            if sampling and (bs != batch_sizes[0] or not sampling_rows):
                continue
            rule = "exact" if sampling else "greedy"
            rows.append(BenchRow("ours", "baseline", rule, 0, bs, sampling))
            sweep = (ks if bs == batch_sizes[0] else [k for k in ks if k <= k_default]
                     ) if not sampling else [k_default]
            rows += [BenchRow("ours", d, rule, k, bs, sampling) for d in drafters for k in sweep]
            if sampling:  # the lossy rules, against the same exact-sampling baseline
                rows += [BenchRow("ours", d, lossy, k_default, bs, True) for d in drafters
                         for lossy in RULES if lossy not in ("exact", "greedy")]
            if not sampling:
                rows += [BenchRow("ours", d, rule, k_default, bs, sampling, schedule="auto")
                         for d in drafters if d not in MODEL_FREE_DRAFTERS]
            if with_hf and not sampling:
                rows.append(BenchRow("hf", "generate", "greedy", 0, bs, False))
                if bs == 1 and "model" in drafters:
                    rows += [BenchRow("hf", "assisted", "greedy", k, 1, False) for k in sweep]
                if bs == 1 and "ngram" in drafters:
                    rows += [BenchRow("hf", "prompt_lookup", "greedy", k, 1, False)
                             for k in sweep]
    # each twin runs right after its row: their per-repeat ratio sees the same machine
    out = []
    for r in rows:
        r.fused_correction = fused_modes[0]
        out.append(r)
        if r.system == "ours" and r.schedule == "fixed" and r.k in (0, k_default):
            out += [BenchRow(r.system, r.variant, r.rule, r.k, r.batch_size, r.sampling,
                             fused_correction=mode) for mode in fused_modes[1:]]
    return out


def run_bench(verifier: Transformer, drafters: dict[str, AnyDrafter], prompts: list[list[int]],
              max_new_tokens: int, batch_sizes: list[int], ks: list[int],
              hf_dirs: tuple[str, str] | None, seed: int = 0, temperature: float = 1.0,
              repeats: int = 1, fused_modes: tuple[str, ...] = ("off",),
              eos_token_id: EosIds = None, sampling_rows: bool = True, peer=None,
              guides: list[Guide | None] | None = None, tokenizer_json: str | None = None
              ) -> list[BenchRow]:
    """``eos_token_id``: where every variant's requests stop (None: each decodes
    ``max_new_tokens``, so all variants decode the same number of tokens; with end ids
    greedy variants still do, as they emit the same tokens). ``peer``: a
    ``peer_openvino.OpenVinoPeer`` or ``peer_llamacpp.LlamaCppPeer``, whose rows join the
    plan (interleaved with ours). ``guides``: per prompt, the grammar its output follows
    (None: unconstrained; ``tokenizer_json`` is then the tokenizer's file): every variant of
    ours follows them, and llama.cpp's programs too (``--json-schema``); transformers' peers
    cannot, so they are refused."""
    if guides is not None and hf_dirs is not None:
        raise ValueError("response_format: the transformers peers cannot follow a prompt "
                         "file's grammars; run with --no-hf")
    if guides is not None and peer is not None and not hasattr(peer, "draft"):
        raise ValueError("response_format: the OpenVINO peer cannot follow a prompt file's "
                         "grammars")
    hf_verifier = hf_draft = None
    if hf_dirs is not None:
        from transformers import AutoModelForCausalLM

        hf_verifier = AutoModelForCausalLM.from_pretrained(hf_dirs[0], dtype=torch.float32)
        hf_verifier.eval()
        if "model" in drafters:  # the assisted peer's draft
            hf_draft = AutoModelForCausalLM.from_pretrained(hf_dirs[1], dtype=torch.float32)
            hf_draft.eval()
    lookup = drafters.get("ngram")
    rows = plan(batch_sizes, ks, list(drafters), hf_verifier is not None, fused_modes,
                sampling_rows)
    if peer is not None:
        rows += peer.plan(batch_sizes, ks)
    progress = tqdm(total=len(rows) * repeats, desc="bench", unit="variant")
    for _ in range(repeats):
        for row in rows:
            # per repeat (the phase times add up)
            row.tokens, row.seconds, row.decode_tokens, row.decode_seconds = 0, 0.0, 0, 0.0
            n = max(len(prompts) // row.batch_size, 1) * row.batch_size
            batch_prompts = (prompts * row.batch_size)[:n]
            batch_guides = None if guides is None else (guides * row.batch_size)[:n]
            if row.system == "hf":
                draft = hf_draft if row.variant == "assisted" else None
                ngram = lookup.ngram_max if row.variant == "prompt_lookup" else None
                run_hf(hf_verifier, draft, batch_prompts, max_new_tokens, row.batch_size,
                       row.k, row, ngram, eos_token_id)
            elif row.system in ("openvino", "llamacpp"):
                peer.run(row, batch_prompts, max_new_tokens, eos_token_id,
                         **({} if guides is None else {"guides": batch_guides}))
            else:
                params = RuleParams(row.rule, temperature=temperature)
                run_ours(verifier, drafters.get(row.variant), params, row.k, batch_prompts,
                         max_new_tokens, row.batch_size, seed, row, eos_token_id=eos_token_id,
                         guides=batch_guides, tokenizer_json=tokenizer_json)
            row.repeat_tokens_per_second.append(row.tokens / row.seconds if row.seconds
                                                else 0.0)
            if row.system in ("ours", "llamacpp"):  # those that time their prefill apart
                row.repeat_decode_tokens_per_second.append(
                    row.decode_tokens / row.decode_seconds if row.decode_seconds else 0.0)
            progress.update()
    progress.close()
    # ratios within this run (against the baseline of the same fused mode; the peers against
    # the first mode's)
    for row in rows:
        mode = row.fused_correction if row.system == "ours" else fused_modes[0]
        base = next(r for r in rows if r.system == "ours" and r.variant == "baseline"
                    and r.batch_size == row.batch_size and r.sampling == row.sampling
                    and r.fused_correction == mode)
        row.speedup_vs_baseline = median_ratio(row, base)
        if row.system == "ours":
            row.decode_speedup = median_ratio(row, base, "repeat_decode_tokens_per_second")
            phase_breakdown(row)
            distance_to_bound(row, base)
    compare_hf(rows)
    return rows


def compare_hf(rows: list[BenchRow]) -> None:
    """Each greedy fixed-K row over transformers' assisted generation of the same kind at the
    same K and batch size: prompt lookup for the ngram drafter, ``assistant_model`` for the
    others (the peers run once, with the first backend; every backend is compared to them)."""
    peers = {(r.variant, r.k, r.batch_size): r for r in rows
             if r.variant in ("assisted", "prompt_lookup")}
    for row in rows:
        kind = "prompt_lookup" if row.variant == "ngram" else "assisted"
        peer = peers.get((kind, row.k, row.batch_size))
        if peer and row.system == "ours" and not row.sampling and row.schedule == "fixed":
            row.speedup_vs_hf_assisted = median_ratio(row, peer)


def compare_backends(rows: list[BenchRow], reference: str = "torch") -> dict:
    """Set ``speedup_vs_torch`` on the ours-rows of every other backend (same variant, rule,
    K, batch size) and return {backend: {batch_B: {config: ratio, "geomean": g}}}."""
    ref = {(r.variant, r.rule, r.k, r.batch_size, r.schedule): r for r in rows
           if r.backend == reference and r.system == "ours"}
    out: dict = {}
    for r in rows:
        base = ref.get((r.variant, r.rule, r.k, r.batch_size, r.schedule))
        if r.backend == reference or r.system != "ours" or base is None:
            continue
        r.speedup_vs_torch = r.tokens_per_second / base.tokens_per_second
        per_batch = out.setdefault(r.backend, {}).setdefault(f"batch_{r.batch_size}", {})
        per_batch[config_label(r)] = r.speedup_vs_torch
    for per_batch in out.values():
        for ratios in per_batch.values():
            spec = [v for k, v in ratios.items() if not k.startswith("baseline")]
            if spec:
                ratios["geomean_speculative"] = math.prod(spec) ** (1 / len(spec))
    return out


def k_label(row: BenchRow) -> str:
    return f"K={row.k}" if row.schedule == "fixed" else f"K=auto<={row.k}"


def fused_label(row: BenchRow) -> str:
    return f" fused={row.fused_correction}" if row.fused_correction != "off" else ""


def config_label(row: BenchRow) -> str:
    return f"{row.variant} {row.rule} {k_label(row)}{fused_label(row)}"


def fused_comparison(rows: list[BenchRow]) -> dict:
    """Rows run with several fused_correction modes, side by side: {backend: {batch_B:
    {config: {mode: tok/s, ..., "<mode>_over_<first mode>": median ratio}}}}, with the
    rounds that fell back to the unfused path, by reason, where any did."""
    out: dict = {}
    groups: dict = {}
    for r in rows:
        if r.system == "ours":
            key = (r.backend, r.batch_size, r.variant, r.rule, r.k, r.schedule)
            groups.setdefault(key, []).append(r)
    for (backend, bs, *_), group in groups.items():
        if len(group) < 2:
            continue
        first = group[0]
        cell = {r.fused_correction: r.tokens_per_second for r in group}
        for r in group[1:]:
            cell[f"{r.fused_correction}_over_{first.fused_correction}"] = median_ratio(r, first)
        fallback = {r.fused_correction: r.fused_fallback for r in group if r.fused_fallback}
        if fallback:
            cell["fused_fallback"] = fallback
        label = f"{first.variant} {first.rule} {k_label(first)}"
        out.setdefault(backend, {}).setdefault(f"batch_{bs}", {})[label] = cell
    return out


def summary(rows: list[BenchRow]) -> dict:
    """Best speculative config per batch size (greedy) and how it compares: for the first
    backend at the top level, and per backend under "backends" when there are several."""
    backends = list(dict.fromkeys(r.backend for r in rows if r.system == "ours"))
    out = best_configs([r for r in rows if r.backend == backends[0]])
    if len(backends) > 1:
        out["backends"] = {b: best_configs([r for r in rows if r.backend == b])
                           for b in backends}
    fused = fused_comparison(rows)
    if fused:
        out["fused_correction"] = fused
    return out


def best_configs(rows: list[BenchRow]) -> dict:
    out = {}
    for bs in sorted({r.batch_size for r in rows}):
        spec = [r for r in rows if r.system == "ours" and r.variant != "baseline"
                and r.batch_size == bs and not r.sampling]
        if not spec:
            continue
        best = max(spec, key=lambda r: r.speedup_vs_baseline)  # the median ratio with repeats
        # the best fixed-K config that has a transformers peer at its K
        peered = [r for r in spec if r.speedup_vs_hf_assisted is not None]
        best_vs_hf = max(peered, key=lambda r: r.speedup_vs_hf_assisted, default=None)
        out[f"batch_{bs}"] = {
            "best": f"{best.variant} {k_label(best)}{fused_label(best)}",
            "mean_k": best.mean_k,
            "speedup_vs_baseline": best.speedup_vs_baseline,
            "speedup_vs_hf_assisted_same_k": best.speedup_vs_hf_assisted,
            "acceptance_rate": best.acceptance_rate,
            "mean_acceptance_length": best.mean_acceptance_length,
            "alpha": best.alpha,
            "bound": best.bound,
            "decode_speedup": best.decode_speedup,
            "efficiency": best.efficiency,
        }
        if best_vs_hf is not None:
            out[f"batch_{bs}"]["best_vs_hf_assisted"] = {
                "config": f"{best_vs_hf.variant} {k_label(best_vs_hf)}",
                "speedup_vs_hf_assisted_same_k": best_vs_hf.speedup_vs_hf_assisted,
                "speedup_vs_baseline": best_vs_hf.speedup_vs_baseline}
    return out


def fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def row_label(r: BenchRow) -> str:
    k = str(r.k) if r.schedule == "fixed" else f"auto{r.k}"
    fused = r.fused_correction if r.system == "ours" else "-"
    return (f"{r.system:4s} {r.backend:7s} {r.variant:9s} {r.rule:9s} {k:>6s} {r.batch_size:3d} "
            f"{fused:>5s}")


def print_rows(rows: list[BenchRow]) -> None:
    """Two tables with the same rows: speed and the distance to Leviathan's bound, then
    where a round's time goes (ms per round, and the share of the wall clock). ``fused``:
    the decoder's fused_correction mode."""
    head = (f"{'sys':4s} {'backend':7s} {'variant':9s} {'rule':9s} {'K':>6s} {'B':>3s} "
            f"{'fused':>5s}")
    print(f"{head} {'tok/s':>8s} {'vs base':>7s} {'decode':>6s} {'vs HF-asst':>10s} "
          f"{'accept':>6s} {'len':>5s} {'analytic':>8s} {'mean K':>6s} {'alpha':>5s} "
          f"{'c':>5s} {'bound':>6s} {'eff':>5s} {'loop':>5s}")
    for r in rows:
        print(f"{row_label(r)} {r.tokens_per_second:8.1f} "
              f"{fmt(r.speedup_vs_baseline, '6.2f'):>6s}x {fmt(r.decode_speedup, '5.2f'):>5s}x "
              f"{fmt(r.speedup_vs_hf_assisted, '9.2f'):>9s}x {fmt(r.acceptance_rate, '6.2f'):>6s} "
              f"{fmt(r.mean_acceptance_length, '5.2f'):>5s} "
              f"{fmt(r.analytic_acceptance_length, '8.2f'):>8s} {fmt(r.mean_k, '6.2f'):>6s} "
              f"{fmt(r.alpha, '5.2f'):>5s} {fmt(r.cost_ratio, '5.2f'):>5s} "
              f"{fmt(r.bound, '5.2f'):>5s}x {fmt(r.efficiency, '5.2f'):>5s} "
              f"{fmt(r.loop_efficiency, '5.2f'):>5s}")
    print("vs base: end to end; decode: the speed-up without the prefill (in neither run), "
          "which eff = decode / bound uses; loop: decode over the bound with the verify pass "
          "at its measured cost (verify/plain below)")
    print("\nwhere a round's time goes: ms per round (share of the wall clock); other = wall "
          "clock - the four; verify/plain: the verify pass over a plain step; rows: rows per "
          "round over the batch size")
    print(f"{head} {'ms/round':>8s} " + " ".join(f"{p:>12s}" for p in PHASES)
          + f" {'verify/plain':>12s} {'rows':>5s}")
    for r in rows:
        if r.system != "ours" or not r.rounds:
            continue
        cells = " ".join(f"{r.phase_ms_per_round[p]:6.2f} ({r.phase_share[p]:3.0%})"
                         for p in PHASES)
        print(f"{row_label(r)} {sum(r.phase_ms_per_round.values()):8.2f} {cells} "
              f"{fmt(r.verify_vs_plain_step, '12.2f'):>12s} {fmt(r.occupancy, '5.2f'):>5s}")


def write_outputs(rows: list[BenchRow], out_dir: Path, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "summary": summary(rows), "rows": [r.to_dict() for r in rows]}
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the first backend in its first fused mode, and the transformers peers (measured
    # against its baseline)
    first = rows[0]
    rows = [r for r in rows if r.system in ("hf", "openvino", "llamacpp") or (
        r.backend == first.backend and r.fused_correction == first.fused_correction)]
    bs0 = min(r.batch_size for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for variant in sorted({r.variant for r in rows if r.k and r.batch_size == bs0}):
        pts = sorted((r.k, r.speedup_vs_baseline) for r in rows if r.variant == variant
                     and r.batch_size == bs0 and not r.sampling and r.k
                     and r.schedule == "fixed")
        if pts:
            line, = ax1.plot(*zip(*pts, strict=True), marker="o",
                             label={"assisted": "HF assisted", "prompt_lookup": "HF prompt lookup"
                                    }.get(variant, variant))
            auto = [r for r in rows if r.variant == variant and r.batch_size == bs0
                    and r.schedule == "auto"]
            if auto:  # the goodput policy picks K per round: a level, not a point on the axis
                ax1.axhline(auto[0].speedup_vs_baseline, color=line.get_color(), ls="--",
                            lw=1, label=f"{variant} auto K (mean {auto[0].mean_k:.1f})")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set(xlabel="K (draft tokens per round)", ylabel="speed-up over our AR baseline",
            title=f"speed-up vs K (batch {bs0}, greedy)")
    ax1.legend()
    for variant in sorted({r.variant for r in rows if r.per_position_acceptance}):
        cands = [r for r in rows if r.variant == variant and r.batch_size == bs0
                 and not r.sampling and r.per_position_acceptance and r.schedule == "fixed"]
        r = max(cands, key=lambda r: r.k)
        ax2.plot(range(1, r.k + 1), r.per_position_acceptance, marker="o",
                 label=f"{variant} K={r.k}")
    ax2.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.02),
            title="per-position acceptance")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=110)
    plt.close(fig)
