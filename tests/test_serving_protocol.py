"""The serving protocol: the deployment config, its scheduler, and what the Triton model imports."""

import argparse
import ast
import json
from pathlib import Path

import pytest

from paradraft.runtime.serving.protocol import ServeConfig


def serve_args(**overrides) -> argparse.Namespace:
    """What `paradraft serve` parses, with its defaults (the options left unset are None)."""
    from paradraft.runtime.checkpoints import DEMO_DIR

    options = dict(verifier=str(DEMO_DIR / "verifier"), draft=None, drafter="model", engines=None,
                   k=None, rule=None, max_slots=None, max_queue=64, max_seq_len=None,
                   speculative_disable_by_batch_size=None, draft_len_schedule=None,
                   stream_interval=1, draft_threads=1, acceptance_floor=0.6)
    return argparse.Namespace(**{**options, **overrides})


def test_serve_config_validates_its_limits():

    for kw, message in [(dict(max_slots=0), r"max_slots must be an integer >= 1"),
                        (dict(max_queue=-1), r"max_queue must be an integer >= 0"),
                        (dict(max_input_tokens=600), r"max_input_tokens must be in \[1, 511\]"),
                        (dict(rule="best"), "rule must be one of"),
                        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                        (dict(disable_by_batch_size=0),
                         "speculative_disable_by_batch_size must be an integer >= 1"),
                        (dict(draft_len_schedule={"4": 2}), "holds batch size 1"),
                        (dict(draft_len_schedule={"one": 2}), "keys must be batch sizes"),
                        (dict(k=2, draft_len_schedule={1: 3}), r"K in \[0, 2\]"),
                        (dict(draft_threads=0), r"draft_threads must be an integer >= 1"),
                        (dict(acceptance_floor=1.5), r"acceptance_floor must be in \[0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            ServeConfig("verifier", "draft", **kw)
    # the model repository carries the config as JSON, whose keys are strings
    config = ServeConfig("verifier", "draft", draft_len_schedule={"1": 4, "8": 1})
    assert config.draft_len_schedule == {1: 4, 8: 1}


def test_serve_takes_its_defaults_and_limits_from_the_engine_manifest(tmp_path):
    from paradraft.cli.serve import serve_config

    rule_defaults = dict(rule="dynamic", temperature=0.8, top_p=0.95, tau=0.2, gamma=1.0,
                         alpha=0.05, top_p_membership=False, epsilon=0.09, delta=0.3)
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format_version": 1, "limits": {"max_batch_size": 6, "max_k": 3, "max_seq_len": 256},
        "rule_defaults": rule_defaults,
        "models": {"verifier": {"config": {"eos_token_ids": [0]}}}}))
    config = serve_config(serve_args(engines=str(tmp_path)))
    assert (config.max_slots, config.max_seq_len, config.max_input_tokens) == (6, 256, 255)
    assert config.k == 3  # 4 by default, but the engines hold fused drafts up to 3
    assert (config.rule, config.temperature, config.top_p) == ("dynamic", 0.8, 0.95)
    assert config.rule_defaults == dict(tau=0.2, gamma=1.0, alpha=0.05,
                                        top_p_membership=False, epsilon=0.09, delta=0.3)
    assert config.eos_token_id == (0,)
    # options win where set; the manifest's rule parameters stay
    config = serve_config(serve_args(engines=str(tmp_path), rule="threshold", max_slots=3))
    assert (config.rule, config.max_slots, config.rule_defaults["tau"]) == ("threshold", 3, 0.2)
    for overrides, message in [(dict(max_slots=8), r"max_slots must be <= 6"),
                               (dict(max_seq_len=512), r"max_seq_len must be <= 256"),
                               (dict(k=4), r"k must be <= 3"),
                               (dict(max_slots=0), r"max_slots must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            serve_config(serve_args(engines=str(tmp_path), **overrides))
    # checkpoints: the documented defaults
    config = serve_config(serve_args())
    assert (config.max_slots, config.max_seq_len, config.rule, config.k) == (16, 512, "greedy", 4)


def test_the_triton_model_imports_only_the_protocol_and_the_scheduler():
    """The decoupled Python model stays a thin adapter: none of the process launcher or the
    gRPC client comes into the Triton stub with it."""
    source = (Path(__file__).parent.parent / "triton_repo" / "paradraft" / "1" / "model.py")
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paradraft"):
            imported |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names if a.name.startswith("paradraft")}
    assert imported == {"paradraft.runtime.serving.protocol",
                        "paradraft.runtime.scheduler.QueueFull",
                        "paradraft.runtime.scheduler.Request"}
