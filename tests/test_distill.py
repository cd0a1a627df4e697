"""`paradraft distill` end to end on a tiny random verifier: data from the verifier's own
continuations, a draft that loads with our loader and with transformers, resume, and a
trained draft that the verifier accepts more often than an untrained one."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import sharpen, transformers

from paradraft.cli.main import main
from paradraft.runtime.checkpoints import load_draft
from paradraft.runtime.model import load_model, new_kv_cache
from paradraft.runtime.tools.distill import (
    DistillConfig,
    batch_at_targets,
    batch_of,
    distill,
    distill_loss,
    new_draft,
    target_logits,
    teacher_targets,
)

DEMO_VERIFIER = Path(__file__).resolve().parent.parent / "models" / "demo" / "verifier"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SMALL = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
         "--intermediate-size", "64", "--gen-batch", "8", "--max-new-tokens", "24",
         "--batch-rows", "4", "--train-len", "64", "--lr", "1e-2", "--eval-prompts", "4",
         "--save-dtype", "float32"]


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama on the demo tokenizer (8192 ids), with a chat template. Its head
    is scaled so its next-token distributions are as peaked as a trained model's (top-1 mass
    about 0.6): at the usual scale of 4 they are nearly flat (0.001), and soft targets would
    then teach the draft no argmax."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=1, tie_word_embeddings=False)
    model = sharpen(transformers.LlamaForCausalLM(config).eval(), 40.0)
    path = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_VERIFIER / name, path / name)
    (path / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return str(path)


def run_distill(verifier: str, out: Path, *extra: str) -> dict:
    main(["distill", "--verifier", verifier, "--out", str(out), "--minutes", "5",
          "--max-sequences", "24", *SMALL, *extra])
    return json.loads((out / "distill.json").read_text())


def test_distill_end_to_end_and_resume(verifier_dir, tmp_path):
    out = tmp_path / "draft"
    first = run_distill(verifier_dir, out, "--steps", "100")
    assert first["data"]["sequences"] > 0 and first["data"]["heldout_sequences"] > 0
    assert first["training"]["steps"] == 100
    # a run already in the dir is continued only when asked
    with pytest.raises(SystemExit):
        run_distill(verifier_dir, out, "--steps", "200")
    rounds = json.loads((out / ".work" / "data_state.json").read_text())["rounds"]
    resumed = run_distill(verifier_dir, out, "--steps", "200", "--resume")
    assert resumed["training"]["steps"] == 200
    # the data was not generated again, and training went on from step 100
    assert json.loads((out / ".work" / "data_state.json").read_text())["rounds"] == rounds
    assert resumed["data"] == first["data"]
    assert [h["step"] for h in resumed["training"]["history"]] == [50, 100, 150, 200]

    # a standard checkpoint: our loader and transformers agree on it
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 8192
    assert (out / "tokenizer.json").read_bytes() == (Path(verifier_dir) / "tokenizer.json"
                                                     ).read_bytes()
    ours = load_draft(out, verifier_dir, 8192)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 8192, (1, 12))
    cache = new_kv_cache(ours.config, 1, 16, torch.float32, "cpu")
    with torch.no_grad():
        got, _ = ours(ids, torch.arange(12)[None], cache, kv_len=12)
        want = theirs(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # trained beats untrained: teacher-forced on held-out data and through the real decoder
    trained = resumed["heldout_decoder_acceptance"]["acceptance"]
    assert resumed["training"]["heldout_teacher_forced_acceptance"] > (
        resumed["untrained_heldout_teacher_forced_acceptance"])
    untrained_dir = tmp_path / "untrained"
    untrained = distill(DistillConfig(
        verifier=verifier_dir, out=str(untrained_dir), minutes=5, max_sequences=24, steps=0,
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
        gen_batch=8, max_new_tokens=24, eval_prompts=4, save_dtype="float32"))
    assert trained > untrained["heldout_decoder_acceptance"]["acceptance"]


def test_distill_parallel(verifier_dir, tmp_path):
    out = tmp_path / "pard"
    metrics = run_distill(verifier_dir, out, "--kind", "parallel", "--steps", "10")
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 2  # the demo tokenizer's <mask>
    assert load_model(out).config.mask_token_id == 2
    assert metrics["heldout_decoder_acceptance"]["prompts"] > 0


def test_distill_refuses_bad_settings(verifier_dir, tmp_path):
    with pytest.raises(ValueError, match="kind"):
        DistillConfig(verifier=verifier_dir, out=str(tmp_path), kind="tree")
    with pytest.raises(ValueError, match="data_share"):
        DistillConfig(verifier=verifier_dir, out=str(tmp_path), data_share=1.5)
    with pytest.raises(ValueError, match="train_dtype"):
        DistillConfig(verifier=verifier_dir, out=str(tmp_path), train_dtype="int8")
    with pytest.raises(ValueError, match="mask_token_id"):
        distill(DistillConfig(verifier=verifier_dir, out=str(tmp_path / "x"), mask_token_id=3))


def test_teacher_targets_are_the_verifiers_topk_and_line_up_with_labels(verifier_dir, tmp_path):
    """The soft targets are transformers' top-k of the verifier at each generated position,
    and batch_of puts them where the label they predict is: on a greedy continuation the
    teacher's top-1 is the label itself."""
    cfg = DistillConfig(verifier=verifier_dir, out=str(tmp_path), teacher_topk=5,
                        train_len=16, batch_rows=6, prompt_weight=0.25)
    cfg.work.mkdir(parents=True)
    verifier = load_model(verifier_dir).requires_grad_(False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(verifier_dir,
                                                           dtype=torch.float32).eval()
    torch.manual_seed(1)
    seqs = []
    for n, new in [(5, 20), (9, 6), (3, 30)]:  # prompt lengths and continuation lengths
        prompt = torch.randint(3, 8192, (1, n))
        with torch.no_grad():
            ids = hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        seqs.append({"ids": ids[0].tolist(), "prompt_len": n})
    teacher_targets(cfg, verifier, seqs)
    for s in seqs:
        n = s["prompt_len"]
        with torch.no_grad():
            want = hf(torch.tensor([s["ids"]])).logits[0, n - 1:-1].topk(5, dim=-1)
        ids, probs = s["teacher"]
        assert torch.equal(ids.long(), want.indices)
        torch.testing.assert_close(probs.float(), want.values.softmax(-1), atol=2e-3, rtol=0)
    # resumed from .work/teacher.pt: the same targets without the verifier running again
    again = [{k: v for k, v in s.items() if k != "teacher"} for s in seqs]
    teacher_targets(cfg, None, again)  # type: ignore[arg-type]
    assert all(torch.equal(a["teacher"][0], s["teacher"][0])
               for a, s in zip(again, seqs, strict=True))

    batch = batch_of(seqs, random.Random(0), cfg, pad_id=1, mask_token_id=None)
    soft = batch["soft"]
    assert soft.any() and (batch["weights"][soft] == 1).all()
    assert torch.equal(batch["soft_ids"][..., 0][soft], batch["labels"][soft])
    assert (batch["weights"][~soft & (batch["weights"] > 0)] == 0.25).all()  # prompt targets

    # the head runs at weighted targets only; the loss is the one over the whole window
    model = new_draft(cfg, verifier, None).float().eval()
    with torch.no_grad():
        full = distill_loss(model(batch["inputs"]).logits, batch)
        at_targets = distill_loss(target_logits(model, batch), batch_at_targets(batch))
    assert (batch["weights"] == 0).any()  # some padding was skipped
    torch.testing.assert_close(at_targets, full)


def test_distill_loss_is_cross_entropy_towards_the_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    labels = torch.randint(0, 11, (2, 3))
    soft_ids = torch.stack([torch.randperm(11)[:4] for _ in range(6)]).view(2, 3, 4)
    soft_probs = torch.rand(2, 3, 4).softmax(-1)
    weights = torch.tensor([[1.0, 1.0, 0.1], [0.0, 1.0, 1.0]])
    soft = torch.tensor([[True, False, False], [False, True, True]])
    batch = {"labels": labels, "weights": weights, "soft_ids": soft_ids,
             "soft_probs": soft_probs, "soft": soft}
    logp = logits.log_softmax(-1)
    per_token = torch.where(soft, -(soft_probs * logp.gather(-1, soft_ids)).sum(-1),
                            -logp.gather(-1, labels[..., None])[..., 0])
    want = (per_token * weights).sum() / weights.sum()
    torch.testing.assert_close(distill_loss(logits, batch), want)
    # a one-hot soft target on the label is the hard loss
    one_hot = {**batch, "soft": torch.ones_like(soft), "soft_ids": labels[..., None],
               "soft_probs": torch.ones(2, 3, 1)}
    hard = {**batch, "soft": torch.zeros_like(soft)}
    torch.testing.assert_close(distill_loss(logits, one_hot), distill_loss(logits, hard))
