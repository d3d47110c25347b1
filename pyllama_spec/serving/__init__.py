"""Running generations for callers: the Engine (load and lifecycle), the request a caller gives
and the one that runs (request, resolver), the prompt's parts, the slot loop that runs every
generation, chat templates, the CLI's conversations, slot files."""
