"""Constrained decoding under speculation (runtime/grammar.py, SpeculativeDecoder's masks), on
the demo pair: greedy constrained speculation equals constrained plain decoding token for
token, for the draft model and the n-gram lookup, on 21 JSON schemas of real shape whose
outputs parse and validate; the exact rule under a grammar samples what constrained plain
sampling samples; a matcher walks drafts and rolls back; bad guides are refused by name."""

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from paradraft.runtime.checkpoints import load_tokenizer
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.grammar import Guide, RowGrammar, allowed_tokens, compile_guide
from paradraft.runtime.model import load_model
from paradraft.runtime.speculative import SpeculativeDecoder

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
TOKENIZER = str(DEMO / "verifier" / "tokenizer.json")
SCHEMAS = [json.loads(line) for line in
           (Path(__file__).resolve().parent.parent / "prompts" / "json_schemas.jsonl"
            ).read_text().splitlines()]
MAX_NEW = 160


@pytest.fixture(scope="module")
def pair():
    verifier, draft = load_model(DEMO / "verifier"), load_model(DEMO / "draft")
    return verifier, draft, load_tokenizer(DEMO / "verifier")


def row_grammars(guides: list[Guide], vocab: int) -> list[RowGrammar]:
    return [RowGrammar(compile_guide(g, TOKENIZER, vocab), TOKENIZER, vocab) for g in guides]


def schema_guides() -> list[Guide]:
    return [Guide("json_schema", json.dumps(s["schema"])) for s in SCHEMAS]


