"""Triton Python model: text_input (UTF-8) -> input_ids with the engine's tokenizer."""

import json
import site

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"]
                  for k, v in json.loads(args["model_config"])["parameters"].items()}
        site.addsitedir(params["site_packages"])  # the project's venv (.pth files included)
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(params["tokenizer_path"])
        self.max_input_tokens = int(params["max_input_tokens"])

    def encode(self, request):
        tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
        values = tensor.as_numpy().reshape(-1)
        if values.size != 1:
            raise ValueError(f"text_input must hold exactly one prompt; got {values.size}")
        raw = values[0]
        if not isinstance(raw, bytes):
            raw = str(raw).encode()
        # cheap guard before tokenising: a token is at least one byte
        if len(raw) > 64 * self.max_input_tokens:
            raise ValueError(f"text_input is {len(raw)} bytes; the limit is "
                             f"{self.max_input_tokens} tokens")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"text_input is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text:
            raise ValueError("text_input is empty")
        ids = self.tokenizer.encode(text).ids
        if not 1 <= len(ids) <= self.max_input_tokens:
            raise ValueError(f"text_input is {len(ids)} tokens; allowed 1..{self.max_input_tokens}")
        return ids

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = self.encode(request)
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"text_input: {e}")))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
                pb_utils.Tensor("input_lengths", np.array([[len(ids)]], dtype=np.int32)),
            ]))
        return responses
