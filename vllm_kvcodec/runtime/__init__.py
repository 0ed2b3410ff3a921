"""How the connector's work runs in vLLM's processes: its threads (:mod:`.threads`), the allocator's treatment of
its large buffers (:mod:`.malloc`), and where it keeps files between runs (:mod:`.cache_dir`)."""
