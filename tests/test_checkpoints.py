"""What real checkpoints bring besides weights: EOS lists and generation_config.json, draft and
verifier vocabularies padded to different sizes, and chat templates."""

import json
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, save_hf, sharpen, tiny_config, transformers
from test_lossless import assert_joint_distribution
from tokenizers import Tokenizer, models, pre_tokenizers

from paradraft.runtime.checkpoints import (
    chat_stop_token_ids,
    check_draft_vocab,
    format_chat,
    load_draft,
)
from paradraft.runtime.correction import RuleParams
from paradraft.runtime.drafters import Drafter
from paradraft.runtime.model import load_config, load_model
from paradraft.runtime.speculative import SpeculativeDecoder

REAL_VOCAB = 56  # ids the tokenizer defines; the rest of a model's vocab_size is padding


def word_tokenizer(n: int, extra: dict[str, int] | None = None) -> Tokenizer:
    vocab = {f"t{i}": i for i in range(n)} | (extra or {})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def hf_greedy(hf, prompt: list[int], new_tokens: int, eos=None) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                      eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -- EOS lists and generation_config.json ---------------------------------------------------

def test_generation_config_eos_list_wins_over_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        tiny_config("llama").to_dict()))
    assert load_config(tmp_path).eos_token_ids == (0,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_config(tmp_path).eos_token_ids == (7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": -3}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id >= 0"):
        load_config(tmp_path)


@pytest.mark.parametrize("kind", ["model", "self"])
def test_generation_stops_at_the_second_id_of_an_eos_list(pair, kind):
    vdir, ddir, _, hf = pair
    verifier = load_model(vdir)
    prompt = [5, 9, 14, 3]
    free = hf_greedy(hf, prompt, 24, eos=[])  # no end id: the full continuation
    stop_at = 6
    second = free[stop_at]
    first = next(t for t in range(VOCAB) if t not in free)  # never emitted
    want = hf_greedy(hf, prompt, 24, eos=[first, second])
    assert want == free[: free.index(second) + 1]  # transformers stops on the second id
    drafter = Drafter(kind, load_model(ddir) if kind == "model" else verifier)
    dec = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=4, max_batch_size=2)
    got = dec.generate([prompt, prompt], 24, eos_token_id=[first, second]).token_ids
    assert got == [want, want]
    with pytest.raises(ValueError, match="eos_token_id must list at most 16 ids"):
        dec.generate([prompt], 4, eos_token_id=list(range(17)))


def test_a_request_without_drafts_decodes_plainly_beside_drafting_rows(pair):
    vdir, ddir, _, hf = pair
    verifier, draft = load_model(vdir), load_model(ddir)
    dec = SpeculativeDecoder(verifier, Drafter("model", draft), RuleParams("greedy"), k=4,
                             max_batch_size=2, adaptive_k=True)
    prompts = [[5, 9, 14], [7, 3, 2, 8]]
    dec.reset()
    new, running = dec.prefill([0, 1], prompts, [20, 20], [None, None], [0, 1],
                               num_draft_tokens=[0, 4])
    out = [list(t) for t in new]
    while any(running):
        slots = [s for s, r in zip([0, 1], running, strict=True) if r]
        new, still = dec.step(slots)
        for s, t in zip(slots, new, strict=True):
            out[s] += t
        running = [s in slots and still[slots.index(s)] for s in (0, 1)]
    assert out == [hf_greedy(hf, p, 20, eos=[]) for p in prompts]
    plain, drafting = dec.slot_stats(0), dec.slot_stats(1)
    assert plain.draft_tokens == 0 and plain.verify_steps == 19  # the prefill gave one
    assert drafting.draft_tokens > 0


# -- vocabularies padded to different sizes ---------------------------------------------------

@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    """A verifier padded to 64 ids and a draft padded to 60, sharing a 56-id tokenizer (as
    Qwen2.5-7B's 152064 against 0.5B's 151936)."""
    torch.manual_seed(3)
    cfg = tiny_config("llama", vocab=64, tie_word_embeddings=False)
    verifier = sharpen(transformers.AutoModelForCausalLM.from_config(cfg).eval())
    vdir = Path(save_hf(verifier, tmp_path_factory.mktemp("padded_verifier")))
    draft = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama", vocab=60, tie_word_embeddings=False)).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a noisy copy of the verifier on the ids it has
        for (name, p), q in zip(draft.state_dict().items(), verifier.state_dict().values(),
                                strict=True):
            src = q[:60] if name in ("model.embed_tokens.weight", "lm_head.weight") else q
            p.copy_(src + torch.randn(p.shape, generator=g) * 0.004)
    ddir = Path(save_hf(draft, tmp_path_factory.mktemp("padded_draft")))
    for d in (vdir, ddir):
        word_tokenizer(REAL_VOCAB).save(str(d / "tokenizer.json"))
    return vdir, ddir, verifier


def test_padded_draft_is_widened_and_never_proposes_a_padded_id(padded_pair):
    vdir, ddir, _ = padded_pair
    draft = load_draft(ddir, vdir, 64)
    assert draft.config.vocab_size == 64
    logits = draft(torch.tensor([[1, 2, 3]]), torch.arange(3)[None],
                   *_cache(draft))[0]
    assert torch.isneginf(logits[..., REAL_VOCAB:]).all()
    assert torch.isfinite(logits[..., :REAL_VOCAB]).all()
    # the shared range answers exactly as the unpadded draft
    plain = load_model(ddir)
    ref = plain(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], *_cache(plain))[0]
    assert torch.equal(logits[..., :REAL_VOCAB], ref[..., :REAL_VOCAB])
    # a padded id the verifier emits can still be fed to the draft
    draft(torch.tensor([[62]]), torch.tensor([[3]]), *_cache(draft))


