#!/usr/bin/env python
"""Train the small demo models used by paradraft, from scratch, on CPU.

Produces, under ``--out`` (default ``models/demo``):

* ``verifier/``        LlamaForCausalLM (~14 M params) trained as a causal LM plus an
                       early-exit loss so its first ``self_draft_layers`` layers + final norm +
                       LM head work as a "self-draft".
* ``draft/``           tiny LlamaForCausalLM (~2.4 M params) distilled from the verifier.
* ``parallel_draft/``  same shape as ``draft``, trained PARD-style: one forward pass over
                       ``context + [mask] * (K - 1)`` proposes K tokens.
* ``split.json``, ``training_metrics.json``, ``MODEL_CARD.md``.

The corpus is the running interpreter's own standard library (``.py`` files only), split by
file into train / held-out.  Scratch state (token caches, resumable checkpoints, log) lives in
``<out>/.work/`` which is git-ignored.

Example::

    nice -n 10 .venv/bin/python lab/train_demo_models.py --out models/demo --seed 0

Every training stage stops at whichever comes first: its step limit (``--<stage>-steps``) or
its wall-clock budget (``--<stage>-minutes``).  The LR schedule is a linear warmup (in steps)
followed by a cosine decay over the stage's progress, progress = max(step / steps,
elapsed / budget), so the LR is fully decayed whichever limit ends the stage, even when the CPU
is shared and its speed varies.  Batches are a pure function of (seed, stage, step), so a run
with a step limit that binds before its time budget is reproducible from the random seed; the step
counts of each run are recorded in ``training_metrics.json``.

The optimisation itself (AdamW, schedule, budgets, checkpoints) is the shared loop of
``paradraft.runtime.tools.train_loop``, the one ``paradraft distill`` trains through; this
script keeps what only the demo needs: the corpus, the tokenizer, the verifier trained from
scratch with its early-exit loss, and drafts trained on text windows before any verifier
output exists. A draft for any other verifier comes from ``paradraft distill``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from paradraft.runtime.tools.distill import is_heldout, save_json
from paradraft.runtime.tools.train_loop import LossFn, Schedule, ThreadTuner, log, train_loop

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
MASK_TOKEN = "<mask>"
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2
VOCAB_SIZE = 8192
SEQ_LEN = 256
MAX_POSITIONS = 1024
PARALLEL_MAX_K = 8
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
STAGES = ("tokenizer", "verifier", "draft", "parallel", "selfdistill", "report")
STAGE_INDEX = {name: i for i, name in enumerate(STAGES)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


@dataclass
class StageConfig:
    name: str
    minutes: float
    max_steps: int | None  # None: plan from the wall-clock budget
    batch_size: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    extra: dict[str, float] = field(default_factory=dict)


VERIFIER_SHAPE = ModelShape(512, 4, 8, 4, 1024)
DRAFT_SHAPE = ModelShape(192, 2, 4, 2, 512)
SELF_DRAFT_LAYERS = 1


@dataclass
class RunConfig:
    out: Path
    seed: int
    stage: str
    resume: bool
    ckpt_minutes: float
    max_threads: int
    tune_threads: bool
    heldout_fraction: float
    eval_sequences: int
    agreement_prompts: int
    verifier: StageConfig
    draft: StageConfig
    parallel: StageConfig
    selfdistill: StageConfig

    @property
    def work(self) -> Path:
        return self.out / ".work"


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def update_metrics(cfg: RunConfig, key: str, value: object) -> None:
    path = cfg.out / "training_metrics.json"
    metrics = load_json(path)
    metrics[key] = value
    save_json(path, metrics)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dir_size(path: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".work"]
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


# --------------------------------------------------------------------------------------------
# corpus + split
# --------------------------------------------------------------------------------------------


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> list[str]:
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(files)


def read_source(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def make_split(cfg: RunConfig) -> dict:
    root = stdlib_dir()
    files = list_corpus_files(root)
    heldout = [f for f in files if is_heldout(f, cfg.seed, cfg.heldout_fraction)]
    held = set(heldout)
    train = [f for f in files if f not in held]
    split = {
        "python_version": platform.python_version(),
        "stdlib_dir": str(root),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "seed": cfg.seed,
        "heldout_fraction": cfg.heldout_fraction,
        "rule": "held out iff sha256(f'{seed}:{relpath}')[:8] / 2**64 < heldout_fraction",
        "n_files": len(files),
        "n_train_files": len(train),
        "n_heldout_files": len(heldout),
        "train_bytes": sum((root / f).stat().st_size for f in train),
        "heldout_bytes": sum((root / f).stat().st_size for f in heldout),
        "heldout_files": heldout,
    }
    save_json(cfg.out / "split.json", split)
    return split


def split_files(cfg: RunConfig) -> tuple[list[str], list[str]]:
    split = load_json(cfg.out / "split.json")
    held = set(split["heldout_files"])
    files = list_corpus_files(Path(split["stdlib_dir"]))
    return [f for f in files if f not in held], sorted(held)


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(cfg: RunConfig) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    t0 = time.time()
    split = make_split(cfg)
    log(f"corpus: {split['n_files']} files ({split['n_train_files']} train, "
        f"{split['n_heldout_files']} held-out) from {split['stdlib_dir']}")
    root = Path(split["stdlib_dir"])
    train, heldout = split_files(cfg)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator((read_source(root / f) for f in train), trainer, length=len(train))
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID
    assert tok.token_to_id(PAD_TOKEN) == PAD_ID
    assert tok.token_to_id(MASK_TOKEN) == MASK_ID

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    tok_dir = cfg.work / "tokenizer"
    save_tokenizer_files(fast, tok_dir)

    # round-trip check on held-out files through the transformers wrapper
    loaded = AutoTokenizer.from_pretrained(tok_dir)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 0, 1)
    assert loaded.mask_token_id == MASK_ID
    loaded.model_max_length = 10**9  # whole files are encoded here; silences a length warning
    for f in heldout[:20]:
        text = read_source(root / f)
        ids = loaded.encode(text, add_special_tokens=False)
        assert loaded.decode(ids) == text, f"tokenizer round-trip failed on {f}"

    stats = pretokenize(cfg, tok, root, train, heldout)
    stats["tokenizer_sha256"] = file_sha256(tok_dir / "tokenizer.json")
    stats["vocab_size"] = tok.get_vocab_size()
    stats["wall_seconds"] = round(time.time() - t0, 1)
    update_metrics(cfg, "corpus", {k: v for k, v in split.items() if k != "heldout_files"})
    update_metrics(cfg, "tokenizer", stats)
    log(f"tokenizer done: {stats}")


def save_tokenizer_files(fast: object, tok_dir: Path) -> None:
    tok_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(tok_dir)  # type: ignore[attr-defined]
    conf_path = tok_dir / "tokenizer_config.json"
    conf = load_json(conf_path)
    # the generic class name loads with both transformers 4.x and 5.x
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    conf.update(bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                mask_token=MASK_TOKEN, clean_up_tokenization_spaces=False,
                model_max_length=MAX_POSITIONS, add_bos_token=False, add_eos_token=False)
    save_json(conf_path, conf)
    save_json(tok_dir / "special_tokens_map.json", {
        "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN,
    })


def pretokenize(cfg: RunConfig, tok: object, root: Path, train: list[str],
                heldout: list[str]) -> dict:
    """Encode every file once; documents are joined with <|endoftext|> (also leading)."""
    stats: dict[str, int] = {}
    cfg.work.mkdir(parents=True, exist_ok=True)  # a fresh clone has no .work yet
    for name, files in (("train", train), ("heldout", heldout)):
        pieces: list[np.ndarray] = []
        for start in tqdm(range(0, len(files), 64), desc=f"encode {name}", mininterval=5):
            batch = [read_source(root / f) for f in files[start:start + 64]]
            for enc in tok.encode_batch(batch):  # type: ignore[attr-defined]
                pieces.append(np.asarray([EOS_ID, *enc.ids], dtype=np.uint16))
        arr = np.concatenate([*pieces, np.asarray([EOS_ID], dtype=np.uint16)])
        np.save(cfg.work / f"tokens_{name}.npy", arr)
        stats[f"{name}_tokens"] = int(arr.size)
    return stats


def load_tokens(cfg: RunConfig, name: str) -> np.ndarray:
    path = cfg.work / f"tokens_{name}.npy"
    shipped = cfg.out / "verifier" / "tokenizer.json"
    if not path.exists() and shipped.exists():
        # a fresh clone ships the models but not .work: re-encode with the shipped tokenizer
        # (later stages can then run on their own, e.g. another selfdistill round)
        from tokenizers import Tokenizer

        train, heldout = split_files(cfg)
        pretokenize(cfg, Tokenizer.from_file(str(shipped)),
                    Path(load_json(cfg.out / "split.json")["stdlib_dir"]), train, heldout)
    return np.load(path)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


def build_model(shape: ModelShape, **extra: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **extra,
    )
    return LlamaForCausalLM(config)


def load_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.float()


def save_model(cfg: RunConfig, model: torch.nn.Module, name: str) -> Path:
    """Save in float16 with tokenizer files, then reload in fp32 and sanity-check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = cfg.out / name
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in model.parameters():
        max_abs = p.detach().abs().max().item()
        assert math.isfinite(max_abs) and max_abs < 6e4, f"weight overflows fp16 ({max_abs})"
    half = copy.deepcopy(model).to(torch.float16)
    half.generation_config.bos_token_id = EOS_ID
    half.generation_config.eos_token_id = EOS_ID
    half.generation_config.pad_token_id = PAD_ID
    half.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes it owner-only
    # legacy spellings next to transformers 5's "dtype" / "rope_parameters", for other readers
    conf = load_json(out_dir / "config.json")
    conf["torch_dtype"] = "float16"
    conf["rope_theta"] = float(model.config.rope_parameters["rope_theta"])
    save_json(out_dir / "config.json", conf)
    # the tokenizer stage's files, or (a later stage run in a fresh clone) the shipped ones
    tok_dir = cfg.work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        tok_dir = cfg.out / "verifier"
    for fname in TOKENIZER_FILES:
        (out_dir / fname).write_bytes((tok_dir / fname).read_bytes())

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(out_dir)
    probe = torch.arange(3, 3 + 64).remainder(VOCAB_SIZE).unsqueeze(0)
    with torch.no_grad():
        ref = model.eval()(probe).logits
        got = reloaded(probe).logits
    assert torch.isfinite(got).all(), "non-finite logits after fp16 round trip"
    err = (ref - got).abs().max().item()
    assert err < 0.5, f"fp16 round trip changed logits by {err}"
    for p in reloaded.parameters():
        assert torch.isfinite(p).all()
    log(f"saved {out_dir} (fp16 round-trip max |dlogit| = {err:.4f})")
    return out_dir


