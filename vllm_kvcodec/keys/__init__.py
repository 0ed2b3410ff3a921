"""What a stored object is called, and what proves what it holds.

- :mod:`.chain`: the namespace (everything that must match for two engines to
  share an object) and the key chain over a prompt's token ids, down to each
  object's store key;
- :mod:`.key_hash`: the chain's hash (SHA-256, or XXH3-128 by choice);
- :mod:`.identity`: what the namespace and the chain's seed are made of beyond
  token ids: the model's weights, the engine's configuration and kernels, the
  request's salt, LoRA adapter and media;
- :mod:`.block_refs`: the index from whole-block prefixes to the objects that hold them;
- :mod:`.token_digests`: the digests of its prompt's tokens an object records and a load checks.
"""
