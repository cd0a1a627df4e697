"""Train a small draft for a verifier on the verifier's own outputs (DistillSpec-style).

Four phases, each resumable from ``<out>/.work/``:

1. **Data.** The verifier continues chat prompts, greedy and sampled, through our own
   ``SpeculativeDecoder`` in plain (no-draft) mode. Prompts come from a JSONL file
   (``{"messages": [...]}`` through the chat template, or a raw ``{"prompt": "..."}``), or
   the verifier writes them itself: it answers seed instructions over a list of topics
   (questions to ask, paragraphs, small programs), and its paragraphs and programs become the
   inputs of input-grounded tasks (summarize, rewrite, fix, explain). Held-out prompts (a
   topic, or a prompt of the file, chosen by hash) never reach training.
2. **Teacher targets.** One teacher-forced pass of the verifier over the training sequences
   keeps its top-k next-token distribution at every generated position.
3. **Training.** The draft learns the verifier's distribution: cross-entropy towards its
   top-k at the generated positions (forward KL up to the teacher's entropy; with
   ``teacher_topk=0``, towards the tokens it emitted, greedy ones being its argmax and sampled
   ones draws from it), plus a small weight on the prompt's own tokens. ``parallel`` trains a
   PARD draft: the last k−1 inputs of each window are the mask token, and every output still
   predicts the next real token.
4. **Check.** Held-out acceptance with the real decoder: greedy rule, the draft at K=4.

The draft is a standard ``LlamaForCausalLM`` with the verifier's tokenizer and full vocabulary
and a tied embedding started from the verifier's, projected onto its top principal directions
when the draft is narrower.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..checkpoints import chat_stop_token_ids, format_chat, load_draft, load_tokenizer
from ..correction import RuleParams
from ..drafters import Drafter
from ..model import Transformer, load_config, load_model, new_kv_cache
from ..speculative import SpeculativeDecoder
from .train_loop import Schedule, train_loop

KINDS = ("model", "parallel")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "tokenizer.model")
PARALLEL_MAX_K = 8

# What the verifier writes its own prompts from: instructions over topics. Topics are the
# unit of the held-out split, so a held-out task's input text was never trained on.
TOPICS = (
    "the water cycle", "black holes", "photosynthesis", "the French Revolution", "volcanoes",
    "machine learning", "healthy sleep", "saving money", "learning a language", "the Moon",
    "climate change", "the human heart", "ancient Rome", "electric cars", "honey bees",
    "the internet", "vaccines", "chess", "coffee", "the ocean", "earthquakes", "democracy",
    "renewable energy", "dinosaurs", "the immune system", "music theory", "gardening",
    "time management", "the stock market", "recycling", "rainforests", "the solar system",
    "writing a resume", "public speaking", "cooking pasta", "bicycles", "friendship",
    "the printing press", "electricity", "the brain", "mountains", "deserts", "whales",
    "the Olympic Games", "photography", "programming", "databases", "cryptography",
    "the Great Wall of China", "trees", "weather forecasts", "bread baking", "meditation",
    "exercise", "airplanes", "the history of writing", "robots", "nutrition", "rivers",
    "volunteering", "smartphones", "museums", "libraries", "rain", "the desert fox",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "returns the largest number in a list", "computes the factorial of n",
    "merges two sorted lists", "removes duplicates from a list", "checks for a palindrome",
    "returns the n-th Fibonacci number", "sums the digits of an integer",
    "converts Celsius to Fahrenheit", "finds the most common word in a text",
    "flattens a nested list", "counts the words in a sentence", "computes an average",
    "sorts a list of names by length", "checks whether a year is a leap year",
    "returns the squares of the even numbers in a list", "capitalizes every word",
    "finds the index of an item in a list",
)
QUESTION_INSTRUCTIONS = (
    "Write one question that a curious student might ask about {topic}. "
    "Reply with the question only.",
    "Write a short request that someone might send to an AI assistant about {topic}. "
    "Reply with the request only.",
)
PASSAGE_INSTRUCTIONS = (
    "Write a short paragraph about {topic}.",
    "Write a Python function that {task}.",
)
GROUNDED_TASKS = (
    "Summarize the following text in one or two sentences.\n\n{text}",
    "Rewrite the following text in simpler words.\n\n{text}",
    "Rewrite the following text in a formal tone.\n\n{text}",
    "Fix any spelling or grammar mistakes in the following text and return the corrected "
    "text.\n\n{text}",
    "List the key points of the following text as bullet points.\n\n{text}",
)
CODE_GROUNDED_TASKS = (
    "Explain what this code does.\n\n{text}",
    "Rename the variables in this code to clearer names and return the code.\n\n{text}",
    "Add comments to this code and return it.\n\n{text}",
    "Fix any bugs in this code and return the corrected code.\n\n{text}",
)


@dataclass
class DistillConfig:
    verifier: str
    out: str
    kind: str = "model"
    prompts: str | None = None
    minutes: float = 60.0
    data_share: float = 0.5  # of ``minutes`` for data generation (the rest: training)
    max_sequences: int | None = None  # stop data generation after this many sequences
    steps: int | None = None  # stop training after this many steps (default: the budget)
    resume: bool = False
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    gen_batch: int = 32
    max_new_tokens: int = 160
    max_seq_len: int = 512
    temperature: float = 0.8
    sampled_share: float = 0.5  # of training continuations that are sampled, not greedy
    heldout_share: float = 0.1
    batch_rows: int = 8
    train_len: int = 256
    lr: float = 2e-3
    prompt_weight: float = 0.1
    teacher_topk: int = 32  # soft targets: the verifier's top-k distribution (0: its tokens)
    mask_token_id: int | None = None
    eval_prompts: int = 16
    eval_k: int = 4
    eval_new_tokens: int = 96
    save_dtype: str = "bfloat16"
    # the training matmuls: bfloat16 autocast where the CPU has bf16 instructions (AVX512-BF16,
    # AMX: several times faster), float32 elsewhere (emulated bf16 is slower than fp32)
    train_dtype: str = "auto"
    seed: int = 0
    ckpt_minutes: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0; got {self.minutes}")
        if not 0 < self.data_share < 1:
            raise ValueError(f"data_share must be in (0, 1); got {self.data_share}")
        if not 0 <= self.heldout_share < 1:
            raise ValueError(f"heldout_share must be in [0, 1); got {self.heldout_share}")
        if self.save_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"save_dtype must be float32, bfloat16 or float16; got "
                             f"{self.save_dtype!r}")
        if self.train_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"train_dtype must be auto, bfloat16 or float32; got "
                             f"{self.train_dtype!r}")
        if self.teacher_topk < 0:
            raise ValueError(f"teacher_topk must be >= 0; got {self.teacher_topk}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by "
                             f"num_kv_heads; got {self.hidden_size}, {self.num_heads}, "
                             f"{self.num_kv_heads}")

    @property
    def work(self) -> Path:
        return Path(self.out) / ".work"


def is_heldout(key: str, seed: int, share: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def save_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_json(path: Path, default: object) -> object:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else default


# -- prompts ---------------------------------------------------------------------------------


def chat_or_raw(verifier_dir: str, content: str) -> str:
    """A user message through the verifier's chat template, or the raw text without one."""
    try:
        return format_chat(verifier_dir, [{"role": "user", "content": content}])
    except ValueError:
        return content