def shape_of(model: torch.nn.Module) -> dict:
    c = model.config
    return {
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "parameters": count_params(model),
    }


class LayerTap:
    """Forward hook that keeps the output of one decoder layer (for the early-exit loss)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.value: torch.Tensor | None = None
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.value = output[0] if isinstance(output, tuple) else output  # type: ignore[index]

    def remove(self) -> None:
        self.handle.remove()


def early_exit_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden))


def self_draft_forward(model: torch.nn.Module, input_ids: torch.Tensor,
                       n_layers: int) -> torch.Tensor:
    """First n_layers + final norm + LM head (LlamaModel runs layers[:num_hidden_layers])."""
    config = model.model.config
    full = config.num_hidden_layers
    config.num_hidden_layers = n_layers
    try:
        hidden = model.model(input_ids=input_ids).last_hidden_state
    finally:
        config.num_hidden_layers = full
    return model.lm_head(hidden)


# --------------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------------


def step_rng(seed: int, stage: str, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, STAGE_INDEX[stage], step])


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int,
                   length: int) -> torch.Tensor:
    starts = rng.integers(0, tokens.size - length, size=batch)
    rows = np.stack([tokens[s:s + length] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def eval_windows(tokens: np.ndarray, count: int, length: int = SEQ_LEN + 1) -> torch.Tensor:
    starts = np.linspace(0, tokens.size - length, count).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64))


def parallel_batch(tokens: np.ndarray, rng: np.random.Generator,
                   batch_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    """PARD batch: inputs are x[:L] with the last k-1 positions replaced by <mask>.

    With cut c = L - (k - 1), the output at c - 1 predicts x[c] and the output at the j-th
    mask (position c - 1 + j) predicts x[c + j], i.e. every position i still predicts x[i + 1],
    so the labels are simply x[1:L + 1].  Returns (inputs, real x[:L], labels, is_mask).
    """
    length = int(rng.choice([64, 128, 256]))
    batch = max(1, batch_tokens // length)
    return mask_tail(random_windows(tokens, rng, batch, length + 1), rng)


def mask_tail(x: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor]:
    """Replace the last k-1 input positions of each row (k uniform in [2, 8]) by <mask>."""
    real, labels = x[:, :-1], x[:, 1:]
    inputs = real.clone()
    ks = torch.from_numpy(rng.integers(2, PARALLEL_MAX_K + 1, size=x.shape[0]))
    positions = torch.arange(real.shape[1])
    is_mask = positions >= (real.shape[1] - (ks - 1)).unsqueeze(1)
    inputs[is_mask] = MASK_ID
    return inputs, real, labels, is_mask


# --------------------------------------------------------------------------------------------
# training: the shared loop of paradraft.runtime.tools.train_loop (distill trains through it)
# --------------------------------------------------------------------------------------------


def train_stage(cfg: RunConfig, sc: StageConfig, model: torch.nn.Module,
                loss_fn: LossFn) -> dict:
    """One stage: until ``sc.max_steps`` or ``sc.minutes``, checkpointed in ``.work``."""
    schedule = Schedule(lr=sc.lr, warmup_steps=sc.warmup_steps, min_lr_ratio=sc.min_lr_ratio,
                        weight_decay=sc.weight_decay, betas=sc.betas, grad_clip=sc.grad_clip)
    result = train_loop(model, loss_fn, schedule, ckpt_file=cfg.work / f"{sc.name}_ckpt.pt",
                        desc=sc.name, max_steps=sc.max_steps, budget_s=sc.minutes * 60.0,
                        resume=cfg.resume, ckpt_minutes=cfg.ckpt_minutes,
                        tuner=ThreadTuner(cfg.max_threads, cfg.tune_threads))
    result["hyperparameters"] = {k: v for k, v in asdict(sc).items() if k != "name"}
    return result


# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------


def ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def kl_per_token(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) for each position."""
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1)


