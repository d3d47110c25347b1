"""Running generations for callers: the Engine (load-time checks, the gate that serialises
threads, the slot scheduler), the chat template and prompt assembly, conversations."""
