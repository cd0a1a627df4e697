"""The OpenVINO GenAI side of ``bench --peer openvino``, as its own process.

Run by ``peer_openvino.OpenVinoPeer`` with the interpreter that has openvino-genai (optimum-intel
pins a transformers release the project's environment does not use, so the peer lives in an
environment of its own): ``python openvino_worker.py``. It reads one JSON request per line on
stdin and answers one JSON line on stdout; it imports nothing from paradraft.

Requests: ``{"cmd": "load", "key", "model", "draft", "config", "scheduler"}`` builds an
``LLMPipeline`` (with ``draft_model`` for speculative decoding, ``scheduler_config`` for
continuous batching); ``{"cmd": "generate", "key", "prompts", "max_new_tokens", "k"}`` decodes
token-id prompts greedily to ``max_new_tokens`` or an ``eos`` id (without ``eos``: exactly
``max_new_tokens``, as the bench's own rows) and answers the tokens and the seconds
``generate`` took.
"""

from __future__ import annotations

import json
import sys
import time


def load(req: dict, pipes: dict) -> dict:
    import openvino_genai as ov_genai

    kwargs = dict(req.get("config") or {})
    if req.get("draft"):
        kwargs["draft_model"] = ov_genai.draft_model(req["draft"], "CPU",
                                                     **(req.get("config") or {}))
    if req.get("scheduler"):  # continuous batching: prompts of any lengths in one batch
        scheduler = ov_genai.SchedulerConfig()
        for name, value in req["scheduler"].items():
            setattr(scheduler, name, value)
        pipes[req["key"]] = ov_genai.ContinuousBatchingPipeline(req["model"], scheduler, "CPU",
                                                                kwargs)
    else:
        pipes[req["key"]] = ov_genai.LLMPipeline(req["model"], "CPU", **kwargs)
    return {"ok": True}


def generate(req: dict, pipes: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = req["max_new_tokens"]
    if req.get("eos"):  # stop where the bench's own rows stop
        config.stop_token_ids = set(req["eos"])
    else:
        config.min_new_tokens = req["max_new_tokens"]
        config.ignore_eos = True
    config.do_sample = False
    if req.get("k"):
        config.num_assistant_tokens = req["k"]
    pipe = pipes[req["key"]]
    if isinstance(pipe, ov_genai.ContinuousBatchingPipeline):
        ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in req["prompts"]]
        t0 = time.perf_counter()
        results = pipe.generate(ids, [config] * len(ids))
        seconds = time.perf_counter() - t0
        tokens = [r.m_generation_ids[0] for r in results]
    else:  # one prompt: the stateful pipeline, OpenVINO's fastest at batch 1
        ids = np.array(req["prompts"], dtype=np.int64)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        tokens = pipe.generate(inputs, config).tokens
        seconds = time.perf_counter() - t0
    return {"tokens": [[int(t) for t in row] for row in tokens], "seconds": seconds}


def main() -> None:
    pipes: dict = {}
    handlers = {"load": load, "generate": generate}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = handlers[req["cmd"]](req, pipes)
        except Exception as e:  # the client raises it with the request that failed
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
