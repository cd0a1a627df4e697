# CPU image of the runtime (the GPU image, FROM an NGC tritonserver TensorRT-LLM tag, comes
# with the GPU issue). Not built on the development machines: they have no Docker engine.
FROM python:3.11-slim
WORKDIR /opt/paradraft
COPY . .
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        torch==2.13.0 && pip install --no-cache-dir -e .
ENTRYPOINT ["paradraft"]
CMD ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "64"]
