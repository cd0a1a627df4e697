"""Engine builders (ONNX, TensorRT, TensorRT-LLM) — importable as ``paradraft.build``."""
