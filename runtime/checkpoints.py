"""Checkpoint-side helpers: the shipped demo pair, tokenizers, held-out prompts."""

from __future__ import annotations

import functools
import json
import random
import re
from datetime import datetime
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .model import Transformer, load_model, pad_vocab

DEMO_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"
HELDOUT_FILE = "heldout.jsonl"


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}: pass --prompt-ids or add a tokenizer.json")
    return Tokenizer.from_file(str(path))


def heldout_texts(demo_dir: str | Path) -> list[str]:
    """Held-out code snippets shipped with the demo models (files never seen in training)."""
    path = Path(demo_dir) / HELDOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"missing {path} (held-out snippets of the demo split)")
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line]


def heldout_prompts(tokenizer, texts: list[str], n: int, prompt_tokens: int,
                    seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference continuation ids) pairs, chosen reproducibly."""
    rng = random.Random(seed)
    pool = [tokenizer.encode(t).ids for t in texts]
    pool = [ids for ids in pool if len(ids) > prompt_tokens + 8]
    if not pool:
        raise ValueError(f"no held-out snippet is longer than prompt_tokens={prompt_tokens}")
    picks = [pool[i % len(pool)] for i in rng.sample(range(len(pool)), min(n, len(pool)))]
    while len(picks) < n:
        picks.append(pool[rng.randrange(len(pool))])
    return [(ids[:prompt_tokens], ids[prompt_tokens:]) for ids in picks]


# End-of-turn markers of the common chat formats (Llama 3, ChatML/Qwen, Gemma, Phi-3, Llama 2 /
# Mistral): a template that writes one ends each assistant turn with it, so generation stops
# there even where the checkpoint's eos_token_id lists only the end-of-text token.
END_OF_TURN_MARKERS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "</s>")


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def chat_template(model_dir: str | Path) -> str:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates whose ``default`` is used)."""
    model_dir = Path(model_dir)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _tokenizer_config(model_dir).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{model_dir} has no chat template (neither chat_template.jinja nor a "
                         "chat_template in tokenizer_config.json); send a plain prompt instead")
    return template


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    """The template compiled once: compiling takes milliseconds, a render microseconds, and a
    server renders one per chat request."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # transformers' override: Jinja's own tojson escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def format_chat(model_dir: str | Path, messages: list[dict],
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """Render ``messages`` with the checkpoint's chat template, as transformers'
    ``apply_chat_template(..., tokenize=False)`` does: the same sandboxed Jinja settings, and
    the tokenizer's special tokens (bos_token, eos_token, ...) visible to the template.
    ``tools``: OpenAI's tool definitions, for a template that renders them
    (``renders_tools``)."""
    import jinja2

    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with a 'role'; got {message!r}")
    config = _tokenizer_config(Path(model_dir))
    special = {key: _token_text(config.get(key)) for key in
               ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                "mask_token")}
    special = {key: text for key, text in special.items() if text is not None}
    # messages with a None value are dropped, as transformers normalises them
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return _compiled_template(chat_template(model_dir)).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            **special)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template of {model_dir}: {e}") from None


def renders_tools(model_dir: str | Path) -> bool:
    """Whether the chat template writes a ``tools`` variable (Qwen2.5's does)."""
    return re.search(r"\btools\b", chat_template(model_dir)) is not None


def chat_stop_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Token ids that end an assistant turn: the tokenizer's eos_token and the end-of-turn
    markers the chat template writes (the checkpoint's eos_token_id is added by the caller)."""
    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    template = chat_template(model_dir)
    texts = [_token_text(_tokenizer_config(model_dir).get("eos_token"))]
    texts += [marker for marker in END_OF_TURN_MARKERS if marker in template]
    ids = [tokenizer.token_to_id(t) for t in texts if t]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _tokenizer_vocab(model_dir: Path) -> dict | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    t = json.loads(path.read_text(encoding="utf-8"))
    return {"model.vocab": (t.get("model") or {}).get("vocab"),
            "added_tokens": [(a.get("id"), a.get("content")) for a in t.get("added_tokens", [])]}


def real_vocab_size(model_dir: str | Path) -> int | None:
    """Ids the tokenizer defines (the rest of a model's vocab_size is padding), or None
    without a tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return max(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).values()) + 1


def check_draft_vocab(verifier_dir: str | Path, verifier_vocab: int, draft_dir: str | Path,
                      draft_vocab: int, name: str = "draft") -> int:
    """Refuse a draft that does not speak the verifier's vocabulary, naming what differs.
    A draft whose vocab_size differs only by padding is accepted when both tokenizers agree
    on every real token. Returns the real vocabulary size (ids below it are shared)."""
    verifier_dir, draft_dir = Path(verifier_dir), Path(draft_dir)
    ours, theirs = _tokenizer_vocab(verifier_dir), _tokenizer_vocab(draft_dir)
    if ours is not None and theirs is not None:
        for key in ours:
            if ours[key] != theirs[key]:
                raise ValueError(f"{name} {draft_dir}: tokenizer.json {key} differs from the "
                                 f"verifier's ({verifier_dir / 'tokenizer.json'})")
    if draft_vocab == verifier_vocab:
        return draft_vocab
    real = real_vocab_size(verifier_dir)
    if ours is None or theirs is None or real is None:
        raise ValueError(f"{name} {draft_dir}: vocab_size {draft_vocab} differs from the "
                         f"verifier's {verifier_vocab} ({verifier_dir}), and without both "
                         "tokenizer.json files the difference cannot be shown to be padding")
    if real > min(draft_vocab, verifier_vocab):
        raise ValueError(f"{name} {draft_dir}: vocab_size {draft_vocab} differs from the "
                         f"verifier's {verifier_vocab} ({verifier_dir}) by more than padding: "
                         f"the tokenizer defines {real} ids")
    if draft_vocab > verifier_vocab:
        raise ValueError(f"{name} {draft_dir}: vocab_size {draft_vocab} is larger than the "
                         f"verifier's {verifier_vocab} ({verifier_dir}); only a draft padded "
                         "less than the verifier is supported")
    return real


def load_draft(draft_dir: str | Path, verifier_dir: str | Path, verifier_vocab: int,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               name: str = "draft") -> Transformer:
    """A draft checkpoint, checked against the verifier's tokenizer and, when the two are
    padded to different sizes, widened to the verifier's vocabulary (``pad_vocab``)."""
    draft = load_model(draft_dir, dtype=dtype, device=device)
    real = check_draft_vocab(verifier_dir, verifier_vocab, draft_dir, draft.config.vocab_size,
                             name)
    if draft.config.vocab_size != verifier_vocab:
        pad_vocab(draft, verifier_vocab, real)
    return draft


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "cpu") -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, refused by name where this machine has no such
    device (rather than failing later inside a matmul)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be cpu, cuda or cuda:N; got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be cpu, cuda or cuda:N; got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s), "
                         f"cuda:0 … cuda:{count - 1}")
    return device


def resolve_dtype(model_dir: str | Path, device: torch.device, name: str | None = None
                  ) -> torch.dtype:
    """``name`` (float32, bfloat16, float16), or by default the checkpoint's ``torch_dtype``
    (``dtype`` in transformers 5) on CUDA and float32 on the CPU, where half-precision
    matmuls are slow."""
    if name is not None:
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    saved = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(saved, torch.float32)