# --------------------------------------------------------------------------------------------
# stages
# --------------------------------------------------------------------------------------------


def train_verifier(cfg: RunConfig) -> None:
    sc = cfg.verifier
    seed_everything(cfg.seed * 1000 + STAGE_INDEX["verifier"])
    train_tokens = load_tokens(cfg, "train")
    model = build_model(VERIFIER_SHAPE, self_draft_layers=SELF_DRAFT_LAYERS)
    log(f"verifier: {count_params(model):,} parameters")
    tap = LayerTap(model.model.layers[SELF_DRAFT_LAYERS - 1])
    aux_weight = sc.extra.get("early_exit_weight", 0.3)

    def loss_fn(step: int) -> tuple[torch.Tensor, dict[str, float], int]:
        x = random_windows(train_tokens, step_rng(cfg.seed, "verifier", step),
                           sc.batch_size, SEQ_LEN + 1)
        inputs, labels = x[:, :-1], x[:, 1:]
        hidden = model.model(input_ids=inputs).last_hidden_state
        main = ce(model.lm_head(hidden), labels)
        assert tap.value is not None
        early = ce(early_exit_logits(model, tap.value), labels)
        return main + aux_weight * early, {"ce": main.item(), "early_ce": early.item()}, \
            inputs.numel()

    result = train_stage(cfg, sc, model, loss_fn)
    tap.remove()
    result["early_exit_weight"] = aux_weight
    result["self_draft_layers"] = SELF_DRAFT_LAYERS
    result["architecture"] = shape_of(model)
    result["eval"] = evaluate_verifier(cfg, model)
    save_model(cfg, model, "verifier")
    update_metrics(cfg, "verifier", result)
    log(f"verifier eval: {result['eval']}")


def train_draft(cfg: RunConfig) -> None:
    sc = cfg.draft
    seed_everything(cfg.seed * 1000 + STAGE_INDEX["draft"])
    train_tokens = load_tokens(cfg, "train")
    teacher = load_model(cfg.out / "verifier").eval().requires_grad_(False)
    model = build_model(DRAFT_SHAPE)
    log(f"draft: {count_params(model):,} parameters")
    ce_weight = sc.extra.get("ce_weight", 0.1)

    def loss_fn(step: int) -> tuple[torch.Tensor, dict[str, float], int]:
        x = random_windows(train_tokens, step_rng(cfg.seed, "draft", step),
                           sc.batch_size, SEQ_LEN + 1)
        inputs, labels = x[:, :-1], x[:, 1:]
        with torch.no_grad():
            t_logits = teacher(input_ids=inputs).logits
        s_logits = model(input_ids=inputs).logits
        kl = kl_per_token(t_logits, s_logits).mean()
        hard = ce(s_logits, labels)
        return kl + ce_weight * hard, {"kl": kl.item(), "ce": hard.item()}, inputs.numel()

    result = train_stage(cfg, sc, model, loss_fn)
    result["ce_weight"] = ce_weight
    result["architecture"] = shape_of(model)
    result["eval"] = evaluate_draft(cfg, model, teacher)
    save_model(cfg, model, "draft")
    update_metrics(cfg, "draft", result)
    log(f"draft eval: {result['eval']}")


def train_parallel(cfg: RunConfig) -> None:
    sc = cfg.parallel
    seed_everything(cfg.seed * 1000 + STAGE_INDEX["parallel"])
    train_tokens = load_tokens(cfg, "train")
    teacher = load_model(cfg.out / "verifier").eval().requires_grad_(False)
    model = load_model(cfg.out / "draft")  # initialise from the distilled draft
    model.config.mask_token_id = MASK_ID
    model.config.parallel_draft_max_k = PARALLEL_MAX_K
    log(f"parallel_draft: {count_params(model):,} parameters (initialised from draft)")
    ce_weight = sc.extra.get("ce_weight", 0.1)
    mask_weight = sc.extra.get("mask_weight", 1.0)
    batch_tokens = sc.batch_size * SEQ_LEN

    def loss_fn(step: int) -> tuple[torch.Tensor, dict[str, float], int]:
        inputs, real, labels, is_mask = parallel_batch(
            train_tokens, step_rng(cfg.seed, "parallel", step), batch_tokens)
        # the teacher sees the true tokens: at every position i it gives the distribution of
        # x[i+1] given x[:i+1], which is the soft target for both prefix and mask outputs
        with torch.no_grad():
            t_logits = teacher(input_ids=real).logits
        s_logits = model(input_ids=inputs).logits
        hard = F.cross_entropy(s_logits.transpose(1, 2).float(), labels, reduction="none")
        per_tok = kl_per_token(t_logits, s_logits) + ce_weight * hard
        prefix_loss = per_tok[~is_mask].mean()
        mask_loss = per_tok[is_mask].mean()
        scalars = {"prefix": prefix_loss.item(), "mask": mask_loss.item(),
                   "ce": hard[~is_mask].mean().item(), "mask_ce": hard[is_mask].mean().item()}
        return prefix_loss + mask_weight * mask_loss, scalars, inputs.numel()

    result = train_stage(cfg, sc, model, loss_fn)
    result["ce_weight"] = ce_weight
    result["mask_weight"] = mask_weight
    result["architecture"] = shape_of(model)
    result["eval"] = evaluate_parallel(cfg, model)
    save_model(cfg, model, "parallel_draft")
    update_metrics(cfg, "parallel_draft", result)
    log(f"parallel_draft eval: {result['eval']}")


