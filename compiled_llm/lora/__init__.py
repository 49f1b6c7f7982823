"""LoRA adapters: the request that names one, reading PEFT's files, the slots adapters are loaded
into and the manager that keeps them (issue 27)."""
