"""The connector's settings: ``kv_connector_extra_config``, typed and validated at start-up.

Every key, its type, default and meaning is here (and rendered into
docs/configuration.md); a bad value stops the engine with a message that names
the key, instead of failing on the first request.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from storage.registry import describe_schemes
from vllm_kvcodec.runtime.cache_dir import cache_dir
from vllm_kvcodec.errors import ConfigError


def default_store_url() -> str:
    """The embedded default: a file store in the user's cache directory, no server."""
    return f"file://{cache_dir('store')}"


#: Layer groups a chunk's objects stream in, where loads may overlap the prefill layer by layer. On a CPU engine
#: each object's reads, checks and hand-offs take cores from the prefill, so fewer, larger ones (layers_per_object).
LAYER_GROUPS = 6
CPU_LAYER_GROUPS = 3


class ConnectorConfig(BaseModel):
    """``kv_connector_extra_config`` of KVCodecConnector."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str = Field(default_factory=default_store_url, description=f"Store URL, one of: {describe_schemes()} (see docs/stores.md).")
    codec: str | dict[str, Any] | None = Field(None, description="Codec id or config dict (raw, zstd, splitzip, rans, video), 'auto' to pick by measured link and codec speed, or null for the densest codec the model's dtype allows (rans; zstd for float16).")
    precision: Literal["lossless", "int8", "int6", "int4", "auto"] = Field("lossless", description="lossless (the default): every object holds the KV bit for bit, every guarantee as documented. int8, int6, int4 (LOSSY: NOT BIT-EXACT, opt-in): objects hold the KV quantised to that many bits (keys per channel, values per token, per layer and KV head, as KIVI and KVQuant; every value within half a step; the scales in each object), the integers rANS-coded: about 2.0x, 2.7x and 4.1x against bf16 where lossless reaches 1.5x. A lossy precision is its own key namespace of canonical objects: a lossless engine never reads them; a chunk holding NaN or inf is stored lossless there. auto: every chunk is stored lossless and as a lossy variant at precision_floor; a load reads the lossless object unless the measured link would not bring it within precision_load_budget_s, then the variant of as many of its last chunks as needed (see docs/architecture.md, \"Lossy precision\"). A request can demand lossless with kv_transfer_params {\"kvcodec_precision\": \"lossless\"}. An fp8 KV cache (already 8-bit) stays lossless, said in the log; MLA's latent has no K and V to quantise apart and is refused.")
    precision_floor: Literal["int8", "int6", "int4"] | None = Field(None, description="With precision auto: the lossy variant stored beside each lossless object, the lowest precision a load reads (null: int8). Only with precision auto.")
    precision_sink_tokens: int = Field(0, ge=0, description="With a lossy precision: the first tokens of every sequence kept at full precision (the attention sinks CacheGen and KVQuant keep exact); only a sequence's first chunk holds them. At most chunk_size. Part of the keys.")
    precision_full_layers: int = Field(0, ge=0, description="With a lossy precision: the model's first layers kept at full precision (CacheGen keeps its first layers finer); an object of a later layer group keeps none. At most the model's layers. Part of the keys.")
    precision_load_budget_s: float = Field(1.0, gt=0, description="With precision auto: how long a request's load may take, by the measured read throughput of the worker's recent reads (and its decode speed), before its last chunks are read as the lossy variant; a request can set its own with kv_transfer_params {\"kvcodec_load_budget_s\": seconds}.")
    chunk_size: int = Field(256, gt=0, description="Tokens per stored chunk; a multiple of vLLM's block_size and of its prefix-cache hit alignment (the block size, times decode_context_parallel_size; for a hybrid model the least common multiple of its KV cache groups' block sizes). kvcodec serve checks it against --block-size (or vLLM's default: 128 on the CPU) before vLLM starts.")
    block_hits: bool = Field(True, validation_alias=AliasChoices("block_hits", "prompt_tails"), description="Hits end where vLLM's own prefix cache would end for the same prompt: on the last whole block the stored prefix covers, not on the last whole chunk. Every saved object also gets a tiny ref per whole-block prefix of it (about 143 bytes; chunk_size / block_size - 1 per chunk, written by one rank after the object landed), each request's prompt tail past its last full chunk is stored (whole blocks up to the block holding its last token), and so is, when it finishes, the part of prompt plus answer past its last full chunk (a chat's next turn). A prompt that shares 1400 tokens with a stored one then loads 1376 (block 32), as a local hit would, and computes the same greedy tokens: bf16 prefill of a longer suffix over a shorter hit rounds differently. false: hits end on whole chunks, tails are not stored (up to chunk_size - 1 tokens more recomputed per hit); the old name prompt_tails is accepted (see docs/architecture.md, \"Where a hit ends\").")
    layers_per_object: int = Field(0, ge=0, description="Layers per stored object, so loads stream layer group by layer group. 0: every layer in one object where loads wait whole anyway (page objects into a CPU engine, with load_wait 'whole', or 'auto' and a store on this host: a file or memory store): each object costs its own reads, checks and hand-offs, and a raw 4096-token load took 25 ms in 16 objects against 44 ms in 96 from the local disk, 54 against 87 ms behind an emulated 100 Gbit/s link (2 cores); other page objects into a CPU engine about 3 groups (a 4096-token load behind a 10 Gbit/s link: raw 140 ms in 3 groups against 150 in 6, zstd 149 against 186; 1 Gbit/s: 9-15 ms slower, the last group's prefill no longer hidden), elsewhere (GPU engines, canonical objects shared across platforms) about 6. Part of the keys: engines share chunks only with the same value.")
    load_mode: Literal["sync", "async"] = Field("sync", description="sync: prefill of the suffix waits per layer; async: the request waits aside (WAITING_FOR_REMOTE_KVS) until its prefix is loaded.")
    load_wait: Literal["auto", "layers", "whole"] = Field("auto", description="How the prefill of a step with sync loads waits for them. layers: each layer waits for its own layer group, so the load overlaps the prefill; whole: the first layer waits for the whole load, which then has every core (on a CPU engine whose threads take every core, the decode threads are as many as the cores). auto: whole on a CPU engine whose threads leave no core idle, where the store's reads are memory copies on this host (a local file store) or while recent loads spent longer decoding and copying than fetching (per thread; before the first load: while the codec this instance saves with is not raw); else layers. Measured on 2 cores: rans at 100 Gbit/s 2.8 -> 2.2 x the local hit; at 1 Gbit/s waiting would cost 620 ms against 548; a raw replay from the local disk 1.75 -> 1.52 (see docs/benchmarks.md).")
    fetch_threads: int | None = Field(None, ge=1, le=64, description="Threads that fetch stored objects (store round trips in flight at once). Unset: as many as decode_threads for a store whose reads are memory copies on this host (file, memory), else 4 (and at least decode_threads).")
    decode_threads: int | None = Field(None, ge=1, le=64, description="Threads that decode fetched objects and write them into paged memory. Unset: on a CPU engine, the cores its own threads leave idle (at least 1): a decode thread beyond them only takes cores from the prefill it runs beside; every core where load_wait may make the prefill wait for whole loads and the engine leaves none idle; on a GPU engine, fetch_threads (4 if unset).")
    save_threads: int = Field(2, ge=1, le=64, description="Threads that encode and put saved chunks.")
    save_codec_when_behind: str | dict[str, Any] | None = Field("splitzip", description="The codec for chunks saved while a full round of saves (one per save thread) waits behind them: the saver is encoding slower than the engine computes. splitzip encodes about 4.5x faster than rans (1.33x against 1.51x on real KV, lossless both). null: every chunk takes the configured codec. A dtype it cannot hold (fp8 for splitzip) keeps the configured codec.")
    upgrade_fallback_chunks: bool = Field(True, description="Re-encode an object stored with save_codec_when_behind to the configured codec when a load of this instance fetches it while its saver has nothing queued, and write it over the same key if the key still holds what was loaded (never over a newer save; content addressed: readers get either version, both exact). One thread at the lowest CPU priority (nice 19), at most 64 MiB of fetched objects held, each object once per process; never while saves are queued. false: fallback-coded objects keep their lower ratio for as long as the store keeps them.")
    save_thread_nice: int = Field(0, ge=0, le=19, description="How much lower than the engine's the save threads' CPU priority is (Linux nice; 0: the same). Higher: encoding takes only the cycles the engine leaves, for the throughput of a saturated saving instance, and saves land later (a request right after may miss what the one before computed); saves queue meanwhile, within max_pending_save_bytes.")
    max_pending_save_bytes: int = Field(512 << 20, ge=1 << 20, description="Raw KV bytes of saves gathered out of paged memory and waiting for encoding; a chunk that does not fit is dropped (counted) before it is gathered, never blocking the engine.")
    load_timeout_s: float = Field(30.0, gt=0, description="A load not finished by then is abandoned and its blocks recomputed.")
    store_retry_s: float = Field(5.0, ge=0, description="After the store fails, lookups, loads and saves skip it (misses, recomputes and dropped saves, all counted) for this many seconds before trying it again, so an outage costs one store timeout per interval, not one per request.")
    require_store_at_startup: bool = Field(False, description="Fail engine start-up when the store cannot be reached; by default the engine starts, serves by recompute and uses the store once it answers.")
    on_load_failure: Literal["recompute", "fail"] | None = Field(None, description="What vLLM does when a load fails (its kv_load_failure_policy): recompute the failed blocks, or fail the request. Unset: recompute, unless kv_load_failure_policy was set to recompute already; vLLM cannot tell an explicit kv_load_failure_policy 'fail' from its default, so ask for 'fail' here.")
    salt: str = Field("", description="Tenant/salt mixed into every key: deployments with different salts never share chunks.")
    hash_algo: Literal["auto", "sha256", "xxh3"] = Field("auto", description="The hash of the store's key chain. auto: the one vLLM's own prefix cache uses (prefix_caching_hash_algo: sha256 and sha256_cbor give SHA-256, its default; xxhash and xxhash_cbor give XXH3-128), so one setting governs both caches. sha256: collision resistant, what a store shared by tenants needs (its cost per lookup and per save: docs/reliability.md). xxh3: faster, not collision resistant: someone who chooses prompts could craft two prefixes with one key and read or poison another tenant's KV; logged as a warning at start-up, as vLLM does. Part of the keys: objects saved under one are never found under the other (see docs/reliability.md).")
    model_id: str = Field("", description="Model identity for the key namespace; default: a fingerprint of the local weights, or the hub name plus revision (set it to pin a hub model whose revision is unset), plus the quantisation.")
    share_across_platforms: bool = Field(False, description="false: chunks are shared only between engines of the same platform, device, kernel ISA, attention backend and vLLM/torch versions, so a hit gives exactly the KV this engine computes. true: any engine with the same model, dtype and geometry shares them (valid KV, possibly different in the last bits).")
    object_layout: Literal["auto", "pages", "canonical"] = Field("auto", description="What a stored object holds. pages: the chunk's KV pages exactly as the attention kernels lay them out, saved and loaded with block copies (fastest; only engines of the same platform and kernels read them). canonical: [layers, 2, tokens, heads, dim] K and V, readable by any attention backend, at the cost of a transform on every save and load. auto: pages, or canonical with share_across_platforms.")
    save: bool | None = Field(None, description="Save new full prefix chunks. Unset: as vLLM's kv_role says (kv_producer and kv_both save, kv_consumer does not); set, an explicit override, and false on a kv_producer or true on a kv_consumer is a start-up error.")
    load: bool | None = Field(None, description="Load stored prefix chunks. Unset: as vLLM's kv_role says (kv_consumer and kv_both load, kv_producer does not); set, an explicit override, and false on a kv_consumer or true on a kv_producer is a start-up error.")
    lookup: Literal["auto", "sync", "async"] = Field("auto", description="How the scheduler asks the store which chunks it holds. async: a new request's existence checks go to a background thread, batched over every request of the step in one store call (plus one for prompt tails), and vLLM asks again next step (the request waits one step or more; no step waits for the store). sync: the check runs inside vLLM's scheduler loop, one store round trip per new request, and every running request waits for it. auto: sync for a store whose reads are memory copies on this host (file, memory: a check costs microseconds); for every other store the lookup thread, which the scheduler waits for within the step (a request admitted in its first step) while what a lookup costs the store, measured, fits the step's lookup budget (lookup_budget_ms, lookup_budget_share), and does not wait while it does not: a store that hangs costs a step at most one budget (see docs/architecture.md).")
    lookup_budget_ms: float = Field(1.0, ge=0, description="With lookup auto and a store across a network: the least time per scheduler step the scheduler may wait for lookup answers (the step's budget is the larger of this and lookup_budget_share of the engine's recent step time). Lookups are answered within the step while one costs the store no more than the budget, measured (switched back once it costs at most half of it); past it they are answered on the lookup thread, the next step. The choice is logged and exported.")
    lookup_budget_share: float = Field(0.05, ge=0, le=0.5, description="With lookup auto: the share of the engine's recent step time (median of the last 16 steps that ran something) a step may spend waiting for lookup answers, when that is more than lookup_budget_ms: a CPU engine's steps last a second, where 1 ms would answer two lookups of a burst; a GPU engine's last tens of milliseconds.")
    prefetch_bytes: int = Field(256 << 20, ge=0, description="Host memory (bytes, per worker) for objects fetched ahead: once a lookup has found a request's chunks and the request still waits (for blocks, or behind other prefills), the worker fetches them, and the load takes them instead of asking the store (checked like any fetched object: header, checksum, key binding). What does not fit is fetched at load time. Only for stores across a network (not file or memory stores, whose reads are memory copies). 0: off.")
    lookup_timeout_s: float = Field(2.0, gt=0, description="An asynchronous lookup the store has not answered by then is a miss (counted as lookup_timeouts): the request computes its prefix instead of waiting on a store that hangs. The lookup thread does not send a question already past it (counted as lookups_skipped): a store that fell behind is not handed work whose answer nobody waits for.")
    lookup_queue: int = Field(64, ge=1, description="Batches of asynchronous lookups (one per scheduler step, plus one per question lookup auto asks within its step) waiting for the lookup thread; a step's batch that finds the queue full is answered as misses at once (counted as lookups_queue_full), so a slow store never makes requests pile up behind it.")
    kv_events: bool = Field(True, description="Publish the store's KV cache events for routers when vLLM publishes its own (--kv-events-config with enable_kv_cache_events): BlockStored in vLLM's block hashes for every chunk this instance saved, once the save landed, and BlockRemoved for every chunk a load of it found missing, damaged or late (see docs/routers.md). false: vLLM's GPU events only.")
    kv_events_medium: str = Field("KVCODEC", min_length=1, description="The medium the store's KV cache events carry, for routers that weigh tiers by it (vLLM's own: GPU, CPU, STORAGE).")
    kv_events_ownership: str | None = Field("kvcodec", min_length=1, description="The ownership the store's KV cache events carry: vLLM's field naming the secondary tier an event comes from (its shared KVCR tier publishes 'kvcr'). vllm-router's kv_aware counts a block with an ownership as its External tier (credited --kv-penalty-external of a GPU block, default 0.6) whatever the medium; without one, it takes an unknown medium such as KVCODEC for a GPU block (full credit). null: none (see docs/routers.md).")
    log_interval_s: float = Field(30.0, ge=0, description="Seconds between the connector's `kvcodec worker:` / `kvcodec scheduler:` log lines of totals (0: never); logged while the engine steps.")
    shutdown_flush_s: float = Field(10.0, ge=0, description="Seconds, from the engine's last step that computed tokens, that saves and upgrades still in flight are waited for: vLLM keeps stepping the idle engine for them (their counters reach /metrics as they land), also while it drains at shutdown, and the worker's flush at shutdown waits for what is left of them; what is still queued then is dropped (and the count logged). vLLM must allow it: its --shutdown-timeout (kvcodec serve sets it) must exceed this, or vLLM kills the engine first.")

    @field_validator("store")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        from storage import StoreURLError, check_url

        try:
            return check_url(url)  # the store registry's schemes, and nothing else
        except StoreURLError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, codec: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        from vllm_kvcodec.codecs import policy

        return policy.check_spec(codec, allow_auto=True)  # ConfigError (a ValueError) names the known codecs

    @model_validator(mode="after")
    def _precision_options_fit(self) -> "ConnectorConfig":
        """Options of a lossy precision are nonsense without one; a sink longer than a chunk is never kept whole."""
        lossy = self.precision != "lossless"
        if self.precision_floor is not None and self.precision != "auto":
            raise ValueError(f"precision_floor applies to precision auto only, not {self.precision!r}")
        for name in ("precision_sink_tokens", "precision_full_layers"):
            if getattr(self, name) and not lossy:
                raise ValueError(f"{name} applies to a lossy precision (int8, int6, int4, auto), not lossless")
        if self.precision_sink_tokens > self.chunk_size:
            raise ValueError(f"precision_sink_tokens {self.precision_sink_tokens} exceeds chunk_size {self.chunk_size}: "
                             "only a sequence's first chunk holds sink tokens")
        return self

    @field_validator("save_codec_when_behind")
    @classmethod
    def _known_behind_codec(cls, codec: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        from vllm_kvcodec.codecs import policy

        return policy.check_spec(codec, allow_auto=False)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorConfig":
        try:
            return cls(**(extra or {}))
        except ValidationError as exc:
            raise ConfigError("invalid kv_connector_extra_config for KVCodecConnector", _problems(exc)) from None

    def for_engine(self, kv_role: str | None, block_size: int, hit_alignment: int | None = None, *,
                   block_from: str = "", alignment_from: str = "") -> "ConnectorConfig":
        """These settings for an engine of ``kv_role`` with ``block_size`` blocks whose prefix-cache hits land on
        multiples of ``hit_alignment``: ``save`` and ``load`` resolved, ``chunk_size`` checked (ConfigError if not).

        The one check both doors run: ``kvcodec serve`` and ``kvcodec config``
        with what the command line says, before vLLM starts, and the
        connector at start-up with what vLLM resolved, so a setting is
        refused alike at both, and at the first within seconds.
        ``block_from`` and ``alignment_from`` say where the numbers come from.
        """
        config = self.for_role(kv_role)
        check_chunk_size(config.chunk_size, block_size, hit_alignment, block_from=block_from,
                         alignment_from=alignment_from)
        return config

    def for_role(self, kv_role: str | None) -> "ConnectorConfig":
        """``save`` and ``load`` resolved against vLLM's ``kv_role``; a contradiction is a one-line ConfigError.

        vLLM's disaggregated-prefill roles say who writes KV and who reads it:
        a ``kv_consumer`` (a decode instance) only loads what producers
        computed, a ``kv_producer`` (a prefill instance) only saves. ``save``
        and ``load`` stay as overrides that may narrow a role (a kv_both that
        only loads), never contradict it.
        """
        role = kv_role or "kv_both"
        allowed = {"kv_producer": (True, False), "kv_consumer": (False, True), "kv_both": (True, True)}.get(role)
        if allowed is None:
            raise ConfigError(f"kv_role {kv_role!r} is not one of kv_producer, kv_consumer, kv_both")
        resolved = {}
        for name, may in zip(("save", "load"), allowed):
            asked = getattr(self, name)
            if asked and not may:
                raise ConfigError(f"{name}: true contradicts kv_role {role!r}, which never {'saves' if name == 'save' else 'loads'}; drop one of them")
            if asked is False and may and role != "kv_both":
                raise ConfigError(f"{name}: false contradicts kv_role {role!r}, whose only job is to {name}; drop one of them")
            resolved[name] = may if asked is None else asked
        return self.model_copy(update=resolved)

    def lookup_mode(self) -> str:
        """``lookup`` with ``auto`` resolved: sync for a store whose reads are memory copies on this host, else
        adaptive (the lookup thread, waited for within the step's budget while a lookup fits it)."""
        from storage import reads_in_memory

        if self.lookup == "auto":
            return "sync" if reads_in_memory(self.store) else "adaptive"
        return self.lookup

    def prefetches(self) -> bool:
        """Whether hits are fetched ahead: a budget, loads at all, and a store whose reads cross a network."""
        from storage import reads_in_memory

        return self.prefetch_bytes > 0 and self.load is not False and not reads_in_memory(self.store)

    def object_layout_id(self, block_size: int) -> str:
        """The key namespace's name for what objects hold (see vllm_kvcodec/paged/objects.py)."""
        from vllm_kvcodec.paged.base import CANONICAL_NAMESPACE
        from vllm_kvcodec.paged.objects import page_namespace_id

        kind = self._object_kind()
        if kind == "pages" and self.share_across_platforms:
            raise ConfigError("object_layout 'pages' holds one platform's page bytes; with share_across_platforms use 'canonical' (or 'auto')")
        return CANONICAL_NAMESPACE if kind == "canonical" else page_namespace_id(block_size)

    def _object_kind(self) -> str:
        """``object_layout`` with ``auto`` resolved: pages, or canonical with share_across_platforms."""
        if self.object_layout == "auto":
            return "canonical" if self.share_across_platforms else "pages"
        return self.object_layout

    def object_layers(self, num_layers: int, *, on_cpu: bool = False) -> int:
        """Layers per stored object; ``on_cpu``: the engine computes on the CPU (see ``layers_per_object``)."""
        if self.layers_per_object:
            return min(self.layers_per_object, num_layers)
        if self.loads_whole_chunks(on_cpu):
            return num_layers
        # Canonical objects are shared across platforms: every engine must group them alike.
        groups = CPU_LAYER_GROUPS if on_cpu and self._object_kind() == "pages" else LAYER_GROUPS
        return max(1, -(-num_layers // groups))

    def loads_whole_chunks(self, on_cpu: bool) -> bool:
        """Loads wait for every layer of a chunk before the prefill starts, so layer groups would only cost.

        Decided from the configuration and the platform alone, so both
        halves agree before either reaches a store: page objects (one
        platform's KV anyway) into a CPU engine, and ``load_wait`` ``whole``,
        or ``auto`` with a store whose reads are memory copies on this host.
        Nothing of such a load hides under the prefill (it is CPU work on the
        same cores), so the worker half waits for it whole where the engine's
        threads take every core; with one group the first layer waits for
        all of it anyway. ``auto`` with a network store keeps its groups: it
        waits per layer while loads are bound by the wire.
        """
        from storage import reads_in_memory

        waits_whole = self.load_wait == "whole" or (self.load_wait == "auto" and reads_in_memory(self.store))
        return on_cpu and self._object_kind() == "pages" and waits_whole


def check_chunk_size(chunk_size: int, block_size: int, hit_alignment: int | None = None, *, block_from: str = "",
                     alignment_from: str = "") -> None:
    """A stored chunk is whole vLLM blocks, and a hit the connector reports must land where vLLM's hits may."""
    if chunk_size % block_size:
        raise ConfigError(f"chunk_size {chunk_size} must be a multiple of vLLM's block_size {block_size}"
                          f"{f' ({block_from})' if block_from else ''}; use {_multiples_near(chunk_size, block_size)}")
    if hit_alignment and chunk_size % hit_alignment:
        why = f", {alignment_from}" if alignment_from else ""
        raise ConfigError(f"chunk_size {chunk_size} must be a multiple of vLLM's prefix-cache hit alignment "
                          f"({hit_alignment} tokens{why}); use {_multiples_near(chunk_size, hit_alignment)}")


def _multiples_near(chunk_size: int, unit: int) -> str:
    below = chunk_size // unit * unit
    return "chunk_size " + " or ".join(str(c) for c in (below, below + unit) if c > 0)


def _problems(exc: ValidationError) -> list[str]:
    """``<key>: <reason>`` per problem, in the words of the check that failed (no pydantic prefixes)."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(config)"
        problems.append(f"{where}: {_reason(err)}")
    return problems


def _reason(err: Any) -> str:
    if err["type"] == "value_error":  # a validator's own message, without pydantic's "Value error, "
        return str(err["ctx"]["error"])
    if err["type"] == "extra_forbidden":
        guess = difflib.get_close_matches(str(err["loc"][-1]), ConnectorConfig.model_fields, n=1)
        hint = f"did you mean {guess[0]}? " if guess else ""
        return f"not a key of KVCodecConnector; {hint}the keys are in docs/configuration.md"
    return err["msg"]
