"""Images for vision-language models: decoding, preprocessing, and the vision towers with their projectors
(LLaVA's CLIP + MLP, Gemma 3's SigLIP + pooled projection) that turn pixels into Embedding rows.

Not yet done: Gemma 3 attends bidirectionally among one image's tokens during prefill (transformers'
token_type_ids mask); the engine's attention is causal, so Gemma 3 image jobs will differ until it does.
"""