@torch.no_grad()
def verifier_trajectories(cfg: RunConfig, teacher: torch.nn.Module
                          ) -> list[tuple[int, torch.Tensor]]:
    """Greedy continuations of training-set prompts by the verifier (cached in .work).

    Speculative decoding drafts along the verifier's own trajectory, which differs from human
    text (a small model's greedy output is repetitive), so the drafts are fine-tuned on it:
    sequence-level distillation, as Medusa/EAGLE do with self-generated data. Prompts come from
    the training split only; batch i is a pure function of (seed, i). Returns a list of
    (prompt length, token tensor [rows, prompt + new]).
    """
    sd = cfg.selfdistill
    defs = sd.extra["prompts"] == "defs"
    path = cfg.work / ("trajectories_defs.pt" if defs else "trajectories.pt")
    batches = torch.load(path) if path.exists() else []
    tokens = None if defs else load_tokens(cfg, "train")
    sources = def_sources(cfg) if defs else None
    total = int(sd.extra["batches"])
    for i in tqdm(range(len(batches), total), desc="trajectories", ncols=110,
                  initial=len(batches), total=total):
        rng = np.random.default_rng([cfg.seed, STAGE_INDEX["selfdistill"], i])
        if defs:
            prompt_len = int(rng.choice([16, 32, 48, 64]))
            prompts = def_prompts(sources, rng, sd.batch_size * 4, prompt_len)
        else:
            prompt_len = int(rng.choice([16, 32, 64, 128]))
            prompts = random_windows(tokens, rng, sd.batch_size * 4, prompt_len)
        out = teacher.generate(prompts, attention_mask=torch.ones_like(prompts),
                               do_sample=False, max_new_tokens=int(sd.extra["new_tokens"]),
                               min_new_tokens=int(sd.extra["new_tokens"]),
                               pad_token_id=PAD_ID)
        batches.append((prompt_len, out))
        if (i + 1) % 8 == 0 or i + 1 == total:  # resumable
            torch.save(batches, path)
    return batches[:total]


def def_sources(cfg: RunConfig) -> tuple[object, Path, list[str]]:
    """(tokenizer, stdlib dir, training files) for ``def_prompts``, loaded once per run."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(cfg.out / "verifier" / "tokenizer.json"))
    root = Path(load_json(cfg.out / "split.json")["stdlib_dir"])
    return tok, root, split_files(cfg)[0]


def def_prompts(sources: tuple[object, Path, list[str]], rng: np.random.Generator, rows: int,
                length: int) -> torch.Tensor:
    """Prompts that open a ``def``/``class`` line of a training file, as the held-out
    snippets do (bench / eval prompts): the draft agrees with the verifier less often on
    function-body continuations (0.80) than after random windows (0.86)."""
    tok, root, train = sources
    out: list[list[int]] = []
    while len(out) < rows:
        lines = read_source(root / train[int(rng.integers(len(train)))]).splitlines(True)
        starts = [j for j, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        if starts:
            ids = tok.encode("".join(lines[starts[int(rng.integers(len(starts)))]:])[:2000]).ids
            if len(ids) >= length:
                out.append(ids[:length])
    return torch.tensor(out, dtype=torch.int64)


def train_selfdistill(cfg: RunConfig) -> None:
    """Fine-tune ``draft`` and ``parallel_draft`` on the verifier's greedy trajectories."""
    sd = cfg.selfdistill
    seed_everything(cfg.seed * 1000 + STAGE_INDEX["selfdistill"])
    teacher = load_model(cfg.out / "verifier").eval().requires_grad_(False)
    teacher.generation_config.eos_token_id = None  # fixed-length continuations
    batches = verifier_trajectories(cfg, teacher)
    n_new = int(sd.extra["new_tokens"])
    log(f"selfdistill: {len(batches)} trajectory batches, "
        f"{sum(b.shape[0] for _, b in batches) * n_new:,} generated tokens")
    hard_weight = sd.extra["hard_weight"]

    def pick(step: int) -> tuple[np.random.Generator, int, torch.Tensor]:
        rng = step_rng(cfg.seed, "selfdistill", step)
        prompt_len, seqs = batches[int(rng.integers(len(batches)))]
        rows = torch.from_numpy(rng.choice(seqs.shape[0], sd.batch_size, replace=False))
        return rng, prompt_len, seqs[rows]

    def distill_loss(s_logits: torch.Tensor, t_logits: torch.Tensor, labels: torch.Tensor,
                     generated: torch.Tensor) -> torch.Tensor:
        # KL everywhere; on the verifier's own tokens also CE towards its greedy choice
        hard = F.cross_entropy(s_logits.transpose(1, 2).float(), labels, reduction="none")
        return kl_per_token(t_logits, s_logits) + hard_weight * hard * generated

    for name, parallel in (("draft", False), ("parallel_draft", True)):
        model = load_model(cfg.out / name).train()
        stage = StageConfig(f"selfdistill_{name}", sd.minutes / 2, sd.max_steps, sd.batch_size,
                            sd.lr, sd.warmup_steps, extra=sd.extra)

        def loss_fn(step: int, model: torch.nn.Module = model, parallel: bool = parallel
                    ) -> tuple[torch.Tensor, dict[str, float], int]:
            rng, prompt_len, x = pick(step)
            if parallel:  # cut inside the continuation, then mask the tail as in PARD
                x = x[:, :int(rng.integers(prompt_len + PARALLEL_MAX_K, x.shape[1])) + 1]
                inputs, real, labels, is_mask = mask_tail(x, rng)
            else:
                inputs, real, labels = x[:, :-1], x[:, :-1], x[:, 1:]
                is_mask = torch.zeros_like(inputs, dtype=torch.bool)
            generated = (torch.arange(labels.shape[1]) >= prompt_len - 1).float()
            with torch.no_grad():
                t_logits = teacher(input_ids=real).logits
            s_logits = model(input_ids=inputs).logits
            per_tok = distill_loss(s_logits, t_logits, labels, generated)
            agree = (s_logits.argmax(-1) == t_logits.argmax(-1)).float()
            loss = per_tok[~is_mask].mean()
            scalars = {"agree_gen": agree[:, prompt_len:][~is_mask[:, prompt_len:]].mean().item()}
            if parallel:
                loss = loss + per_tok[is_mask].mean()
                scalars["agree_mask"] = agree[is_mask].mean().item()
            return loss, scalars, inputs.numel()

        result = train_stage(cfg, stage, model, loss_fn)
        save_model(cfg, model, name)
        update_metrics(cfg, f"selfdistill_{name}", result)
        # each run of this stage continues from the folder's weights: keep every round
        rounds = load_json(cfg.out / "training_metrics.json").get("selfdistill_rounds", [])
        update_metrics(cfg, "selfdistill_rounds", [*rounds, {
            "model": name, "batches": int(sd.extra["batches"]), "prompts": sd.extra["prompts"],
            "lr": sd.lr,
            "steps": result["steps"], "tokens_seen": result["tokens_seen"],
            "wall_seconds": result["wall_seconds"],
            "agreement_ema": result["final_train_scalars_ema"],
            "command": "python lab/train_demo_models.py " + " ".join(sys.argv[1:])}])


