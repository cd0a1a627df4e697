"""The correction rules as fused OpenAI Triton kernels, checked against ``correction.correct``.

``correct_fused`` has the signature, semantics and return values of ``correction.correct``
(rules, temperature, top-p, Randoms, bonus token, per-row num_drafted): for the same inputs
and random numbers it makes the same decisions, except where a comparison lands within
float rounding of its threshold (the kernels sum in tile order and torch in its own; on a GPU
``tl.exp`` is approximate and multiply-adds may be fused). Tokens that tie in probability at
the top-p edge are kept or dropped together by both.

What is fused (no [B, K+1, V] probabilities are materialised, no host sync):

- ``_accept_kernel``, one program per (row, draft position): one pass over the vocabulary in
  BLOCK_V tiles with an online max / Σ exp / Σ exp·x (softmax normaliser and entropy), or
  the argmax, or the best alternative — what the rule needs — and writes whether the draft
  token passes the rule on its own.
- ``_sample_kernel``, one program per row: the prefix scan across K (num_drafted per row),
  then at the stop position one pass for the normaliser and one exponential race
  argmax(p / E) over the temperature + top-p target distribution; for ``exact`` after a
  rejection the race runs over the residual max(p − q, 0) in the same pass (its mass is
  summed alongside, so the p fallback costs nothing). num_accepted never leaves the device.
- ``_row_kernel``: the same rules in one launch, one program per row (positions in order,
  none scored after the first rejection) that also writes the accepted block. The TensorRT
  plugin compiles this one ahead of time (one kernel per plugin; ``compile_row_kernel``);
  ``correct_block_fused`` launches it from torch.

Top-p < 1 is fused too, without a sort, with the nucleus of ``correction.top_p_floor`` (a
token is in iff the strictly more probable tokens hold < top_p; equal probabilities are all in
or all out): its least probable member is found by a 30-step bisection on the bit pattern of
the unnormalised probabilities exp(y − m), which as non-negative floats order like their bits
(each step one pass summing the mass above), where it is needed: exact's draft positions,
dynamic with top_p_membership, and the stop position of every sampling rule. That is 30 extra
passes over those rows. Not fused: ``.contiguous()`` copies of inputs that are not contiguous,
output allocation.

triton is optional (a dev dependency): this module imports without it, and the kernels are
jitted on first use, so TRITON_INTERPRET=1 (the CPU interpreter the tests use) only has to be
set before the first call.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..correction import Randoms, RuleParams, check_randoms, correct
from .engine_io import correction_inputs

tl: Any = None  # triton.language, bound by _kernels() on first use (triton is optional)
MAX_BLOCK_V = 1024


# -- device helpers (plain functions, jitted by _kernels) ----------------------------------


def _tile(row, start, V, BLOCK_V: tl.constexpr):
    """Offsets, in-range mask and float32 logits of one vocabulary tile (−inf past V)."""
    offs = start + tl.arange(0, BLOCK_V)
    valid = offs < V
    x = tl.load(row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    return offs, valid, x


def _bits(e):
    """The int32 bit pattern of float32 values >= 0, which orders like the values: bisecting
    on it ends on adjacent floats after 30 steps, whatever the scale of the logits."""
    return e.to(tl.int32, bitcast=True)


def _fold_argmax(best, idx, score, start):
    """Fold one tile into a running argmax; the first index wins ties (torch.argmax)."""
    tile_best, tile_idx = tl.max(score, 0, return_indices=True)
    better = tile_best > best
    return tl.where(better, tile_best, best), tl.where(better, tile_idx.to(tl.int64) + start, idx)


def _argmax(row, V, BLOCK_V: tl.constexpr):
    best = tl.full([], float("-inf"), tl.float32)
    idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        _, _, x = _tile(row, start, V, BLOCK_V)
        best, idx = _fold_argmax(best, idx, x, start)
    return idx


def _max_except(row, V, d, BLOCK_V: tl.constexpr):
    """max over j != d of x_j: the ratio rule's best alternative to the draft token."""
    best = tl.full([], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs, _, x = _tile(row, start, V, BLOCK_V)
        best = tl.maximum(best, tl.max(tl.where(offs == d, float("-inf"), x), 0))
    return best


def _softmax_stats(row, V, temperature, BLOCK_V: tl.constexpr):
    """One online pass over y = x / temperature: m = max y, s = Σ exp(y − m) and
    t = Σ exp(y − m)·y, so log-sum-exp = m + log s and the entropy = m + log s − t / s."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    t = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        _, _, x = _tile(row, start, V, BLOCK_V)
        y = x / temperature
        m_new = tl.maximum(m, tl.max(y, 0))
        scale = tl.exp(m - m_new)  # 0 on the first tile (m = −inf)
        e = tl.exp(y - m_new)
        s = s * scale + tl.sum(e, 0)
        t = t * scale + tl.sum(e * tl.where(e > 0, y, 0.0), 0)  # not 0·(−inf) = NaN
        m = m_new
    return m, s, t


def _nucleus(row, V, temperature, m, s, top_p, BLOCK_V: tl.constexpr):
    """Top-p without a sort (correction.top_p_floor): a token is in the nucleus iff the
    tokens more probable than it hold < top_p of the mass. That mass only grows as the
    probability e = exp(y − m) falls, so bisect for the largest bit pattern ``floor`` whose
    mass above still reaches top_p: the nucleus is _bits(e) > floor. Returns (floor, the
    nucleus mass Σ e)."""
    lo = tl.full([], -1, tl.int32)  # below every pattern: mass above = everything >= top_p
    hi = tl.full([], 0x3F800000, tl.int32)  # 1.0, the top token's e: mass above 0 < top_p
    kept = s
    for _step in range(30):  # hi - lo < 2^30: they end adjacent
        mid = lo + (hi - lo) // 2
        above = tl.full([], 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            _, _, x = _tile(row, start, V, BLOCK_V)
            e = tl.exp(x / temperature - m)
            above += tl.sum(tl.where(_bits(e) > mid, e, 0.0), 0)
        inside = above < top_p * s  # every token above mid is in the nucleus
        hi = tl.where(inside, mid, hi)
        lo = tl.where(inside, lo, mid)
        kept = tl.where(inside, kept, above)
    return lo, kept


def _passes_rule(row, V, d, q_d, u, temperature, top_p, tau, log_gamma, alpha, epsilon, delta,
                 RULE: tl.constexpr, NUCLEUS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Whether draft token d passes the rule at one position (correction.acceptance_mask)."""
    x_d = tl.load(row + d).to(tl.float32)
    if RULE == "greedy":
        ok = _argmax(row, V, BLOCK_V) == d
    elif RULE == "ratio":
        ok = x_d - _max_except(row, V, d, BLOCK_V) >= log_gamma
    elif RULE == "exact":  # the temperature + top-p distribution: u·q < p
        m, s, _ = _softmax_stats(row, V, temperature, BLOCK_V)
        y_d = x_d / temperature
        e_d = tl.exp(y_d - m)
        kept = s
        if NUCLEUS:
            floor, kept = _nucleus(row, V, temperature, m, s, top_p, BLOCK_V)
            e_d = tl.where(_bits(e_d) > floor, e_d, 0.0)
        ok = u * q_d < e_d / kept
    else:  # the heuristic rules test the plain softmax
        m, s, t = _softmax_stats(row, V, 1.0, BLOCK_V)
        lse = m + tl.log(s)
        p_d = tl.exp(x_d - lse)
        h = lse - t / s
        if RULE == "threshold":
            ok = p_d > tau
        elif RULE == "dynamic":
            ok = p_d > tau * (1.0 + alpha * h)
            if NUCLEUS:  # top_p_membership
                floor, _ = _nucleus(row, V, 1.0, m, s, top_p, BLOCK_V)
                ok = ok & (_bits(tl.exp(x_d - m)) > floor)
        else:  # typical
            ok = p_d > tl.minimum(delta * tl.exp(-h), epsilon)
    return ok


def _next_token(row, V, noise_row, noise_width, q_row, d_stop, rejected, has_q, temperature,
                top_p, RULE: tl.constexpr, NUCLEUS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The token after the accepted prefix, from the stop position ``row``: greedy takes the
    argmax; the others race argmax(p / E) over p = softmax(x / T) cut to top-p, or for exact
    after a rejection over the residual max(p − q, 0) (p where that has no mass). q is the
    draft's distribution at the stop, or one-hot on the draft token d_stop (has_q false).
    noise_width is V, or 0 where no noise came (only the row kernel allows it, and overwrites
    the token with -1 then): nothing past it is read."""
    if RULE == "greedy":
        tok = _argmax(row, V, BLOCK_V)
    else:
        m, s, _ = _softmax_stats(row, V, temperature, BLOCK_V)
        floor = tl.full([], -1, tl.int32)  # the whole vocabulary
        kept = s
        if NUCLEUS:
            floor, kept = _nucleus(row, V, temperature, m, s, top_p, BLOCK_V)
        best_p = tl.full([], -1.0, tl.float32)
        best_r = tl.full([], -1.0, tl.float32)
        tok_p = tl.full([], 0, tl.int64)
        tok_r = tl.full([], 0, tl.int64)
        r_mass = tl.full([], 0.0, tl.float32)
        # scalar conditions folded into bounds: q is read only after a rejection, and only
        # where the draft sent its distribution (else one-hot on d_stop; −1 matches nothing)
        q_end = tl.where(rejected & has_q, V, 0)
        one_hot = tl.where(rejected & ~has_q, d_stop, -1)
        for start in range(0, V, BLOCK_V):
            offs, valid, x = _tile(row, start, V, BLOCK_V)
            y = x / temperature
            e = tl.exp(y - m)
            p = tl.where(_bits(e) > floor, e, 0.0) / kept
            noise = tl.load(noise_row + offs, mask=offs < noise_width, other=1.0)
            best_p, tok_p = _fold_argmax(best_p, tok_p, tl.where(valid, p / noise, -1.0), start)
            if RULE == "exact":
                q = tl.load(q_row + offs, mask=offs < q_end, other=0.0)
                q = tl.where(offs == one_hot, 1.0, q)
                r = tl.maximum(p - q, 0.0)
                r_mass += tl.sum(r, 0)
                best_r, tok_r = _fold_argmax(best_r, tok_r, tl.where(valid, r / noise, -1.0),
                                             start)
        tok = tok_p
        if RULE == "exact":
            tok = tl.where(rejected & (r_mass > 0), tok_r, tok_p)
    return tok


# -- kernels --------------------------------------------------------------------------------


def _accept_kernel(logits, drafts, q_probs, uniforms, accept, T, K, V, has_q,
                   temperature, top_p, tau, log_gamma, alpha, epsilon, delta,
                   RULE: tl.constexpr, NUCLEUS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (b, i): does draft token i of row b pass the rule on its own? -> accept[b, i]."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    d = tl.load(drafts + b * K + i)
    q_d = tl.load(q_probs + (b * K + i) * V + d, mask=has_q != 0, other=1.0)
    u = 0.0
    if RULE == "exact":
        u = tl.load(uniforms + b * K + i)
    ok = _passes_rule(logits + (b * T + i) * V, V, d, q_d, u, temperature, top_p, tau,
                      log_gamma, alpha, epsilon, delta, RULE, NUCLEUS, BLOCK_V)
    tl.store(accept + b * K + i, ok.to(tl.int32))


def _sample_kernel(logits, drafts, q_probs, noise, accept, num_drafted, num_accepted, next_token,
                   T, K, V, has_q, has_nd, temperature, top_p,
                   RULE: tl.constexpr, NUCLEUS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program b: the prefix scan of accept[b] (stopping at num_drafted[b]), then the next
    token from the stop position -> num_accepted[b], next_token[b]."""
    b = tl.program_id(0).to(tl.int64)
    limit = tl.load(num_drafted + b, mask=has_nd != 0, other=K).to(tl.int32)
    n = tl.full([], 0, tl.int32)
    alive = tl.full([], 1, tl.int32)
    for i in range(0, K):
        alive = alive * tl.load(accept + b * K + i) * (i < limit).to(tl.int32)
        n += alive
    tl.store(num_accepted + b, n.to(tl.int64))
    stop = tl.minimum(n, K - 1)  # the position whose draft was rejected
    rejected = (n < limit) & (K > 0)  # rows past their drafts take the bonus token
    d_stop = tl.load(drafts + b * K + stop, mask=rejected, other=-1)
    tok = _next_token(logits + (b * T + n) * V, V, noise + b * V, V,
                      q_probs + (b * K + stop) * V, d_stop, rejected, has_q != 0, temperature,
                      top_p, RULE, NUCLEUS, BLOCK_V)
    tl.store(next_token + b, tok)


def _row_kernel(logits, drafts, q_probs, uniforms, noise, num_drafted,
                T, K, V, q_width, nd_len, noise_width,
                num_accepted, next_token, accepted_tokens,
                temperature, top_p, tau, log_gamma, alpha, epsilon, delta,
                RULE: tl.constexpr, NUCLEUS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program b: the whole correction of row b in one launch, argument order as TensorRT AOT
    launches it (input pointers, int32 scalars, output pointers; the rule's scalars are
    compile-time constants there). Empty optional inputs (width 0) stand for None as in the
    ONNX op; a sampling rule without random numbers writes -1, the op's failure value."""
    b = tl.program_id(0).to(tl.int64)
    has_q = q_width > 0
    limit = tl.load(num_drafted + b, mask=nd_len > 0, other=K).to(tl.int32)
    missing = noise_width == 0
    if RULE == "greedy":
        missing = noise_width < 0  # draws nothing: never missing
    n = tl.full([], 0, tl.int32)
    alive = tl.full([], 1, tl.int32)
    for i in range(0, K):
        ok = tl.full([], 0, tl.int32)
        if (alive != 0) & (i < limit):  # nothing after the first rejection is scored
            d = tl.load(drafts + b * K + i)
            q_d = tl.load(q_probs + (b * K + i) * V + d, mask=has_q, other=1.0)
            u = 0.0
            if RULE == "exact":  # the only rule that reads them (absent for greedy)
                u = tl.load(uniforms + b * K + i, mask=~missing, other=0.0)
            ok = _passes_rule(logits + (b * T + i) * V, V, d, q_d, u, temperature, top_p, tau,
                              log_gamma, alpha, epsilon, delta, RULE, NUCLEUS,
                              BLOCK_V).to(tl.int32)
        alive = ok
        n += ok
    stop = tl.minimum(n, K - 1)
    rejected = (n < limit) & (K > 0)
    d_stop = tl.load(drafts + b * K + stop, mask=rejected, other=-1)
    tok = _next_token(logits + (b * T + n) * V, V, noise + b * noise_width, noise_width,
                      q_probs + (b * K + stop) * V, d_stop, rejected, has_q, temperature,
                      top_p, RULE, NUCLEUS, BLOCK_V)
    n = tl.where(missing, -1, n)
    tok = tl.where(missing, -1, tok)
    tl.store(num_accepted + b, n.to(tl.int64))
    tl.store(next_token + b, tok)
    # the block: accepted drafts, the rule's token at n, then -1 (engine_io.accepted_block)
    for j in range(0, K + 1):
        d_j = tl.load(drafts + b * K + j, mask=j < n, other=-1)
        tl.store(accepted_tokens + b * (K + 1) + j, tl.where(j == n, tok, d_j))


_JITTED = ("_tile", "_bits", "_fold_argmax", "_argmax", "_max_except", "_softmax_stats",
           "_nucleus", "_passes_rule", "_next_token", "_accept_kernel", "_sample_kernel",
           "_row_kernel")


@functools.cache
def _kernels() -> Any:
    """Import triton and jit the functions above, on first use: triton is optional, and
    triton.jit picks compiled or interpreted (TRITON_INTERPRET) when it decorates. The jitted
    functions replace the plain ones in this module's namespace because a kernel resolves the
    helpers it calls there."""
    try:
        import triton
        import triton.language
    except ImportError as e:
        raise ImportError("correct_fused needs the 'triton' package (OpenAI Triton; pip install "
                          "triton): it is a dev dependency, not a runtime one — without it use "
                          "correction.correct (correct_for picks it)") from e
    global tl
    tl = triton.language
    namespace = globals()
    for name in _JITTED:
        namespace[name] = triton.jit(namespace[name])
    return triton


# -- host side ------------------------------------------------------------------------------


def kernel_constants(params: RuleParams, block_v: int) -> dict[str, Any]:
    """The rule's scalars and compile-time switches, by kernel argument name: run-time
    arguments for correct_fused, constants baked into the TensorRT AOT kernel."""
    nucleus = params.top_p < 1.0 and (
        params.rule != "dynamic" or params.top_p_membership)
    return {"temperature": params.temperature, "top_p": params.top_p, "tau": params.tau,
            "log_gamma": math.log(params.gamma), "alpha": params.alpha,
            "epsilon": params.epsilon, "delta": params.delta,
            "RULE": params.rule, "NUCLEUS": nucleus, "BLOCK_V": block_v}


def row_kernel_signature(logits_type: str = "fp32") -> dict[str, str]:
    """Triton types of ``_row_kernel``'s run-time arguments in launch order (TensorRT AOT:
    input pointers, then the int32 scalars from ``row_kernel_scalars``, then outputs)."""
    return {"logits": f"*{logits_type}", "drafts": "*i64", "q_probs": "*fp32",
            "uniforms": "*fp32", "noise": "*fp32", "num_drafted": "*i64",
            "T": "i32", "K": "i32", "V": "i32", "q_width": "i32", "nd_len": "i32",
            "noise_width": "i32",
            "num_accepted": "*i64", "next_token": "*i64", "accepted_tokens": "*i64"}


def row_kernel_scalars(logits_shape, drafts_shape, probs_shape, noise_shape,
                       drafted_shape) -> list:
    """``_row_kernel``'s int32 arguments (T, K, V, q_width, nd_len, noise_width) from the
    input shapes: ints here, TensorRT shape expressions in the plugin."""
    return [logits_shape[1], drafts_shape[1], logits_shape[2], probs_shape[-1],
            drafted_shape[0], noise_shape[-1]]


def block_size(vocab: int) -> int:
    """The vocabulary tile: the power of two that covers V, at most MAX_BLOCK_V."""
    return min(MAX_BLOCK_V, 1 << max(vocab - 1, 0).bit_length())


def compile_row_kernel(params: RuleParams, logits_type: str = "fp32", block_v: int = MAX_BLOCK_V,
                       num_warps: int = 4, target: Any = None) -> Any:
    """``triton.compile`` the one-launch kernel for ``params`` (the TensorRT AOT plugin's
    kernel): target None is the current GPU. Needs compiled (not interpreted) triton."""
    triton = _kernels()
    src = triton.compiler.ASTSource(fn=_row_kernel, signature=row_kernel_signature(logits_type),
                                    constexprs=kernel_constants(params, block_v))
    return triton.compile(src, target=target, options={"num_warps": num_warps})


def correct_fused(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    params: RuleParams,
    randoms: Randoms | None,
    num_drafted: Tensor | None = None,
    *,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``correction.correct`` in two kernel launches: returns (num_accepted [B], next_token
    [B]) on the logits' device, with no host sync. The keyword-only block_v (a power of two)
    overrides the vocabulary tile (the tests use small ones to get several tiles)."""
    _kernels()
    check_randoms(params, randoms)
    B, K = draft_tokens.shape
    T, V = target_logits.shape[1:]
    dev = target_logits.device
    num_accepted = torch.empty(B, dtype=torch.long, device=dev)
    next_token = torch.empty(B, dtype=torch.long, device=dev)
    if B == 0:
        return num_accepted, next_token
    logits = target_logits.contiguous()
    drafts = draft_tokens.contiguous()
    # absent inputs go in empty: the kernels never read through those pointers
    nothing = torch.empty(0, device=dev)
    probs = nothing if draft_probs is None else draft_probs.float().contiguous()
    drafted = num_drafted.contiguous() if num_drafted is not None else torch.empty(
        0, dtype=torch.long, device=dev)
    uniforms = noise = nothing
    if randoms is not None:
        uniforms = randoms.accept_uniforms.float().contiguous()
        noise = randoms.sample_noise.float().contiguous()
    consts = kernel_constants(params, block_v or block_size(V))
    has_q = int(draft_probs is not None)
    accept = torch.empty(B, K, dtype=torch.int32, device=dev)
    if K:
        _accept_kernel[(B, K)](logits, drafts, probs, uniforms, accept, T, K, V, has_q,
                               **consts)
    sample = {k: consts[k] for k in ("temperature", "top_p", "RULE", "NUCLEUS", "BLOCK_V")}
    _sample_kernel[(B,)](logits, drafts, probs, noise, accept, drafted, num_accepted,
                         next_token, T, K, V, has_q, int(num_drafted is not None), **sample)
    return num_accepted, next_token


def correct_block_fused(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    params: RuleParams,
    randoms: Randoms | None,
    num_drafted: Tensor | None = None,
    *,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The one-launch ``_row_kernel`` (what the TensorRT plugin runs), launched from torch:
    (num_accepted [B], next_token [B], accepted_tokens [B, K+1]) as the ONNX op returns."""
    _kernels()
    check_randoms(params, randoms)
    B, K = draft_tokens.shape
    V = target_logits.shape[-1]
    dev = target_logits.device
    logits = target_logits.contiguous()
    drafts = draft_tokens.contiguous()
    # empty tensors stand for None, exactly as the plugin receives them
    extra = correction_inputs(B, randoms, draft_probs, num_drafted, dev)
    inputs = [logits, drafts, *extra.values()]
    scalars = row_kernel_scalars(logits.shape, drafts.shape, extra["draft_probs"].shape,
                                 extra["sample_noise"].shape, extra["num_drafted"].shape)
    outputs = [torch.empty(B, dtype=torch.long, device=dev),
               torch.empty(B, dtype=torch.long, device=dev),
               torch.empty(B, K + 1, dtype=torch.long, device=dev)]
    if B:
        _row_kernel[(B,)](*inputs, *scalars, *outputs,
                          **kernel_constants(params, block_v or block_size(V)))
    return outputs[0], outputs[1], outputs[2]


@functools.cache
def _have_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


def correct_for(device: torch.device | str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The correction to call on ``device``: the fused kernels on CUDA when triton is
    installed, else ``correction.correct`` (same signature, same results)."""
    if torch.device(device).type == "cuda" and _have_triton():
        return correct_fused
    return correct
