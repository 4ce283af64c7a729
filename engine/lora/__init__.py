"""LoRA adapters (issue 28): loading and checking PEFT adapter directories (adapter_config.py,
loading.py), the generator's named adapters (registry.py), and a step's tokens grouped by adapter
with the grouped product the targeted linears add (batch.py), over the adapters' weights stacked
per linear when a step runs several (slots.py)."""

from engine.lora.adapter import LoraAdapter
from engine.lora.adapter_config import MAX_LORA_RANK
from engine.lora.batch import LoraBatch
from engine.lora.loading import load_adapter
from engine.lora.registry import AdapterRegistry
from engine.lora.slots import LoraSlots

__all__ = ["MAX_LORA_RANK", "AdapterRegistry", "LoraAdapter", "LoraBatch", "LoraSlots", "load_adapter"]