def read_prompt_file(cfg: DistillConfig) -> list[tuple[str, bool]]:
    """(prompt text, held out) from a JSONL file of {"messages": [...]} or {"prompt": "..."}."""
    out = []
    for i, line in enumerate(Path(cfg.prompts).read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            text = format_chat(cfg.verifier, row["messages"])
        elif "prompt" in row:
            text = row["prompt"]
        else:
            raise ValueError(f"{cfg.prompts} line {i + 1}: expected a 'messages' or 'prompt' "
                             f"field; got {sorted(row)}")
        out.append((text, is_heldout(text, cfg.seed, cfg.heldout_share)))
    if not out:
        raise ValueError(f"{cfg.prompts} holds no prompts")
    return out


def code_block(text: str) -> str:
    """The first fenced code block of an answer, or the answer itself."""
    parts = text.split("```")
    if len(parts) >= 3:
        body = parts[1].split("\n", 1)
        return "```python\n" + (body[1] if len(body) == 2 else body[0]).strip() + "\n```"
    return text.strip()


# -- data ------------------------------------------------------------------------------------


@dataclass
class Generator:
    """The verifier continuing batches of prompts through the plain decoding loop."""

    verifier: Transformer
    verifier_dir: str
    cfg: DistillConfig

    def __post_init__(self) -> None:
        self.tokenizer = load_tokenizer(self.verifier_dir)
        try:
            stops = chat_stop_token_ids(self.verifier_dir)
        except ValueError:  # no chat template: the checkpoint's own end ids
            stops = ()
        self.eos = list(dict.fromkeys([*stops, *self.verifier.config.eos_token_ids]))
        self.decoders: dict[bool, SpeculativeDecoder] = {}

    def decoder(self, greedy: bool) -> SpeculativeDecoder:
        """The plain decoding loop for greedy or sampled rows (its cache made on first use)."""
        if greedy not in self.decoders:
            rule = RuleParams("greedy") if greedy else RuleParams(
                "exact", temperature=self.cfg.temperature)
            self.decoders[greedy] = SpeculativeDecoder(
                self.verifier, None, rule, max_batch_size=self.cfg.gen_batch,
                max_seq_len=self.cfg.max_seq_len)
        return self.decoders[greedy]

    def continue_texts(self, texts: list[str], greedy: bool, seed: int, max_new: int
                       ) -> list[tuple[list[int], int]]:
        """(prompt + continuation ids, prompt length) per text; too long prompts are cut
        from the left so the continuation fits."""
        keep = self.cfg.max_seq_len - max_new
        prompts = [self.tokenizer.encode(t, add_special_tokens=False).ids[-keep:] for t in texts]
        out: list[tuple[list[int], int]] = []
        for start in range(0, len(prompts), self.cfg.gen_batch):
            batch = prompts[start:start + self.cfg.gen_batch]
            result = self.decoder(greedy).generate(batch, max_new, seed=seed + start,
                                                    eos_token_id=self.eos)
            out += [(p + c, len(p)) for p, c in zip(batch, result.token_ids, strict=True)]
        return out

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text.strip()


def data_round(gen: Generator, cfg: DistillConfig, r: int,
               file_prompts: list[tuple[str, bool]] | None) -> list[dict]:
    """Round ``r`` of data: a list of sequences {ids, prompt_len, greedy, heldout}."""
    rng = random.Random(cfg.seed * 1_000_003 + r)
    rows = cfg.gen_batch
    seqs: list[dict] = []

    def run(texts: list[str], held: list[bool], greedy: bool, max_new: int) -> list[dict]:
        done = gen.continue_texts(texts, greedy, cfg.seed * 7919 + r * 131, max_new)
        new = [{"ids": ids, "prompt_len": n, "greedy": greedy, "heldout": h}
               for (ids, n), h in zip(done, held, strict=True)]
        seqs.extend(new)
        return new

    if file_prompts is not None:
        picks = [file_prompts[(r * rows + i) % len(file_prompts)] for i in range(rows)]
        first_pass = r * rows < len(file_prompts)
        # every prompt gets its greedy continuation first, then sampled ones; held-out prompts
        # only ever greedy (the held-out acceptance is measured against the argmax)
        greedy = [first_pass or h or rng.random() >= cfg.sampled_share for _, h in picks]
        for g in (True, False):
            chosen = [(t, h) for (t, h), gg in zip(picks, greedy, strict=True) if gg == g]
            if chosen:
                run([t for t, _ in chosen], [h for _, h in chosen], g, cfg.max_new_tokens)
        return seqs

    # the verifier writes its prompts: questions and passages (sampled, so rounds differ) ...
    topics = [rng.choice(TOPICS) for _ in range(rows)]
    held = [is_heldout(t, cfg.seed, cfg.heldout_share) for t in topics]
    questions = run([chat_or_raw(cfg.verifier, rng.choice(QUESTION_INSTRUCTIONS).format(topic=t))
                     for t in topics], held, False, 48)
    code = [rng.random() < 0.3 for _ in range(rows)]
    tasks = [rng.choice(CODE_TASKS) for _ in range(rows)]
    passage_held = [h or (c and is_heldout(t, cfg.seed, cfg.heldout_share))
                    for h, c, t in zip(held, code, tasks, strict=True)]
    passages = run([chat_or_raw(cfg.verifier, PASSAGE_INSTRUCTIONS[c].format(topic=t, task=k))
                    for c, t, k in zip(code, topics, tasks, strict=True)], passage_held, False,
                   cfg.max_new_tokens)
    # ... then answers them, and does input-grounded tasks over its own passages
    texts, answer_held = [], []
    for q, p, c in zip(questions, passages, code, strict=True):
        question = gen.decode(q["ids"][q["prompt_len"]:]).split("\n")[0]
        passage = gen.decode(p["ids"][p["prompt_len"]:])
        if question:
            texts.append(chat_or_raw(cfg.verifier, question))
            answer_held.append(q["heldout"])
        if passage:
            template = rng.choice(CODE_GROUNDED_TASKS if c else GROUNDED_TASKS)
            texts.append(chat_or_raw(cfg.verifier, template.format(
                text=code_block(passage) if c else passage)))
            answer_held.append(p["heldout"])
    greedy = [h or rng.random() >= cfg.sampled_share for h in answer_held]
    for g in (True, False):
        chosen = [(t, h) for t, h, gg in zip(texts, answer_held, greedy, strict=True) if gg == g]
        if chosen:
            run([t for t, _ in chosen], [h for _, h in chosen], g, cfg.max_new_tokens)
    return seqs


@torch.inference_mode()
def generate_data(cfg: DistillConfig, verifier: Transformer) -> list[dict]:
    """Generate rounds of data until the data budget or ``max_sequences``; appends each round
    to ``.work/data.jsonl`` so a stopped run resumes after its last whole round."""
    data_file, state_file = cfg.work / "data.jsonl", cfg.work / "data_state.json"
    state = load_json(state_file, {"rounds": 0, "seconds": 0.0, "done": False})
    seqs = [json.loads(line) for line in data_file.read_text(encoding="utf-8").splitlines()
            ] if data_file.is_file() else []
    seqs = [s for s in seqs if s["round"] < state["rounds"]]  # drop a half-written round
    budget = cfg.minutes * 60 * cfg.data_share
    # a resumed run with a larger budget (--minutes, --data-share) generates more
    state["done"] = state["done"] and state["seconds"] >= budget and not (
        cfg.max_sequences and len(seqs) < cfg.max_sequences)
    file_prompts = read_prompt_file(cfg) if cfg.prompts else None
    gen = Generator(verifier, cfg.verifier, cfg)
    bar = tqdm(total=round(budget), initial=min(round(state["seconds"]), round(budget)),
               desc="data", unit="s", mininterval=5)
    t0 = time.time() - state["seconds"]
    while not state["done"]:
        if state["seconds"] >= budget or (cfg.max_sequences and len(seqs) >= cfg.max_sequences):
            state["done"] = True
            break
        new = data_round(gen, cfg, state["rounds"], file_prompts)
        with data_file.open("a", encoding="utf-8") as f:
            for s in new:
                f.write(json.dumps({**s, "round": state["rounds"]}) + "\n")
        seqs += [{**s, "round": state["rounds"]} for s in new]
        state["rounds"] += 1
        state["seconds"] = time.time() - t0
        save_json(state_file, state)
        generated = sum(len(s["ids"]) - s["prompt_len"] for s in seqs)
        bar.update(min(round(state["seconds"]), round(budget)) - bar.n)
        bar.set_postfix(rounds=state["rounds"], sequences=len(seqs), generated=generated)
    bar.close()
    save_json(state_file, state)
    return seqs


@torch.inference_mode()
def teacher_targets(cfg: DistillConfig, verifier: Transformer, seqs: list[dict]) -> None:
    """Attach the verifier's top-``teacher_topk`` next-token distribution at every generated
    position of each sequence (``s["teacher"]``: ids [n, k], probabilities [n, k] renormalised
    over the k). A soft target carries the verifier's whole ranking, not only the token it
    emitted, so each generated token teaches the draft more. Teacher-forced in batches of
    similar length; kept in ``.work/teacher.pt`` so a stopped run resumes."""
    k = cfg.teacher_topk
    if k == 0:
        return
    path = cfg.work / "teacher.pt"
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        done = saved["targets"] if saved["topk"] == k else {}
    todo = sorted((i for i in range(len(seqs)) if i not in done),
                  key=lambda i: len(seqs[i]["ids"]))
    rows = 4  # [4, 512, V] fp32 logits is 400 MB for a 49k vocabulary
    bar = tqdm(total=len(seqs), initial=len(done), desc="teacher", unit="seq", mininterval=5)
    last_save = time.time()
    for start in range(0, len(todo), rows):
        chunk = todo[start:start + rows]
        T = max(len(seqs[i]["ids"]) for i in chunk)
        tokens = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, i in enumerate(chunk):
            tokens[b, :len(seqs[i]["ids"])] = torch.tensor(seqs[i]["ids"])
        dtype = next(verifier.parameters()).dtype
        cache = new_kv_cache(verifier.config, len(chunk), T, dtype)
        positions = torch.arange(T).expand(len(chunk), T)
        logits, _ = verifier(tokens, positions, cache, kv_len=T)
        for b, i in enumerate(chunk):
            n, L = seqs[i]["prompt_len"], len(seqs[i]["ids"])
            top = logits[b, n - 1:L - 1].topk(k, dim=-1)  # predictions of tokens n..L-1
            done[i] = (top.indices.to(torch.int32), top.values.softmax(-1).half())
        bar.update(len(chunk))
        if time.time() - last_save > 60:
            torch.save({"topk": k, "targets": done}, path)
            last_save = time.time()
    bar.close()
    torch.save({"topk": k, "targets": done}, path)
    for i, s in enumerate(seqs):
        s["teacher"] = done[i]


# -- the draft -------------------------------------------------------------------------------


def draft_config(cfg: DistillConfig, mask_token_id: int | None) -> dict:
    """The draft's config.json fields: a small Llama on the verifier's vocabulary and ids."""
    v = load_config(cfg.verifier)
    hf = json.loads((Path(cfg.verifier) / "config.json").read_text(encoding="utf-8"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": v.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads, "hidden_act": "silu",
        "max_position_embeddings": v.max_position_embeddings, "rms_norm_eps": v.norm_eps,
        "rope_theta": v.rope_theta, "tie_word_embeddings": True, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": v.bos_token_id,
        "eos_token_id": list(v.eos_token_ids) if len(v.eos_token_ids) > 1 else (
            v.eos_token_ids[0] if v.eos_token_ids else None),
        "pad_token_id": hf.get("pad_token_id"),
    }
    if mask_token_id is not None:
        config.update(mask_token_id=mask_token_id, parallel_draft_max_k=PARALLEL_MAX_K)
    return config


def projected_embedding(verifier: Transformer, width: int) -> torch.Tensor:
    """The verifier's embedding on its top ``width`` principal directions (PCA), so the draft
    starts with the verifier's token geometry; zero-padded when the draft is wider."""
    e = verifier.embed.weight.detach().float()
    if width >= e.shape[1]:
        e = F.pad(e, (0, width - e.shape[1]))
        return e / e.norm(dim=1).mean()
    centered = e - e.mean(0)
    _, vectors = torch.linalg.eigh(centered.T @ centered)  # ascending eigenvalues
    projected = e @ vectors[:, -width:].flip(1)
    # rows of norm about 1: with a tied head the first logits then have unit scale (the
    # verifier's own scale, against a narrower normalised hidden state, saturates them)
    return projected / projected.norm(dim=1).mean()


def new_draft(cfg: DistillConfig, verifier: Transformer, mask_token_id: int | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(LlamaConfig(**draft_config(cfg, mask_token_id)))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(projected_embedding(verifier, cfg.hidden_size))
    return model


def resolve_mask_token(cfg: DistillConfig) -> int | None:
    if cfg.kind != "parallel":
        if cfg.mask_token_id is not None:
            raise ValueError("mask_token_id is for --kind parallel only")
        return None
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    tokenizer_config = load_json(Path(cfg.verifier) / "tokenizer_config.json", {})
    mask = tokenizer_config.get("mask_token")
    mask = mask.get("content") if isinstance(mask, dict) else mask
    token_id = load_tokenizer(cfg.verifier).token_to_id(mask) if mask else None
    if token_id is None:
        raise ValueError(f"the verifier's tokenizer ({cfg.verifier}) has no mask_token: pass "
                         "--mask-token-id (an id the verifier never emits in chat, e.g. an "
                         "unused special token)")
    return token_id


# -- training --------------------------------------------------------------------------------


def batch_of(seqs: list[dict], rng: random.Random, cfg: DistillConfig, pad_id: int,
             mask_token_id: int | None) -> dict[str, torch.Tensor]:
    """One training batch [rows, T]: a window per sequence ending inside its continuation.
    ``labels`` and ``weights``: weight 1 on generated targets, ``prompt_weight`` on prompt
    targets. ``soft_ids`` / ``soft_probs`` [rows, T, k] and ``soft``: the verifier's top-k at
    generated targets, where the sequence has them. PARD: the window's last k−1 inputs become
    the mask token (k uniform in [2, 8]); each output still predicts the next real token, so
    the targets do not change."""
    rows = [rng.choice(seqs) for _ in range(cfg.batch_rows)]
    T, k = cfg.train_len, max(cfg.teacher_topk, 1)
    inputs = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.zeros((len(rows), T), dtype=torch.long)
    weights = torch.zeros((len(rows), T))
    soft_ids = torch.zeros((len(rows), T, k), dtype=torch.long)
    soft_probs = torch.zeros((len(rows), T, k))
    soft = torch.zeros((len(rows), T), dtype=torch.bool)
    for b, s in enumerate(rows):
        ids, n = s["ids"], s["prompt_len"]
        end = rng.randint(min(n + 1, len(ids) - 1), len(ids) - 1)  # last target index
        start = max(0, end - T)
        x = torch.tensor(ids[start:end + 1])
        L = x.numel() - 1
        inputs[b, :L], labels[b, :L] = x[:-1], x[1:]
        target_pos = torch.arange(start + 1, end + 1)
        weights[b, :L] = torch.where(target_pos >= n, 1.0, cfg.prompt_weight)
        if "teacher" in s:
            first = max(n, start + 1)  # the first generated target in the window
            teacher_ids, teacher_probs = s["teacher"]
            span = slice(first - start - 1, L)
            soft_ids[b, span] = teacher_ids[first - n:end + 1 - n].long()
            soft_probs[b, span] = teacher_probs[first - n:end + 1 - n].float()
            soft[b, span] = True
        if mask_token_id is not None:
            m = rng.randint(2, PARALLEL_MAX_K)
            inputs[b, max(0, L - (m - 1)):L] = mask_token_id
    return {"inputs": inputs, "labels": labels, "weights": weights, "soft_ids": soft_ids,
            "soft_probs": soft_probs, "soft": soft}


def target_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The draft's logits [N, V] at the batch's N weighted targets only: the vocabulary head
    is most of a step, and windows are padded to ``train_len``."""
    hidden = model.model(batch["inputs"]).last_hidden_state
    return model.lm_head(hidden[batch["weights"] > 0])


def batch_at_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    keep = batch["weights"] > 0
    return {name: value[keep] for name, value in batch.items() if name != "inputs"}


def distill_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Weighted mean over targets of the cross-entropy towards the verifier: its top-k
    distribution where the batch has one (forward KL up to the teacher's entropy), its token
    elsewhere."""
    logits = logits.float()  # the softmax in fp32 under a bf16 autocast
    log_z = logits.logsumexp(-1)
    hard = log_z - logits.gather(-1, batch["labels"][..., None])[..., 0]
    soft = log_z - (batch["soft_probs"] * logits.gather(-1, batch["soft_ids"])).sum(-1)
    per_token = torch.where(batch["soft"], soft, hard)
    return (per_token * batch["weights"]).sum() / batch["weights"].sum()


def agreement(model, seqs: list[dict], cfg: DistillConfig, mask_token_id: int | None,
              pad_id: int) -> float:
    """Teacher-forced greedy acceptance on held-out greedy continuations: the fraction of
    generated positions where the draft's argmax is the verifier's (the next token). PARD:
    measured at the first mask (the token after next), where the parallel draft differs."""
    hits = total = 0
    model.eval()
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor(s["ids"][-cfg.train_len - 1:])
            n = max(1, s["prompt_len"] - (len(s["ids"]) - ids.numel()))
            if mask_token_id is None:
                pred = model(ids[None, :-1]).logits[0].argmax(-1)
                hits += int((pred[n - 1:] == ids[n:]).sum())
                total += ids.numel() - n
            else:
                for cut in range(n, ids.numel() - 1, 8):  # [..., x_cut, mask] → x_cut+2
                    x = torch.cat([ids[:cut + 1], torch.tensor([mask_token_id])])
                    pred = model(x[None]).logits[0, -1].argmax()
                    hits += int(pred == ids[cut + 2]) if cut + 2 < ids.numel() else 0
                    total += int(cut + 2 < ids.numel())
    model.train()
    return hits / max(total, 1)


def train(cfg: DistillConfig, model, train_seqs: list[dict], heldout: list[dict],
          mask_token_id: int | None, pad_id: int) -> dict:
    """Optimise until ``steps`` or the training budget (the shared ``train_loop``); held-out
    teacher-forced agreement every 50 steps."""
    held = [s for s in heldout if s["greedy"]][:32]
    bf16 = cfg.train_dtype == "bfloat16" or (
        cfg.train_dtype == "auto" and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def loss_fn(step: int) -> tuple[torch.Tensor, dict[str, float], int]:
        batch = batch_of(train_seqs, random.Random(cfg.seed * 1_000_003 + step), cfg, pad_id,
                         mask_token_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = distill_loss(target_logits(model, batch), batch_at_targets(batch))
        return loss, {}, int((batch["weights"] > 0).sum())

    def evaluate() -> dict[str, float]:
        return {"heldout_acceptance": agreement(model, held, cfg, mask_token_id, pad_id)}

    result = train_loop(
        model, loss_fn, Schedule(lr=cfg.lr), ckpt_file=cfg.work / "train_ckpt.pt",
        desc="train", max_steps=cfg.steps,
        budget_s=math.inf if cfg.steps is not None else cfg.minutes * 60 * (1 - cfg.data_share),
        ckpt_minutes=cfg.ckpt_minutes, history_every=50, evaluate=evaluate if held else None)
    result["bf16_autocast"] = bf16
    result["heldout_teacher_forced_acceptance"] = evaluate()["heldout_acceptance"] if held \
        else None
    return result


# -- output and the check --------------------------------------------------------------------


def write_draft(cfg: DistillConfig, model) -> None:
    out = Path(cfg.out)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[cfg.save_dtype]
    model.to(dtype).save_pretrained(out)
    model.float()
    for name in TOKENIZER_FILES:
        src = Path(cfg.verifier) / name
        if src.is_file() and name != "generation_config.json":
            shutil.copy(src, out / name)
    # the verifier's end ids, as the draft's config carries them
    generation = load_json(Path(cfg.verifier) / "generation_config.json", None)
    if generation is not None:
        save_json(out / "generation_config.json", generation)


@torch.inference_mode()
def measured_acceptance(cfg: DistillConfig, verifier: Transformer, draft_dir: Path,
                        heldout: list[dict]) -> dict | None:
    """Greedy rule, K = eval_k, the saved draft through the real decoder, on held-out
    prompts: accepted / drafted, and tokens per verifier step."""
    prompts = [s["ids"][:s["prompt_len"]] for s in heldout if s["greedy"]]
    prompts = list(dict.fromkeys(map(tuple, prompts)))[:cfg.eval_prompts]
    if not prompts:
        return None
    draft = load_draft(draft_dir, cfg.verifier, verifier.config.vocab_size)
    drafter = Drafter(cfg.kind, draft)
    batch = min(8, len(prompts))
    decoder = SpeculativeDecoder(verifier, drafter, RuleParams("greedy"), k=cfg.eval_k,
                                 max_batch_size=batch, max_seq_len=cfg.max_seq_len)
    gen = Generator(verifier, cfg.verifier, cfg)
    accepted = drafted = steps = tokens = 0
    for start in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[start:start + batch]]
        chunk = [p[-(cfg.max_seq_len - cfg.eval_new_tokens):] for p in chunk]
        stats = decoder.generate(chunk, cfg.eval_new_tokens, eos_token_id=gen.eos).stats
        accepted += stats.accepted_tokens
        drafted += stats.draft_tokens
        steps += stats.verify_steps
        tokens += stats.generated_tokens
    return {"prompts": len(prompts), "k": cfg.eval_k, "rule": "greedy",
            "acceptance": round(accepted / max(drafted, 1), 4),
            "tokens_per_verifier_step": round(tokens / max(steps, 1), 3),
            "generated_tokens": tokens}


def distill(cfg: DistillConfig) -> dict:
    """Run (or resume) the three phases; returns the metrics written to distill.json."""
    out = Path(cfg.out)
    if cfg.work.exists() and not cfg.resume:
        raise ValueError(f"{out} holds a run ({cfg.work}): pass --resume to continue it, or "
                         "remove the directory")
    cfg.work.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text(".work/\n", encoding="utf-8")
    saved = load_json(cfg.work / "config.json", None)
    if saved is not None:
        changed = {k: (saved[k], v) for k, v in asdict(cfg).items()
                   if k not in ("resume", "minutes", "data_share", "steps", "max_sequences",
                                "eval_prompts", "train_dtype")
                   and saved.get(k) != v}
        if changed:
            raise ValueError(f"--resume with other settings than the run in {out}: "
                             + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    save_json(cfg.work / "config.json", asdict(cfg))
    t0 = time.time()
    mask_token_id = resolve_mask_token(cfg)
    verifier = load_model(cfg.verifier).requires_grad_(False)
    seqs = generate_data(cfg, verifier)
    train_seqs = [s for s in seqs if not s["heldout"] and len(s["ids"]) > s["prompt_len"]]
    heldout = [s for s in seqs if s["heldout"] and len(s["ids"]) > s["prompt_len"]]
    if not train_seqs:
        raise ValueError("no training data was generated: raise --minutes or --max-sequences")
    teacher_t0 = time.time()
    teacher_targets(cfg, verifier, train_seqs)
    teacher_seconds = time.time() - teacher_t0
    pad_id = load_json(Path(cfg.verifier) / "config.json", {}).get("pad_token_id") or 0
    model = new_draft(cfg, verifier, mask_token_id)
    untrained = agreement(model, [s for s in heldout if s["greedy"]][:32], cfg, mask_token_id,
                          pad_id) if heldout else None
    result = train(cfg, model, train_seqs, heldout, mask_token_id, pad_id)
    write_draft(cfg, model)
    metrics = {
        "command_config": {k: v for k, v in asdict(cfg).items() if k != "resume"},
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": {
            "sequences": len(train_seqs), "heldout_sequences": len(heldout),
            "generated_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in train_seqs),
            "prompt_tokens": sum(s["prompt_len"] for s in train_seqs),
            "greedy_sequences": sum(s["greedy"] for s in train_seqs),
            "seconds": round(load_json(cfg.work / "data_state.json", {})["seconds"], 1),
        },
        "teacher_topk": cfg.teacher_topk,
        "teacher_seconds_this_run": round(teacher_seconds, 1),
        "untrained_heldout_teacher_forced_acceptance": untrained,
        "training": result,
        "heldout_decoder_acceptance": measured_acceptance(cfg, verifier, out, heldout),
        "wall_seconds_this_run": round(time.time() - t0, 1),
        "threads": torch.get_num_threads(),
    }
    save_json(out / "distill.json", metrics)
    return metrics
