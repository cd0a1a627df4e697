"""GGUF files (llama.cpp's format) imported as HF-format checkpoint dirs.

``import_gguf`` writes a standard dir that every loader reads (ours, transformers, vLLM):
config.json, model.safetensors (fp32, dequantized), tokenizer.json + tokenizer_config.json
(special tokens, chat template) and generation_config.json (the end-of-generation ids).
``resolve_checkpoint`` is what every command calls on a checkpoint argument: a dir passes
through, a ``.gguf`` file is imported once into a cache dir keyed by the file's hash.

What is not imported is refused by name: an architecture, a quantization type, a metadata
key that changes the math, a tensor, a tokenizer model or pre-tokenizer we do not rebuild
exactly. The tokenizer is rebuilt from the file's own definition (vocabulary, merges, token
types and ``tokenizer.ggml.pre``'s split expressions as llama.cpp applies them), not from a
guess at the original tokenizer.json; tests/test_gguf.py checks ids against that definition.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

GGUF_SUFFIX = ".gguf"
# bump when the dirs written change: a cached import from an older importer is redone
IMPORTER_VERSION = 1
CACHE_ENV = "PARADRAFT_CACHE"

# GGUF general.architecture → HF class
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# architectures whose Q/K rows llama.cpp's converter reorders (rotate-half → interleaved
# pairs); qwen2's it keeps in HF order
PERMUTED_QK = ("llama",)
# quantization types dequantized here (gguf-py's reference dequantizers); the rest are refused
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp's pre-tokenizer split expressions per ``tokenizer.ggml.pre`` (llama-vocab.cpp),
# applied in order, each splitting every piece the previous one left
_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")
PRE_TOKENIZER_SPLITS = {
    "gpt2": (_GPT2_SPLIT,),
    # one piece per digit, then GPT-2's expression: SmolLM / StarCoder / Refact
    **dict.fromkeys(("smollm", "starcoder", "refact"), (r"\p{N}", _GPT2_SPLIT)),
    # Qwen2's tokenizer.json expression with its (?i:…) spelled out, as llama.cpp has it; HF's
    # Qwen2 tokenizer also NFC-normalizes first, which llama.cpp (and so the file) does not
    "qwen2": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
              r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",),
}

# general.* and tokenizer.* keys that change nothing in the math (names, licences, …) or that
# are read below; any other key is either read or refused
_READ_KEYS = {
    "general.architecture", "general.alignment", "general.file_type",
    "general.quantization_version",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
}
_INFORMATIONAL_PREFIXES = ("general.",)  # name, basename, licence, languages, tags, …
# <arch>.* keys: the ones read into config.json; any other is refused by name
_ARCH_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "vocab_size",
}

# GGUF tensor names → HF names (``{i}``: the block); anything else is refused
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp stores token types per id: 3 control (special), 4 user-defined (added, not special)
CONTROL, USER_DEFINED = 3, 4
# texts llama.cpp also treats as end of generation when the file marks them control tokens
_END_OF_GENERATION_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>",
                            "<|end|>", "<end_of_turn>", "<|end_of_text|>")


def _value(field) -> object:
    return field.contents()


def _need_gguf():
    try:
        import gguf
    except ImportError as e:
        raise RuntimeError("reading a .gguf file needs the gguf package: pip install "
                           "'paradraft[gguf]' (or gguf==0.19.0)") from e
    return gguf


def read_metadata(path: str | Path) -> dict[str, object]:
    """Every metadata key of the file with its value (token lists included)."""
    gguf = _need_gguf()
    reader = gguf.GGUFReader(str(path))
    return {k: _value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _check_keys(meta: dict[str, object], arch: str) -> None:
    for key in meta:
        if key in _READ_KEYS or key.startswith(_INFORMATIONAL_PREFIXES):
            continue
        if key.startswith(arch + ".") and key[len(arch) + 1:] in _ARCH_KEYS:
            continue
        raise ValueError(f"GGUF metadata {key}={meta[key]!r} is not imported (it may change "
                         "the model's math or tokenization); refusing rather than ignoring it")


def hf_config(meta: dict[str, object], tied: bool, vocab_size: int, has_bias: bool) -> dict:
    """config.json of the HF class for the file's architecture."""
    arch = meta["general.architecture"]
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    if int(a("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length != key_length is not supported")
    if int(a("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count={a('rope.dimension_count')}: a "
                         f"partly rotated head (head_dim {head_dim}) is not supported")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(a("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config.update(attention_bias=has_bias, mlp_bias=False)
    else:  # qwen2: q/k/v biases always, none elsewhere (transformers' Qwen2 has no field)
        config.update(use_sliding_window=False, max_window_layers=config["num_hidden_layers"])
    scaling = a("rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    elif scaling == "yarn":
        config["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(a("rope.scaling.factor")),
            "original_max_position_embeddings": int(a("rope.scaling.original_context_length"))}
    elif scaling != "none":
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not imported "
                         "(supported: none, linear, yarn)")
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                      ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    return config


def unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each Q/K head's rows from HF's rotate-half
    layout to interleaved pairs for the ``llama`` architecture."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def hf_tensors(path: str | Path, meta: dict[str, object]) -> dict[str, torch.Tensor]:
    """The file's tensors under HF names, dequantized to fp32 (Q/K rows in HF order)."""
    gguf = _need_gguf()
    from gguf.quants import dequantize

    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind not in DEQUANTIZED_TYPES:
            raise ValueError(f"GGUF tensor {t.name} is {kind}: not dequantized here (supported: "
                             f"{', '.join(DEQUANTIZED_TYPES)})")
        if t.name in _TOP_TENSORS:
            name = _TOP_TENSORS[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _BLOCK_TENSORS:
                raise ValueError(f"GGUF tensor {t.name} is not imported (unknown to the "
                                 f"{arch} architecture here); refusing rather than dropping it")
            name = f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}"
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # numpy's shape is ggml's reversed: [out, in] for a weight, as HF stores it
        array = array.reshape([int(n) for n in reversed(t.shape)])
        if arch not in PERMUTED_QK:
            pass
        elif t.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = unpermute_rope(array, heads)
        elif t.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = unpermute_rope(array, kv_heads)
        out[name] = torch.from_numpy(array.copy() if not array.flags.writeable else array)
    return out


def hf_tokenizer(meta: dict[str, object]):
    """A ``tokenizers.Tokenizer`` rebuilding the file's tokenizer: byte-level BPE over its
    vocabulary and merges, its pre-tokenizer's split expressions, control and user-defined
    tokens matched whole before any split (as llama.cpp does), a BOS only where the file
    adds one."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not imported (supported: "
                         "'gpt2', byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not imported (supported: "
                         f"{', '.join(PRE_TOKENIZER_SPLITS)}): its split expressions are not "
                         "rebuilt here, and a wrong split changes the token ids")
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise ValueError("GGUF tokenizer.ggml.add_space_prefix=true is not imported for a "
                         "byte-level BPE tokenizer")
    if meta.get("tokenizer.ggml.add_eos_token", False):
        raise ValueError("GGUF tokenizer.ggml.add_eos_token=true is not imported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens holds duplicate texts: not imported")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(e), behavior="isolated")
              for e in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
                          for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)])
    if meta.get("tokenizer.ggml.add_bos_token", False):
        bos = tokens[int(meta["tokenizer.ggml.bos_token_id"])]
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer


def end_of_generation_ids(meta: dict[str, object]) -> list[int]:
    """The ids that end generation: the file's EOS / EOT / EOM, and control tokens whose text
    llama.cpp treats as an end of generation too (``<|im_end|>``, ``<|endoftext|>``, …)."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    ids += [i for i, t in enumerate(tokens) if types[i] == CONTROL
            and t in _END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys(ids))


def tokenizer_config(meta: dict[str, object]) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    for name in ("bos", "eos", "unknown", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in meta:
            config[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = \
                tokens[int(meta[key])]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def tensor_shapes(path: str | Path, meta: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """The file's tensors' HF names and shapes, read without dequantizing anything."""
    gguf = _need_gguf()
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name in _TOP_TENSORS:
            name = _TOP_TENSORS[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _BLOCK_TENSORS:
                raise ValueError(f"GGUF tensor {t.name} is not imported (unknown to the "
                                 f"{meta['general.architecture']} architecture here)")
            name = f"model.layers.{int(parts[1])}.{_BLOCK_TENSORS[parts[2]]}"
        out[name] = tuple(int(n) for n in reversed(t.shape))
    return out


def import_gguf(path: str | Path, out: str | Path, weights: bool = True) -> Path:
    """Write the HF-format checkpoint dir of GGUF file ``path`` to ``out``; returns ``out``.
    ``weights=False``: the config, tokenizer and generation files only (what an engine that
    reads the GGUF itself, llama.cpp, needs beside it)."""
    from safetensors.torch import save_file

    path, out = Path(path), Path(out)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture={arch!r} is not imported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    _check_keys(meta, arch)
    tokenizer = hf_tokenizer(meta)  # refuses an unsupported tokenizer before the weights
    tensors = hf_tensors(path, meta) if weights else tensor_shapes(path, meta)
    tied = "lm_head.weight" not in tensors
    vocab_size = (tensors["model.embed_tokens.weight"].shape[0] if weights
                  else tensors["model.embed_tokens.weight"][0])
    if vocab_size != len(meta["tokenizer.ggml.tokens"]):
        raise ValueError(f"GGUF token_embd has {vocab_size} rows but the tokenizer "
                         f"{len(meta['tokenizer.ggml.tokens'])} tokens")
    has_bias = any(k.endswith("_proj.bias") for k in tensors)
    if arch == "qwen2":
        layers = int(meta["qwen2.block_count"])
        biases = {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(layers)
                  for p in "qkv"}
        have = {k for k in tensors if k.endswith(".bias")}
        if have != biases:
            odd = sorted(have ^ biases)[0]
            why = "is missing" if odd in biases else "is not part of qwen2 (q, k, v biases only)"
            raise ValueError(f"GGUF qwen2 file: {odd} {why}; not imported")
    config = hf_config(meta, tied, vocab_size, has_bias)
    eog = end_of_generation_ids(meta)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eog,
                  "pad_token_id": config.get("pad_token_id")}
    out.mkdir(parents=True, exist_ok=True)
    if weights:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    files = {"config.json": config, "generation_config.json": generation,
             "tokenizer_config.json": tokenizer_config(meta)}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n",
                                encoding="utf-8")
    return out


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256, read in blocks (an import's cache key; engine files' checksums)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    """``$PARADRAFT_CACHE``, else ``~/.cache/paradraft``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "paradraft"


def cached_import(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The imported dir of GGUF file ``path`` under ``cache_dir`` (default ``cache_root()``
    / gguf), keyed by the file's SHA-256 and the importer's version: imported on first use,
    atomically (a half-written import is never found)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "gguf"
    target = root / f"{sha256_file(path)[:32]}-v{IMPORTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    print(f"paradraft: importing {path} into {target}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".import-") as tmp:
        import_gguf(path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # imported meanwhile by another process: keep theirs
            if not (target / "config.json").is_file():
                raise
        else:
            os.makedirs(tmp)  # for TemporaryDirectory's cleanup
    return target


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(GGUF_SUFFIX)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint argument as a dir: an HF-format dir as it is, a ``.gguf`` file imported
    (once) into the cache."""
    return cached_import(path) if is_gguf(path) else Path(path)

