"""Field names of TensorRT-LLM's LLM API and Triton ``llmapi`` model, pinned to named commits.

Every key ``paradraft build --backend trtllm`` writes into a ``trtllm-serve`` YAML or a Triton
``model.yaml`` must be one of these names (tests/test_trtllm.py checks it; the build checks it
too, before writing anything). The lists were read from NVIDIA/TensorRT-LLM, not guessed:

- ``tensorrt_llm/llmapi/llm_args.py`` at LLM_ARGS_COMMIT: ``BaseLlmArgs`` and the part of
  ``TorchLlmArgs`` the LLM() keys below come from, ``DecodingBaseConfig`` and the decoding
  configs it is the base of (the ``speculative_config`` union is discriminated by
  ``decoding_type``), ``KvCacheConfig``. The file has no ``TrtLlmArgs`` any more: PyTorch is
  the only backend (docs/source/legacy/tensorrt-backend-removal.md).
- ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py`` at LLMAPI_MODEL_COMMIT: the
  ``triton_config`` keys it reads from model.yaml (every other top-level key goes to LLM()),
  and ``config.pbtxt`` at LLMAPI_CONFIG_COMMIT: the tensor names and types of the model.

A name is added here only after reading it in those files; when TensorRT-LLM renames a field,
update the commit and the list together.
"""

from __future__ import annotations

LLM_ARGS_COMMIT = "0004396720054fd8e205cbf616f21f0b57c6b412"
LLMAPI_MODEL_COMMIT = "044a90d209e380c95e23e8ae42f3583fa05ada78"
LLMAPI_CONFIG_COMMIT = "0a71057313ec0626527e164a8fc0205c5822e2f5"


def names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# BaseLlmArgs (and TorchLlmArgs) fields: the keyword arguments of tensorrt_llm.LLM
LLM_ARGS = names("""
    model tokenizer tokenizer_mode skip_tokenizer_init trust_remote_code tensor_parallel_size
    dtype revision tokenizer_revision model_kwargs pipeline_parallel_size context_parallel_size
    gpus_per_node moe_tensor_parallel_size moe_expert_parallel_size enable_attention_dp
    load_format enable_lora lora_config kv_cache_config enable_chunked_prefill
    guided_decoding_backend iter_stats_max_iterations request_stats_max_iterations
    scheduler_config speculative_config max_batch_size max_input_len max_seq_len max_beam_width
    max_num_tokens gather_generation_logits reasoning_parser return_perf_metrics
    perf_metrics_output_dir prometheus_metrics_config env_overrides
    generation_config garbage_collection_gen0_threshold cuda_graph_config disable_overlap_scheduler
    attn_backend enable_iter_perf_stats enable_iter_req_stats print_iter_log
    batch_wait_timeout_ms
""")

KV_CACHE_CONFIG = names("""
    enable_block_reuse max_tokens max_attention_window free_gpu_memory_fraction host_cache_size
    enable_partial_reuse copy_on_partial_reuse dtype max_gpu_total_bytes
""")

# DecodingBaseConfig: every speculative_config has these
DECODING_BASE = names("""
    decoding_type max_draft_len max_total_draft_tokens speculative_model speculative_model_dir
    max_concurrency draft_len_schedule load_format acceptance_rate_window_size
    acceptance_rate_threshold use_rejection_sampling advanced_sampling_mode enable_penalty
""")

# decoding_type -> the fields of its config class (DraftTargetDecodingConfig, PARDDecodingConfig,
# NGramDecodingConfig). speculative_model_dir is an accepted alias of speculative_model.
SPECULATIVE_FIELDS = {
    "Draft_Target": DECODING_BASE,
    "PARD": DECODING_BASE | {"mask_token_id", "sa_config"},
    "NGram": DECODING_BASE | {"max_matching_ngram_size", "is_keep_all", "is_use_oldest",
                              "is_public_pool"},
}
# decoding_type -> the tensorrt_llm.llmapi class that validates it (where TensorRT-LLM is
# installed)
SPECULATIVE_CLASSES = {"Draft_Target": "DraftTargetDecodingConfig",
                       "PARD": "PARDDecodingConfig", "NGram": "NGramDecodingConfig"}

# model.yaml's triton_config, as the llmapi model.py reads it (decoupled and max_batch_size are
# required: auto_complete_config reads both)
TRITON_CONFIG = frozenset({"decoupled", "max_batch_size", "cancellation_check_period_ms"})

# config.pbtxt of the llmapi model: (name, data type, dims) of the tensors model.py reads and
# sends. Inputs are all optional but text_input.
LLMAPI_INPUTS = [
    ("text_input", "TYPE_STRING", "-1"),
    ("streaming", "TYPE_BOOL", "1"),
    ("sampling_param_temperature", "TYPE_FP32", "1"),
    ("sampling_param_top_k", "TYPE_INT32", "1"),
    ("sampling_param_top_p", "TYPE_FP32", "1"),
    ("sampling_param_max_tokens", "TYPE_INT32", "1"),
    ("sampling_param_stop", "TYPE_STRING", "-1"),
    ("sampling_param_seed", "TYPE_UINT64", "1"),
    ("sampling_param_exclude_input_from_output", "TYPE_BOOL", "1"),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", "1"),
    ("return_finish_reason", "TYPE_BOOL", "1"),
    ("stop", "TYPE_BOOL", "1"),
]
LLMAPI_OUTPUTS = [
    ("text_output", "TYPE_STRING", "-1"),
    ("finish_reason", "TYPE_STRING", "-1"),
    ("stop_reason", "TYPE_STRING", "-1"),
    ("cumulative_logprob", "TYPE_FP32", "-1"),
    ("kv_cache_reused_block", "TYPE_INT32", "-1"),
    ("kv_cache_missed_block", "TYPE_INT32", "-1"),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", "-1"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", "-1"),
    ("kv_cache_hit_rate", "TYPE_FP32", "-1"),
    ("arrival_time_ns", "TYPE_INT64", "1"),
    ("first_scheduled_time_ns", "TYPE_INT64", "1"),
    ("first_token_time_ns", "TYPE_INT64", "1"),
    ("last_token_time_ns", "TYPE_INT64", "1"),
    ("acceptance_rate", "TYPE_FP32", "1"),
    ("total_accepted_draft_tokens", "TYPE_INT32", "1"),
    ("total_draft_tokens", "TYPE_INT32", "1"),
]


def unknown_fields(llm_kwargs: dict, triton_config: dict | None = None) -> list[str]:
    """Every written key that is not in the pinned lists, as 'where.name' (empty: all known)."""
    bad = [k for k in llm_kwargs if k not in LLM_ARGS]
    bad += [f"kv_cache_config.{k}" for k in llm_kwargs.get("kv_cache_config", {})
            if k not in KV_CACHE_CONFIG]
    spec = llm_kwargs.get("speculative_config")
    if spec is not None:
        kind = spec.get("decoding_type")
        if kind not in SPECULATIVE_FIELDS:
            bad.append(f"speculative_config.decoding_type={kind!r}")
        else:
            bad += [f"speculative_config.{k}" for k in spec if k not in SPECULATIVE_FIELDS[kind]]
    bad += [f"triton_config.{k}" for k in (triton_config or {}) if k not in TRITON_CONFIG]
    return bad
