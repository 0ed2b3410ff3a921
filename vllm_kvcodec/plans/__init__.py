"""What the scheduler half and the worker half hand each other, as plain data with no vLLM import.

Plans go down (:mod:`.loads`: the chunks to bring into which slots; :mod:`.saves`: the chunks to gather and
store), outcomes come up (:mod:`.outcomes`); :mod:`.spans` is where a chunk's tokens lie in each KV cache group.
The classes vLLM pickles across its processes, which subclass its own, stay in ``connector/metadata.py``: the
split vLLM makes between ``kv_offload/abstract.py`` and its common types. So the load path (and the GPU check,
which runs without vLLM) reads its plans from here, and imports nothing of the connector.
"""
