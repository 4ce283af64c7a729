"""Images for vision-language models: decoding, preprocessing (and, later, the vision tower)."""