# --------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------


def batched(x: torch.Tensor, size: int = 8) -> list[torch.Tensor]:
    return list(x.split(size))


@torch.no_grad()
def evaluate_verifier(cfg: RunConfig, model: torch.nn.Module) -> dict:
    model.eval()
    windows = eval_windows(load_tokens(cfg, "heldout"), cfg.eval_sequences)
    n_layers = model.config.self_draft_layers
    tap = LayerTap(model.model.layers[n_layers - 1])
    main_sum = early_sum = 0.0
    for x in batched(windows):
        inputs, labels = x[:, :-1], x[:, 1:]
        hidden = model.model(input_ids=inputs).last_hidden_state
        assert tap.value is not None
        main_sum += ce(model.lm_head(hidden), labels).item() * x.shape[0]
        early_sum += ce(early_exit_logits(model, tap.value), labels).item() * x.shape[0]
    tap.remove()
    n = windows.shape[0]
    return {"heldout_tokens": n * SEQ_LEN, "heldout_loss": round(main_sum / n, 4),
            "heldout_ppl": round(math.exp(main_sum / n), 2),
            f"early_exit_{n_layers}_layers_heldout_loss": round(early_sum / n, 4),
            f"early_exit_{n_layers}_layers_heldout_ppl": round(math.exp(early_sum / n), 2)}


@torch.no_grad()
def evaluate_draft(cfg: RunConfig, model: torch.nn.Module, teacher: torch.nn.Module) -> dict:
    model.eval()
    windows = eval_windows(load_tokens(cfg, "heldout"), cfg.eval_sequences)
    loss_sum = kl_sum = 0.0
    for x in batched(windows):
        inputs, labels = x[:, :-1], x[:, 1:]
        logits = model(input_ids=inputs).logits
        loss_sum += ce(logits, labels).item() * x.shape[0]
        kl_sum += kl_per_token(teacher(input_ids=inputs).logits, logits).mean().item() \
            * x.shape[0]
    n = windows.shape[0]
    return {"heldout_tokens": n * SEQ_LEN, "heldout_loss": round(loss_sum / n, 4),
            "heldout_ppl": round(math.exp(loss_sum / n), 2),
            "heldout_kl_from_verifier": round(kl_sum / n, 4)}


@torch.no_grad()
def evaluate_parallel(cfg: RunConfig, model: torch.nn.Module) -> dict:
    """Held-out CE of the plain next-token output and of each mask offset (K = 8)."""
    model.eval()
    windows = eval_windows(load_tokens(cfg, "heldout"), cfg.eval_sequences)
    n_masks = PARALLEL_MAX_K - 1
    plain_sum = 0.0
    offset_sums = np.zeros(PARALLEL_MAX_K)
    for x in batched(windows):
        inputs, labels = x[:, :-1], x[:, 1:]
        plain_sum += ce(model(input_ids=inputs).logits, labels).item() * x.shape[0]
        masked = inputs.clone()
        masked[:, -n_masks:] = MASK_ID
        logits = model(input_ids=masked).logits[:, -PARALLEL_MAX_K:]
        for j in range(PARALLEL_MAX_K):
            offset_sums[j] += ce(logits[:, j], labels[:, -PARALLEL_MAX_K + j]).item() \
                * x.shape[0]
    n = windows.shape[0]
    return {"heldout_tokens": n * SEQ_LEN, "heldout_loss": round(plain_sum / n, 4),
            "heldout_ppl": round(math.exp(plain_sum / n), 2),
            "heldout_loss_by_offset_k8": [round(float(v) / n, 4) for v in offset_sums],
            "note": "offset 0 = next token from the last real token; offset j = j-th mask"}


