# genq images. Two targets share one source stage:
#   gateway  the HTTP gateway and the callback worker: no torch (a small image)
#   worker   the GPU worker (and Flower, which imports the worker's Celery app): CUDA torch
#
#   docker build --target gateway -t genq-gateway .
#   docker build --target worker -t genq-worker --build-arg TORCH_INDEX_URL=<a PyTorch CUDA wheel index> .
#
# TORCH_VERSION must equal the torch pin in pyproject.toml (the `engine` extra); what the build
# args choose is the wheel variant. Without TORCH_INDEX_URL pip uses its default index, whose
# Linux x86_64 torch wheels are CUDA builds; pass a CUDA-specific index to match an older driver.
# The NVIDIA driver comes from the host (NVIDIA Container Toolkit); the CUDA libraries come with
# the torch wheel, so a slim Python base is enough.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS source
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 genq
WORKDIR /app
COPY pyproject.toml README.md ./
COPY chat_template chat_template
COPY image_input image_input
COPY grammar_limits grammar_limits
COPY engine engine
COPY kernels kernels
COPY worker worker
COPY producer producer

FROM source AS gateway
RUN pip install ".[gateway]"
USER genq
EXPOSE 8000
CMD ["genq", "gateway", "--host", "0.0.0.0", "--port", "8000"]

FROM source AS worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
 && pip install ".[worker]"
USER genq
CMD ["genq", "worker"]
