"""Multi-LoRA serving (docs/lora.md): PEFT adapters loaded and checked (peft_adapter), kept in host
memory and device slots (slots), applied grouped by adapter over a step's rows (grouped, hooks)."""