@torch.no_grad()
def agreement_report(cfg: RunConfig) -> dict:
    """Teacher-forced greedy agreement with the verifier on held-out prompts."""
    verifier = load_model(cfg.out / "verifier").eval()
    draft = load_model(cfg.out / "draft").eval()
    parallel = load_model(cfg.out / "parallel_draft").eval()
    n_layers = int(verifier.config.self_draft_layers)
    windows = eval_windows(load_tokens(cfg, "heldout"), cfg.agreement_prompts)
    inputs, labels = windows[:, :-1], windows[:, 1:]
    v_logits = verifier(input_ids=inputs).logits
    v_arg = v_logits.argmax(-1)
    sd_logits = self_draft_forward(verifier, inputs, n_layers)
    # the runtime-style truncated forward must match the hook used in training
    tap = LayerTap(verifier.model.layers[n_layers - 1])
    verifier(input_ids=inputs)
    assert tap.value is not None
    tap_logits = early_exit_logits(verifier, tap.value)
    tap.remove()
    assert (tap_logits - sd_logits).abs().max().item() < 1e-3
    d_arg = draft(input_ids=inputs).logits.argmax(-1)
    p_arg = parallel(input_ids=inputs).logits.argmax(-1)
    sd_arg = sd_logits.argmax(-1)

    def frac(a: torch.Tensor, b: torch.Tensor) -> float:
        return round((a == b).float().mean().item(), 4)

    # parallel draft with K = 8 at a grid of cut points: input x[:c] + [mask] * 7
    n_masks = PARALLEL_MAX_K - 1
    cuts = list(range(32, SEQ_LEN - n_masks + 1, 16))
    match = np.zeros(PARALLEL_MAX_K)
    match_true = np.zeros(PARALLEL_MAX_K)
    prefix_accept = np.zeros(PARALLEL_MAX_K + 1)
    for c in cuts:
        masked = torch.cat([inputs[:, :c], torch.full((inputs.shape[0], n_masks), MASK_ID)], 1)
        prop = parallel(input_ids=masked).logits[:, c - 1:].argmax(-1)  # predicts x[c .. c+7]
        target_v = v_arg[:, c - 1:c - 1 + PARALLEL_MAX_K]  # verifier argmax for x[c+j]
        target_true = labels[:, c - 1:c - 1 + PARALLEL_MAX_K]
        eq = (prop == target_v)
        match += eq.float().sum(0).numpy()
        match_true += (prop == target_true).float().sum(0).numpy()
        accepted = eq.int().cumprod(1).sum(1)  # teacher-forced run length of agreement
        for a in accepted.tolist():
            prefix_accept[a] += 1
    total = len(cuts) * inputs.shape[0]
    accepted_mean = float((np.arange(PARALLEL_MAX_K + 1) * prefix_accept).sum() / total)
    return {
        "prompts": int(inputs.shape[0]),
        "positions_per_prompt": SEQ_LEN,
        "verifier_top1_accuracy": frac(v_arg, labels),
        "draft_vs_verifier": frac(d_arg, v_arg),
        "draft_top1_accuracy": frac(d_arg, labels),
        f"self_draft_{n_layers}_layers_vs_verifier": frac(sd_arg, v_arg),
        "self_draft_top1_accuracy": frac(sd_arg, labels),
        "parallel_next_token_vs_verifier": frac(p_arg, v_arg),
        "parallel_k8_cuts": len(cuts) * int(inputs.shape[0]),
        "parallel_k8_offset_vs_verifier": [round(float(m) / total, 4) for m in match],
        "parallel_k8_offset_top1_accuracy": [round(float(m) / total, 4) for m in match_true],
        "parallel_first_mask_vs_verifier": round(float(match[1]) / total, 4),
        "parallel_k8_mean_agreeing_prefix": round(accepted_mean, 3),
        "note": ("teacher-forced on held-out text; offset 0 is the last real token's output, "
                 "offset j the j-th mask; compared with the verifier's argmax at the same "
                 "target position given the true context"),
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def write_report(cfg: RunConfig) -> None:
    agreement = agreement_report(cfg)
    update_metrics(cfg, "agreement", agreement)
    sizes = {name: dir_size(cfg.out / name) for name in ("verifier", "draft", "parallel_draft")}
    gitignore = cfg.out / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text(".work/\n")
    # model card + metrics count toward the total; write once, measure, then finalise
    update_metrics(cfg, "sizes_bytes", sizes)
    (cfg.out / "MODEL_CARD.md").write_text(model_card(load_json(cfg.out /
                                                                 "training_metrics.json")))
    sizes["total_models_demo"] = dir_size(cfg.out)
    update_metrics(cfg, "sizes_bytes", sizes)
    metrics = load_json(cfg.out / "training_metrics.json")
    (cfg.out / "MODEL_CARD.md").write_text(model_card(metrics))
    log(f"agreement: {json.dumps(agreement)}")
    log(f"sizes: {sizes}")
    assert dir_size(cfg.out) <= 40 * 1024 * 1024, "models/demo exceeds 40 MB"


def fmt_int(x: object) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def later_runs(m: dict) -> list[str]:
    """The commands of the self-distillation runs after the first (``--stage all``) one, in
    order, each once (a run trains both drafts)."""
    runs = [r["command"] for r in m.get("selfdistill_rounds", [])
            if "--stage selfdistill" in r.get("command", "")]
    return list(dict.fromkeys(runs))


def model_card(m: dict) -> str:
    corpus, tok = m.get("corpus", {}), m.get("tokenizer", {})
    lines = [
        "# paradraft demo models",
        "",
        "Tiny models trained from scratch on CPU by `lab/train_demo_models.py` so the",
        "speculative-decoding runtime has a verifier and draft models to work with. They are",
        "toys: useful for exercising the code paths and for measuring acceptance rates, not",
        "for generating good code.",
        "",
        "Regenerate with:",
        "",
        "```bash",
        m.get("command", "python lab/train_demo_models.py --out models/demo --seed 0"),
        *later_runs(m),
        "```",
        "",
        "Each stage stops on a wall-clock budget (`--*-minutes`), so how many steps fit depends "
        "on the machine. To repeat the first command's step counts from the random seed, add "
        + " ".join(f"`--{flag}-steps {m[key]['steps']}`" for flag, key in (
            ("verifier", "verifier"), ("draft", "draft"), ("parallel", "parallel_draft"))
            if key in m and "steps" in m[key])
        + ". The self-distillation runs split one budget between the two drafts. A run "
        "recorded with another `--out` ran in a copy of the folder whose drafts then "
        "replaced the shipped ones: repeat it with the first command's `--out`.",
        "",
        "## Corpus",
        "",
        f"- Python {corpus.get('python_version')} standard library `.py` sources "
        f"(`{corpus.get('stdlib_dir')}`), excluding directories "
        f"{', '.join('`' + d + '`' for d in corpus.get('excluded_dirs', []))}.",
        f"- {fmt_int(corpus.get('n_files'))} files: {fmt_int(corpus.get('n_train_files'))} train "
        f"({fmt_int(corpus.get('train_bytes'))} bytes), {fmt_int(corpus.get('n_heldout_files'))}"
        f" held-out ({fmt_int(corpus.get('heldout_bytes'))} bytes). Split by file: "
        f"{corpus.get('rule')} (seed {corpus.get('seed')}); the list is in `split.json`.",
        f"- Tokens: {fmt_int(tok.get('train_tokens'))} train, "
        f"{fmt_int(tok.get('heldout_tokens'))} held-out (documents joined with "
        "`<|endoftext|>`).",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (`tokenizers`), vocabulary {fmt_int(tok.get('vocab_size'))}, ByteLevel "
        "pre-tokenizer (`add_prefix_space=False`) and decoder, so decoding round-trips source "
        "text exactly. Special tokens: `<|endoftext|>` = 0 (bos/eos/document separator), "
        "`<pad>` = 1, `<mask>` = 2 (parallel draft). No special tokens are added by `encode`. "
        "Each model folder carries a copy (`AutoTokenizer.from_pretrained(folder)`).",
        "",
        "## Models",
        "",
        "All are `LlamaForCausalLM` with tied input/output embeddings, RoPE theta 10000, "
        f"max positions {MAX_POSITIONS}, RMSNorm eps 1e-5, stored in float16 "
        "(`model.safetensors`). Trained in fp32 on a shared 2-core CPU (torch threads re-picked "
        "between 1 and 2 from measured step times), AdamW, linear warmup + cosine decay over "
        "the stage's wall-clock/step budget. \"train CE\" is the EMA of the plain next-token "
        "cross-entropy on training batches (the optimised objective also has the early-exit / "
        "distillation / mask terms described below); held-out numbers use "
        f"{m.get('verifier', {}).get('eval', {}).get('heldout_tokens', '?')} held-out tokens "
        f"(fixed, evenly spaced windows of {SEQ_LEN}).",
        "",
        "| model | layers | hidden | heads / kv | ffn | params | steps | tokens seen | wall | "
        "train CE (EMA) | held-out CE | held-out ppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ("verifier", "draft", "parallel_draft"):
        r = m.get(key)
        if not r:
            continue
        a, e = r["architecture"], r["eval"]
        lines.append(
            f"| `{key}` | {a['num_hidden_layers']} | {a['hidden_size']} | "
            f"{a['num_attention_heads']} / {a['num_key_value_heads']} | "
            f"{a['intermediate_size']} | {a['parameters']:,} | {r['steps']} | "
            f"{r['tokens_seen']:,} | {r['wall_seconds'] / 60:.1f} min | "
            f"{r['final_train_scalars_ema'].get('ce')} | {e['heldout_loss']} | "
            f"{e['heldout_ppl']} |")
    v = m.get("verifier")
    if v:
        n = v["self_draft_layers"]
        e = v["eval"]
        lines += [
            "",
            "### verifier",
            "",
            f"Causal LM loss plus an early-exit loss (weight {v['early_exit_weight']}): the "
            f"hidden state after layer {n} goes through the final norm and the LM head and gets "
            "a next-token cross-entropy. `config.json` records `\"self_draft_layers\": "
            f"{n}`: the first {n} layer(s) + final norm + LM head form a self-draft. "
            f"Early-exit held-out loss {e[f'early_exit_{n}_layers_heldout_loss']} "
            f"(ppl {e[f'early_exit_{n}_layers_heldout_ppl']}).",
            f"Batch {v['hyperparameters']['batch_size']} x {SEQ_LEN}, peak LR "
            f"{v['hyperparameters']['lr']}, stopped by {v['stop_reason']}.",
        ]
    d = m.get("draft")
    if d:
        lines += [
            "",
            "### draft",
            "",
            "Distilled from the verifier: loss = KL(verifier || draft) per token + "
            f"{d['ce_weight']} x CE on the data (verifier frozen, eval mode). Held-out KL from "
            f"the verifier {d['eval']['heldout_kl_from_verifier']}. Batch "
            f"{d['hyperparameters']['batch_size']} x {SEQ_LEN}, peak LR "
            f"{d['hyperparameters']['lr']}, stopped by {d['stop_reason']}.",
        ]
    p = m.get("parallel_draft")
    if p:
        lines += [
            "",
            "### parallel_draft",
            "",
            "PARD-style parallel draft, initialised from `draft`. At inference the input is the "
            "context followed by `<mask>` x (K-1) (`mask_token_id` 2, K <= "
            f"{PARALLEL_MAX_K} = `parallel_draft_max_k`); the output at the last real token "
            "predicts the next token and the output at the j-th mask predicts the token j+1 "
            "positions after the last real token. Training: windows of 64/128/256 tokens "
            "with the last k-1 tokens (k uniform in [2, 8]) replaced by `<mask>`; every "
            "position is trained towards the verifier's distribution for the same target token "
            f"given the true context (KL) + {p['ce_weight']} x CE; prefix and mask positions are "
            f"averaged separately and summed (mask weight {p['mask_weight']}).",
            "Held-out CE by offset with K = 8 (0 = next token, j = j-th mask): "
            f"{p['eval']['heldout_loss_by_offset_k8']}.",
        ]
    sd = {k: m[f"selfdistill_{k}"] for k in ("draft", "parallel_draft")
          if f"selfdistill_{k}" in m}
    if sd:
        h = next(iter(sd.values()))["hyperparameters"]
        rows, extra = h["batch_size"] * 4, dict(h["extra"])
        # the largest random-window trajectory set any round used (rounds only extend it)
        windows = [r["batches"] for r in m.get("selfdistill_rounds", [])
                   if r.get("prompts", "windows") == "windows"]
        extra["batches"] = max(windows or [extra["batches"]])
        lines += [
            "",
            "### self-distillation (both drafts, after the stages above)",
            "",
            "Speculative decoding drafts along the verifier's own greedy trajectory, and a small "
            "model's greedy text is far more repetitive than the corpus. So both drafts are "
            f"then fine-tuned on {fmt_int(extra['batches'] * rows)} greedy continuations "
            f"({extra['new_tokens']} tokens each, "
            f"{fmt_int(extra['batches'] * rows * extra['new_tokens'])} generated tokens) of "
            "training-split prompts of 16/32/64/128 tokens: "
            "KL(verifier || draft) at every position plus "
            f"{extra['hard_weight']} x CE towards the verifier's greedy token on the generated "
            "positions (the parallel draft with PARD masking, cut inside the continuation). "
            f"Batch {h['batch_size']}; peak LR per round below.",
            "",
            "Each run of the stage continues from the folder's weights; the shipped drafts went "
            "through the rounds below in order (the commands are in `training_metrics.json`; a "
            "round with more trajectory batches extends the cached set, whose batch i depends "
            "only on the random seed and i). Prompts `windows`: random training windows as above; "
            "`defs` (`--selfdistill-prompts defs`, its own cached set): the first 16/32/48/64 "
            "tokens from the opening of a `def`/`class` line of a training file, as the "
            "held-out snippets that bench/eval prompt with.",
            "",
            "| round | model | prompts | trajectory batches | peak LR | steps | tokens seen | "
            "wall | greedy agreement on trajectories (EMA) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rounds = m.get("selfdistill_rounds") or [
            {"model": key, "batches": extra["batches"], "lr": h["lr"], "steps": r["steps"],
             "tokens_seen": r["tokens_seen"], "wall_seconds": r["wall_seconds"],
             "agreement_ema": r["final_train_scalars_ema"]} for key, r in sd.items()]
        for i, r in enumerate(rounds):
            sc = r["agreement_ema"]
            agree = f"next {sc.get('agree_gen')}" + (
                f", masks {sc['agree_mask']}" if "agree_mask" in sc else "")
            lines.append(f"| {i // 2 + 1} | `{r['model']}` | {r.get('prompts', 'windows')} | "
                         f"{r['batches']} | {r['lr']} | "
                         f"{r['steps']} | {r['tokens_seen']:,} | "
                         f"{r['wall_seconds'] / 60:.1f} min | {agree} |")
    ag = m.get("agreement")
    if ag:
        n = m.get("verifier", {}).get("self_draft_layers", 1)
        lines += [
            "",
            "## Greedy agreement with the verifier",
            "",
            f"Teacher-forced on {ag['prompts']} held-out windows of {SEQ_LEN} tokens: fraction "
            "of positions where the drafter's argmax equals the verifier's argmax.",
            "",
            "| drafter | agreement with verifier | top-1 accuracy on data |",
            "|---|---|---|",
            f"| verifier itself | 1.0 | {ag['verifier_top1_accuracy']} |",
            f"| `draft` | {ag['draft_vs_verifier']} | {ag['draft_top1_accuracy']} |",
            f"| self-draft (first {n} layer(s) + norm + head) | "
            f"{ag[f'self_draft_{n}_layers_vs_verifier']} | {ag['self_draft_top1_accuracy']} |",
            f"| `parallel_draft`, next token (no masks) | "
            f"{ag['parallel_next_token_vs_verifier']} | |",
            f"| `parallel_draft`, first `<mask>` (token after next), K = 8 | "
            f"{ag['parallel_first_mask_vs_verifier']} | "
            f"{ag['parallel_k8_offset_top1_accuracy'][1]} |",
            "",
            f"Parallel draft with K = 8 over {ag['parallel_k8_cuts']} cut points: agreement by "
            f"offset {ag['parallel_k8_offset_vs_verifier']}; mean length of the agreeing "
            f"prefix {ag['parallel_k8_mean_agreeing_prefix']} tokens (teacher-forced, so only "
            "a rough proxy for the acceptance length).",
        ]
    sizes = m.get("sizes_bytes", {})
    if sizes:
        lines += ["", "## Sizes", ""]
        lines += [f"- `{k}`: {v / 1e6:.2f} MB" for k, v in sizes.items()]
    lines += ["", f"Seed {m.get('seed')}. Raw numbers: `training_metrics.json`.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> RunConfig:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/demo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stage", choices=("all", *STAGES), default="all")
    ap.add_argument("--resume", action="store_true",
                    help="continue from .work checkpoints; with --stage all, skip done stages")
    ap.add_argument("--verifier-minutes", type=float, default=35.0)
    ap.add_argument("--draft-minutes", type=float, default=12.0)
    ap.add_argument("--parallel-minutes", type=float, default=12.0)
    ap.add_argument("--verifier-steps", type=int, default=None)
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument("--parallel-steps", type=int, default=None)
    ap.add_argument("--selfdistill-minutes", type=float, default=40.0,
                    help="fine-tuning budget on verifier trajectories (split draft/parallel)")
    ap.add_argument("--selfdistill-steps", type=int, default=None)
    ap.add_argument("--selfdistill-batches", type=int, default=160,
                    help="verifier trajectory batches (32 rows each; cached, extendable)")
    ap.add_argument("--selfdistill-lr", type=float, default=1e-3)
    ap.add_argument("--selfdistill-prompts", choices=("windows", "defs"), default="windows",
                    help="trajectory prompts: random training windows, or the openings of "
                         "def/class lines of training files (as the held-out snippets)")
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=2, help="max torch intra-op threads")
    ap.add_argument("--no-thread-tuning", action="store_true",
                    help="always use --threads instead of re-picking 1..threads from step times")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    return RunConfig(
        out=a.out, seed=a.seed, stage=a.stage, resume=a.resume, ckpt_minutes=a.ckpt_minutes,
        max_threads=a.threads, tune_threads=not a.no_thread_tuning,
        heldout_fraction=0.05, eval_sequences=64, agreement_prompts=20,
        verifier=StageConfig("verifier", a.verifier_minutes, a.verifier_steps, batch_size=2,
                             lr=2e-3, warmup_steps=60, extra={"early_exit_weight": 0.3}),
        draft=StageConfig("draft", a.draft_minutes, a.draft_steps, batch_size=4, lr=3e-3,
                          warmup_steps=40, extra={"ce_weight": 0.1}),
        parallel=StageConfig("parallel", a.parallel_minutes, a.parallel_steps, batch_size=4,
                             lr=1.5e-3, warmup_steps=30,
                             extra={"ce_weight": 0.1, "mask_weight": 1.0}),
        selfdistill=StageConfig("selfdistill", a.selfdistill_minutes, a.selfdistill_steps,
                                batch_size=8, lr=a.selfdistill_lr, warmup_steps=20,
                                extra={"batches": a.selfdistill_batches, "new_tokens": 96,
                                       "hard_weight": 1.0, "prompts": a.selfdistill_prompts}),
    )


def stage_done(cfg: RunConfig, stage: str) -> bool:
    metrics = load_json(cfg.out / "training_metrics.json")
    key = {"tokenizer": "tokenizer", "verifier": "verifier", "draft": "draft",
           "parallel": "parallel_draft", "selfdistill": "selfdistill_parallel_draft",
           "report": "agreement"}[stage]
    if stage == "tokenizer":
        return key in metrics and (cfg.work / "tokens_heldout.npy").exists()
    return key in metrics


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    cfg.work.mkdir(parents=True, exist_ok=True)
    gitignore = cfg.out / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text(".work/\n")
    update_metrics(cfg, "seed", cfg.seed)
    if cfg.stage == "all" and not cfg.resume:
        update_metrics(cfg, "command", "python lab/train_demo_models.py "
                       + " ".join(sys.argv[1:] if argv is None else argv))
    update_metrics(cfg, "environment", {
        "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "platform": platform.platform()})
    stages = STAGES if cfg.stage == "all" else (cfg.stage,)
    runners = {"tokenizer": train_tokenizer, "verifier": train_verifier, "draft": train_draft,
               "parallel": train_parallel, "selfdistill": train_selfdistill,
               "report": write_report}
    t0 = time.time()
    for stage in stages:
        if cfg.resume and cfg.stage == "all" and stage_done(cfg, stage):
            log(f"skipping {stage}: already done (--resume)")
            continue
        log(f"=== stage {stage} ===")
        runners[stage](cfg)
    log(f"all requested stages finished in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