def test_bad_guides_are_refused_naming_the_field_and_the_reason():
    for guide, reason in [
        (Guide("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}'),
         "does not exist"),
        (Guide("json_schema", '{"type": "string", "format": "nonsense"}'), "Unknown format"),
        (Guide("json_schema", '{"type": "string", "pattern": "(a"}'), "unclosed group"),
        (Guide("json_schema", "{not json"), "not JSON"),
        (Guide("json_schema", "[1, 2]"), "must be an object"),
        (Guide("regex", "[a-"), "regex"),
        (Guide("yaml", "a: b"), "guided_decoding_guide_type must be one of"),
    ]:
        with pytest.raises(ValueError, match="guided_decoding_guide") as e:
            compile_guide(guide, TOKENIZER, 8192)
        assert reason in str(e.value), (guide, str(e.value))


def test_masks_walk_the_drafts_allowed_and_leave_the_matcher_where_it_was(pair):
    _, _, tok = pair
    vocab = 8192
    schema = SCHEMAS[0]["schema"]
    grammar = row_grammars([Guide("json_schema", json.dumps(schema))], vocab)[0]
    valid = tok.encode('{"name":"Ada","age":36}', add_special_tokens=False).ids
    bad = tok.encode("x", add_special_tokens=False).ids[0]
    out = np.zeros((6, (vocab + 31) // 32), dtype=np.int32)
    assert grammar.masks([*valid[:3], bad, valid[4]], out) == 3  # stops at the bad draft
    allowed = allowed_tokens(out, vocab)
    for i in range(3):
        assert allowed[i, valid[i]]
        assert not allowed[i, bad]
    assert not allowed[3, bad]
    assert allowed[4:].all()  # past the first forbidden draft: never reached, all allowed
    again = np.zeros_like(out)
    assert grammar.masks([*valid[:3], bad, valid[4]], again) == 3
    np.testing.assert_array_equal(out, again)  # the walk rolled back
    assert grammar.advance(valid) == valid
    assert grammar.done


def test_greedy_rows_verify_no_draft_past_the_first_their_grammar_forbids(pair):
    """Greedy, a draft the grammar forbids is never kept, nor any after it: the row's drafts
    are cut there (an engine fed ragged verifies none of them). Sampled rows keep theirs:
    the exact rule's residual after a rejected draft is part of its distribution."""
    verifier, _, tok = pair
    vocab = verifier.config.vocab_size
    guide = Guide("json_schema", json.dumps(SCHEMAS[0]["schema"]))
    valid = tok.encode('{"name":"Ada","age":36}', add_special_tokens=False).ids
    bad = tok.encode("x", add_special_tokens=False).ids[0]
    drafts = torch.tensor([[*valid[:2], bad, valid[3]], valid[:4], valid[:4]])
    for params, want in ((RuleParams("greedy"), [2, 4, 1]),
                         (RuleParams("exact", temperature=1.0), [4, 4, 1])):
        dec = SpeculativeDecoder(verifier, Drafter("ngram"), params, k=4, max_batch_size=3,
                                 max_seq_len=64)
        dec.reset()
        dec.grammars[:2] = row_grammars([guide] * 2, vocab)  # the third row has none
        drafted = [4, 4, 1]
        allowed, keep = dec._grammar_masks([0, 1, 2], drafts, drafted,
                                           torch.tensor([4, 4, 1]))
        assert drafted == want and keep.tolist() == want, params.rule
        assert not allowed[0, 2, bad] and allowed[0, 1, valid[1]] and allowed[2].all()


@pytest.mark.parametrize("drafter", ["model", "ngram", "suffix", "grammar"])
def test_constrained_greedy_speculation_equals_constrained_plain_decoding(pair, drafter):
    """21 schemas as the rows of one batch, each with its own matcher: the speculative
    decoder emits exactly what plain constrained decoding emits, and every output that ended
    is JSON that validates against its schema."""
    verifier, draft, tok = pair
    vocab = verifier.config.vocab_size
    prompts = [tok.encode(f"# {s['name']} as JSON:\n", add_special_tokens=False).ids
               for s in SCHEMAS]
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=len(SCHEMAS),
                               max_seq_len=256)
    want = plain.generate(prompts, MAX_NEW, grammars=row_grammars(schema_guides(), vocab))
    spec = SpeculativeDecoder(verifier, Drafter(drafter, draft if drafter == "model" else None),
                              RuleParams("greedy"), k=4, max_batch_size=len(SCHEMAS),
                              max_seq_len=256)
    got = spec.generate(prompts, MAX_NEW, grammars=row_grammars(schema_guides(), vocab))
    assert got.token_ids == want.token_ids
    assert got.stats.accepted_tokens > 0  # drafts passed the masks, not only the verifier's
    # every output that ended (the grammar complete) is JSON that validates; the toy model
    # may instead run to the token limit in a string or a number's digits
    ended = [(s, ids) for s, ids in zip(SCHEMAS, got.token_ids, strict=True)
             if len(ids) < MAX_NEW]
    assert len(ended) >= 15, [tok.decode(ids) for ids in got.token_ids]
    for s, ids in ended:
        jsonschema.validate(json.loads(tok.decode(ids)), s["schema"])


def test_exact_sampling_under_a_grammar_samples_what_plain_constrained_sampling_does(pair):
    """Two tokens sampled under a grammar that allows many first and second tokens: exact
    speculation (draft model, sampled drafts with their q) and plain sampling give the same
    distribution of pairs (a chi-square test of homogeneity), and none leaves the grammar."""
    verifier, draft, tok = pair
    vocab = verifier.config.vocab_size
    guide = Guide("regex", "[a-z]{1,6}[0-9]")
    prompt = tok.encode("def f(", add_special_tokens=False).ids
    rows, seeds = 256, 4
    samples = {}
    for name, drafter in (("plain", None), ("spec", Drafter("model", draft))):
        dec = SpeculativeDecoder(verifier, drafter, RuleParams("exact", temperature=1.0), k=3,
                                 max_batch_size=rows, max_seq_len=32)
        pairs = []
        for seed in range(seeds):
            out = dec.generate([prompt] * rows, 2, seed=seed,
                               grammars=row_grammars([guide] * rows, vocab)).token_ids
            pairs += [tuple(o[:2]) for o in out]
        samples[name] = pairs
    for pairs in samples.values():
        for first, _ in pairs:
            assert tok.decode([first]).isalpha() and tok.decode([first]).islower()
    keys = sorted(set(samples["plain"]) | set(samples["spec"]))
    counts = torch.tensor([[samples[n].count(k) for k in keys] for n in ("plain", "spec")])
    # cells too rare for the test's approximation are pooled
    common = counts.sum(0) >= 10
    table = torch.cat([counts[:, common], counts[:, ~common].sum(1, keepdim=True)], 1)
    assert common.sum() >= 5
    assert chi2_contingency(table.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("drafter", ["ngram", "grammar"])
def test_the_grammar_drafts_the_tokens_it_forces(pair, drafter):
    """Keys, separators and the rest of an enum value are forced by the schema: the grammar
    drafts them itself, beside a lookup that finds nothing in this prompt (or as the only
    drafter, ``grammar``), and they pass (a forced token is the only one the mask allows).
    The output is still plain decoding's."""
    verifier, _, tok = pair
    vocab = verifier.config.vocab_size
    schema = {"type": "object", "properties": {
        "classification_label": {"enum": ["enhancement_request", "defect_report"]},
        "requires_immediate_attention": {"type": "boolean"}},
        "required": ["classification_label", "requires_immediate_attention"],
        "additionalProperties": False}
    guide = Guide("json_schema", json.dumps(schema))
    prompt = tok.encode("# ticket\n", add_special_tokens=False).ids
    plain = SpeculativeDecoder(verifier, None, RuleParams("greedy"), max_batch_size=1,
                               max_seq_len=128)
    want = plain.generate([prompt], 64, grammars=row_grammars([guide], vocab)).token_ids
    spec = SpeculativeDecoder(verifier, Drafter(drafter), RuleParams("greedy"), k=4,
                              max_batch_size=1, max_seq_len=128)
    got = spec.generate([prompt], 64, grammars=row_grammars([guide], vocab))
    assert got.token_ids == want
    stats = got.stats
    # most of the output was drafted and every forced draft passed: rounds emit several
    # tokens each
    assert stats.draft_tokens >= len(want[0]) // 2, stats
    assert stats.accepted_tokens >= 0.9 * stats.draft_tokens, stats
    jsonschema.validate(json.loads(tok.decode(want[0])), schema)
    # a request that asks for no drafts (num_draft_tokens 0) decodes plainly, constrained:
    # the grammar proposes nothing for it either
    spec.reset()
    tokens, running = spec.prefill([0], [prompt], [64], [None], [0], num_draft_tokens=[0],
                                   grammars=row_grammars([guide], vocab))
    out = tokens[0]
    while running[0]:
        gained, running = spec.step([0])
        out += gained[0]
    assert out == want[0]
    assert spec.slot_stats(0).draft_tokens == 0 and spec.slot_stats(0).verify_steps == len(out) - 1