def _cache(model):
    from paradraft.runtime.model import new_kv_cache

    return (new_kv_cache(model.config, 1, 16, torch.float32),)


def test_padded_pair_is_lossless_greedy(padded_pair):
    vdir, ddir, hf = padded_pair
    verifier = load_model(vdir)
    dec = SpeculativeDecoder(verifier, Drafter("model", load_draft(ddir, vdir, 64)),
                             RuleParams("greedy"), k=4, max_batch_size=4)
    prompts = [[5, 9, 14], [7, 3, 2, 8, 1], [40], [11, 12]]
    result = dec.generate(prompts, 20)
    assert result.token_ids == [hf_greedy(hf, p, 20, eos=[]) for p in prompts]
    assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens


def test_padded_pair_keeps_the_exact_distribution(padded_pair):
    vdir, ddir, _ = padded_pair
    verifier = load_model(vdir)
    assert_joint_distribution(verifier, Drafter("model", load_draft(ddir, vdir, 64)), 64)


def test_draft_vocab_refusals_name_what_differs(padded_pair, tmp_path):
    vdir, ddir, _ = padded_pair
    assert check_draft_vocab(vdir, 64, ddir, 60) == REAL_VOCAB
    with pytest.raises(ValueError, match="larger than the verifier's 60"):
        check_draft_vocab(ddir, 60, vdir, 64)
    other = tmp_path / "other"
    other.mkdir()
    word_tokenizer(REAL_VOCAB - 1, {"zz": REAL_VOCAB - 1}).save(str(other / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer\.json model\.vocab differs"):
        check_draft_vocab(vdir, 64, other, 60)
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    word_tokenizer(62).save(str(bigger / "tokenizer.json"))
    with pytest.raises(ValueError, match="by more than padding: the tokenizer defines 62 ids"):
        check_draft_vocab(bigger, 64, bigger, 60)
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="cannot be shown to be padding"):
        check_draft_vocab(vdir, 64, tmp_path / "none", 60)


# -- chat templates -------------------------------------------------------------------------

CHATML = (  # Qwen2.5's template, without the tool branches
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (  # Llama 3's header layout, with bos_token from the tokenizer
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


@pytest.fixture(params=["chatml", "llama3"])
def chat_dir(request, tmp_path):
    specials = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]
    tok = word_tokenizer(40, {s: 40 + i for i, s in enumerate(specials)})
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": specials})
    if request.param == "chatml":
        fast.eos_token, fast.chat_template = "<|im_end|>", CHATML
    else:
        fast.bos_token, fast.eos_token = "<|begin_of_text|>", "<|end_of_text|>"
        fast.chat_template = LLAMA3
    fast.save_pretrained(tmp_path)
    return tmp_path, request.param


@pytest.mark.parametrize("system", [None, "Answer in one word."])
def test_chat_formatting_equals_transformers(chat_dir, system):
    path, _ = chat_dir
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": " t1 t2 "}, {"role": "assistant", "content": "t3"},
        {"role": "user", "content": "t4"}]
    reference = transformers.AutoTokenizer.from_pretrained(path)
    for add in (True, False):
        assert format_chat(path, messages, add) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add)


def test_chat_stops_at_the_end_of_turn_token(chat_dir):
    path, family = chat_dir
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    want = ["<|im_end|>"] if family == "chatml" else ["<|end_of_text|>", "<|eot_id|>"]
    assert chat_stop_token_ids(path) == tuple(tok.token_to_id(t) for t in want)


def test_a_checkpoint_without_a_chat_template_is_refused(tmp_path):
    word_tokenizer(8).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="has no chat template"):
        format_chat(tmp_path, [{"role": "user", "content": "t1"}])
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="no system role"):
        format_chat(tmp_path, [{"role": "user", "content": "t1"}])


def test_padded_pair_builds_into_engines_that_stay_lossless(padded_pair, tmp_path):
    """The ONNX engines of a padded pair: the draft graphs carry the verifier's vocabulary
    with −inf past the real ids, and greedy output still equals transformers'."""
    pytest.importorskip("onnxruntime")
    from paradraft.build.onnx import build_engines
    from paradraft.runtime.backends.loader import load_engines

    vdir, ddir, hf = padded_pair
    manifest = build_engines(vdir, tmp_path, ddir, max_k=4, draft_precision="float32",
                             self_draft_layers=1)
    assert manifest["models"]["draft"]["config"]["vocab_size"] == 64
    # rule defaults calibrated to this verifier travel with the engines
    assert 0 < manifest["calibration"]["tau"] < 1 and manifest["calibration"]["positions"] > 0
    verifier, drafters, _, _ = load_engines(tmp_path)
    prompts = [[5, 9, 14], [7, 3, 2, 8, 1]]
    for kind in ("model", "self"):
        dec = SpeculativeDecoder(verifier, drafters[kind], RuleParams("greedy"), k=4,
                                 max_batch_size=2)
        result = dec.generate(prompts, 16)
        assert result.token_ids == [hf_greedy(hf, p, 16, eos=[]) for p in prompts], kind
        assert result.stats.accepted_tokens > 0
