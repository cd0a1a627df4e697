"""Triton Python model: text_input (UTF-8) -> input_ids with the engine's tokenizer, and
TensorRT-LLM's stop_words -> their token ids (bad_words: refused unless empty; empty strings,
which TensorRT-LLM's clients send by default, mean none)."""

import json
import site

import numpy as np
import triton_python_backend_utils as pb_utils


def invalid():
    """The error code of a bad request (HTTP 400, gRPC INVALID_ARGUMENT); the stub defines
    TritonError only once a model loads."""
    return pb_utils.TritonError.INVALID_ARG


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

    def words(self, request, name):
        """The non-empty strings of an optional list input."""
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return []
        words = []
        for raw in tensor.as_numpy().reshape(-1):
            try:
                word = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            except UnicodeDecodeError as e:
                raise ValueError(f"{name}: not valid UTF-8 ({e.reason})") from None
            if word:
                words.append(word)
        return words

    def stop_words(self, request):
        if self.words(request, "bad_words"):
            raise ValueError("bad_words: not supported by paradraft (send none or empty)")
        # no BOS or other template tokens: the word must match generated tokens
        ids = [self.tokenizer.encode(w, add_special_tokens=False).ids
               for w in self.words(request, "stop_words")]
        return [i for word in ids for i in word], [len(word) for word in ids]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = self.encode(request)
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"text_input: {e}", invalid())))
                continue
            try:
                stop_ids, stop_lengths = self.stop_words(request)
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), invalid())))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
                pb_utils.Tensor("input_lengths", np.array([[len(ids)]], dtype=np.int32)),
                pb_utils.Tensor("stop_words_ids", np.array([stop_ids], dtype=np.int32)),
                pb_utils.Tensor("stop_words_lengths", np.array([stop_lengths], dtype=np.int32)),
            ]))
        return responses
