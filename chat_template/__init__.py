"""Chat templates rendered as transformers renders them, torch-free: the floor below the engine
(whose tokenizer renders a chat for the worker) and the producer (whose gateway renders the same
chat for POST /tokenize from the template the workers publish), so both render with one copy."""

from chat_template.template import ChatTemplate, NoChatTemplate, with_bos

__all__ = ["ChatTemplate", "NoChatTemplate", "with_bos"]
