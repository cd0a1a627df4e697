"""Triton Python model: token ids -> the text they add to the response.

Stateless incremental detokenisation: output_ids holds every generated token so far and
prev_length how many earlier responses already covered. The text of this response is the
stable decode of all tokens minus the stable decode of the first prev_length, where "stable"
drops a trailing incomplete UTF-8 sequence (U+FFFD) until the final response, so a character
split across tokens (and responses) comes out whole and exactly once."""

import json
import site

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"]
                  for k, v in json.loads(args["model_config"])["parameters"].items()}
        site.addsitedir(params["site_packages"])
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(params["tokenizer_path"])

    def stable(self, ids, final):
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return text if final else text.rstrip("\ufffd")

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            ids = ids.reshape(-1).tolist()
            prev = int(pb_utils.get_input_tensor_by_name(request, "prev_length").as_numpy()
                       .reshape(-1)[0])
            final = bool(pb_utils.get_input_tensor_by_name(request, "is_final").as_numpy()
                         .reshape(-1)[0])
            before = self.stable(ids[:prev], False) if prev else ""
            text = self.stable(ids, final)[len(before):]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([[text.encode()]], dtype=np.object_)),
            ]))
        return responses
