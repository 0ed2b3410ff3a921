"""Isolation: a different model, dtype, compute platform, tenant or request context never finds another's chunks.

The keys are the only thing standing between one model's KV and another
engine's paged memory, so these tests go through the real namespace built
from a real VllmConfig, and a real engine for vLLM's per-request cache_salt.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.support.engine import greedy
from tests.support.engine_pool import connected
from vllm_kvcodec.connector.config import ConnectorConfig
from vllm_kvcodec.keys.identity import PLAIN, PromptIdentity, model_identity, weights_fingerprint
from vllm_kvcodec.keys.chain import Namespace, chunk_hashes

BASE = Namespace("m#1", "bfloat16", 30, 3, 64, "canonical-v1", 1, 128, 5)
#: BASE's digest. Pinned: a change of it orphans every object of every store (SHA-256 keys changed it once, on purpose).
BASE_DIGEST = "7f2f1e2feee9dfe37907d2cfb5503416448bfc42cdc48f213416a7cb5dff10b5"
TOKENS = list(range(1000, 1000 + 512))


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "m#2"}, {"dtype": "float16"}, {"num_layers": 31}, {"num_kv_heads": 4},
        {"head_dim": 128}, {"layout_id": "cpu_attn-vec-v1"}, {"tp_size": 2}, {"chunk_size": 256},
        {"layers_per_object": 6}, {"salt": "tenant-b"}, {"compute": "cuda"}, {"format_version": 2},
        {"dtype": "fp8_e4m3"}, {"kv_scales": "0" * 32}, {"hash_algo": "xxh3_128"}, {"config_inputs": "0" * 64},
        {"compute_dtype": "float32"}, {"digest_unit": 8}, {"precision": "int8"}, {"precision": "int8+sink4"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_every_namespace_field_separates_keys(change: dict) -> None:
    other = dataclasses.replace(BASE, **change)
    assert other.digest != BASE.digest
    assert set(chunk_hashes(other, TOKENS, 2)).isdisjoint(chunk_hashes(BASE, TOKENS, 2))


def test_fields_added_later_keep_the_digests_of_namespaces_without_them() -> None:
    """A namespace that does not use kv_scales (every bf16 one) has the digest it had before the field existed."""
    assert BASE.digest == BASE_DIGEST
    assert dataclasses.replace(BASE, kv_scales="", config_inputs="", compute_dtype="", digest_unit=0,
                               precision="").digest == BASE.digest


def test_keys_are_sha256_unless_xxh3_is_asked_for() -> None:
    """Every link of the chain (first chunk, later chunks, tails) is SHA-256 of the link before and the tokens."""
    import hashlib

    import numpy as np

    from vllm_kvcodec.keys.chain import tail_hash

    hashes = chunk_hashes(BASE, TOKENS, 4)
    assert BASE.hash_algo == "sha256" and all(len(h) == 64 for h in hashes)
    seed = hashlib.sha256(bytes.fromhex(BASE.digest)).digest()
    first = hashlib.sha256(seed + np.asarray(TOKENS[:128], dtype="<i8").tobytes()).hexdigest()
    second = hashlib.sha256(bytes.fromhex(first) + np.asarray(TOKENS[128:256], dtype="<i8").tobytes()).hexdigest()
    assert hashes[:2] == [first, second]
    tail = hashlib.sha256(bytes.fromhex(second) + b"kvc-tail" + np.asarray(TOKENS[256:288], dtype="<i8").tobytes())
    assert tail_hash(BASE, TOKENS, hashes[:2], 32) == tail.hexdigest()
    fast = dataclasses.replace(BASE, hash_algo="xxh3_128")
    assert all(len(h) == 32 for h in chunk_hashes(fast, TOKENS, 4))


@pytest.mark.parametrize("vllm_algo,expected", [("sha256", "sha256"), ("sha256_cbor", "sha256"),
                                                  ("xxhash", "xxh3_128"), ("xxhash_cbor", "xxh3_128")])
def test_hash_algo_auto_follows_vllms_prefix_caching_hash_algo(vllm_algo: str, expected: str, caplog) -> None:
    """One setting governs both caches; a non-cryptographic one warns, as vLLM does."""
    ns = _namespace(prefix_caching_hash_algo=vllm_algo)
    assert ns.hash_algo == expected
    assert ("not collision resistant" in caplog.text) == (expected == "xxh3_128")
    assert _namespace(prefix_caching_hash_algo=vllm_algo, connector={"hash_algo": "sha256"}).hash_algo == "sha256"


def test_hf_overrides_and_effective_rope_are_in_the_namespace() -> None:
    """A rope override changes every K computed from the same weights and tokens: never the same keys."""
    plain = _namespace()
    theta = _namespace(hf_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}})
    assert plain.config_inputs and theta.config_inputs != plain.config_inputs and theta.digest != plain.digest
    assert _namespace(hf_overrides={"rms_norm_eps": 1e-6}).digest != plain.digest
    assert _namespace().digest == plain.digest  # stable


def test_fp8_scales_separate_keys_q_and_p_scales_too() -> None:
    """Same bytes under another scale are other values: a re-calibrated checkpoint never shares chunks."""
    from types import SimpleNamespace

    from vllm_kvcodec.connector.cache_identity import scales_digest

    ones = [SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0) for _ in range(3)]
    calibrated = ones[:2] + [SimpleNamespace(_k_scale_float=1.0, _v_scale_float=0.5)]
    assert scales_digest(ones) == scales_digest([SimpleNamespace() for _ in range(3)])  # vLLM's default is 1.0
    assert scales_digest(ones) != scales_digest(calibrated) != scales_digest(ones[:2])
    # Q's and P's scales quantise the attention's inputs on fp8-attention backends: every later layer's KV follows.
    for name in ("_q_scale_float", "_prob_scale_float"):
        assert scales_digest(ones[:2] + [SimpleNamespace(**{name: 0.5})]) != scales_digest(ones), name
    a = dataclasses.replace(BASE, dtype="fp8_e4m3", kv_scales=scales_digest(ones))
    b = dataclasses.replace(a, kv_scales=scales_digest(calibrated))
    assert set(chunk_hashes(a, TOKENS, 2)).isdisjoint(chunk_hashes(b, TOKENS, 2))


@pytest.mark.parametrize(
    "identity",
    [PromptIdentity(salt="alice"), PromptIdentity(lora='{"name": "sql"}'), PromptIdentity(salt="alice", lora="x")],
    ids=["cache_salt", "lora", "both"],
)
def test_request_context_separates_every_chunk(identity: PromptIdentity) -> None:
    plain = chunk_hashes(BASE, TOKENS, 4)
    salted = chunk_hashes(BASE, TOKENS, 4, identity)
    assert set(salted).isdisjoint(plain)
    assert chunk_hashes(BASE, TOKENS, 4, identity) == salted  # stable


def test_media_changes_its_chunk_and_every_later_one_only() -> None:
    """Placeholder tokens are equal for any image: its content hash must key the chunks from its own on."""
    image_a = chunk_hashes(BASE, TOKENS, 4, PromptIdentity(media=((300, "img-a"),)))
    image_b = chunk_hashes(BASE, TOKENS, 4, PromptIdentity(media=((300, "img-b"),)))
    plain = chunk_hashes(BASE, TOKENS, 4, PLAIN)
    assert image_a[:2] == image_b[:2] == plain[:2]  # tokens 0..255 come before the image
    assert all(a != b for a, b in zip(image_a[2:], image_b[2:]))


def test_a_prompt_tail_is_keyed_by_its_chain_context_and_length() -> None:
    """A tail is a leaf of the chain: never a chunk's key, another for every length, context and preceding chunk."""
    from vllm_kvcodec.keys.chain import tail_hash

    hashes = chunk_hashes(BASE, TOKENS, 3)
    tails = {t: tail_hash(BASE, TOKENS, hashes[:2], t) for t in (16, 32, 127)}
    assert len(set(tails.values())) == 3 and set(tails.values()).isdisjoint(hashes)
    assert tail_hash(BASE, TOKENS, hashes[:2], 32) == tails[32]  # stable
    assert tail_hash(BASE, TOKENS, hashes[:1], 32) != tails[32]  # after another chunk
    alice = PromptIdentity(salt="alice")
    assert tail_hash(BASE, TOKENS, chunk_hashes(BASE, TOKENS, 2, alice), 32, alice) != tails[32]
    assert tail_hash(BASE, TOKENS, [], 32, alice) != tail_hash(BASE, TOKENS, [], 32)  # seeded like a first chunk
    other = TOKENS[:256] + [7] + TOKENS[257:]
    assert tail_hash(BASE, other, hashes[:2], 32) != tails[32]
    image = PromptIdentity(media=((280, "img-a"),))
    assert tail_hash(BASE, TOKENS, hashes[:2], 16, image) == tails[16]  # the image starts after it
    assert tail_hash(BASE, TOKENS, hashes[:2], 32, image) != tails[32]
    for bad in (0, 128):
        with pytest.raises(ValueError):
            tail_hash(BASE, TOKENS, hashes[:2], bad)


def test_weights_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    from vllm_kvcodec.tools.smollm2 import model_dir

    src = model_dir()
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    assert weights_fingerprint(str(copy)) == weights_fingerprint(str(src))
    weights = next(copy.glob("*.safetensors"))
    data = np.fromfile(weights, dtype=np.uint8)
    data[len(data) // 2 :] ^= 0x01  # a "fine-tune": the second half of the weights differs
    data.tofile(weights)  # rewritten in place: read again (its size or modification time changed), not remembered
    assert weights_fingerprint(str(copy)) != weights_fingerprint(str(src))
    assert model_identity("org/model", "abc123", None) != model_identity("org/model", "def456", None)
    assert model_identity("org/model", "abc123", None) != model_identity("org/model", "abc123", "awq")


def _hub_cache(root: Path, repo: str, refs: dict[str, str]) -> Path:
    """A local hub cache laid out as huggingface_hub keeps one: ``refs/<revision>`` naming a commit, a snapshot each."""
    folder = root / ("models--" + repo.replace("/", "--"))
    for name, commit in refs.items():
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / name).write_text(commit)
        (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (folder / "snapshots" / commit / "config.json").write_text("{}")
    return root


def test_an_unpinned_hub_model_is_keyed_by_the_commit_its_revision_names(tmp_path: Path, monkeypatch) -> None:
    """``org/model@main`` names other weights after every push: the commit is keyed, from vLLM's resolved revision
    (online) or the hub cache's refs (where vLLM could not resolve it). No network: a hub cache of our own."""
    from huggingface_hub import ResolvedRevision

    old, new = "1" * 40, "2" * 40
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path / "hub", "org/model", {"main": old, "v1": old})))
    first = model_identity("org/model", None, None)
    assert first == f"org/model@{old}"
    assert model_identity("org/model", "main", None) == model_identity("org/model", "v1", None) == first
    assert model_identity("org/model", old, None) == first  # a pinned commit keeps the key it always had
    _hub_cache(tmp_path / "hub", "org/model", {"main": new})  # a push to main, pulled
    assert model_identity("org/model", None, None) == f"org/model@{new}"
    assert model_identity("org/model", "v1", None) == first
    # What vLLM 0.32 hands over online: huggingface_hub's resolved revision, a str "main" carrying the commit.
    assert model_identity("org/model", ResolvedRevision(old, initial=None), None) == first
    # vLLM's download_dir holds the weights (and refs) it downloaded: asked first.
    _hub_cache(tmp_path / "downloads", "org/model", {"main": "3" * 40})
    assert model_identity("org/model", None, None, str(tmp_path / "downloads")) == "org/model@" + "3" * 40
    assert model_identity("org/other", None, None) == "org/other@"  # nothing to resolve it with: name only


def _namespace(**engine_args) -> Namespace:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvcodec.connector.engine_namespace import build_namespace
    from vllm_kvcodec.tools.smollm2 import model_dir

    args = {"model": str(model_dir()), "dtype": "bfloat16", "block_size": 128, "enforce_eager": True, "max_model_len": 2048}
    extra = engine_args.pop("connector", {})
    config = EngineArgs(**{**args, **engine_args}).create_engine_config()
    return build_namespace(config, ConnectorConfig(**extra))


def test_real_engine_configs_get_separate_namespaces() -> None:
    """The namespace an engine would use, from vLLM's own config: dtype and kernel choice separate it."""
    bf16 = _namespace()
    assert bf16 == _namespace()  # two engines of the same kind share
    assert _namespace(dtype="float32").digest != bf16.digest
    assert _namespace(dtype="float16").digest != bf16.digest
    assert _namespace(connector={"salt": "blue"}).digest != bf16.digest
    assert '"platform": "cpu"' in bf16.compute and '"isa"' in bf16.compute
    assert _namespace(enforce_eager=False).compute != bf16.compute  # compiled kernels: other bits (keys/identity.py)
    portable = _namespace(connector={"share_across_platforms": True})
    assert portable.compute == "" and portable.digest != bf16.digest


@pytest.mark.parametrize("share", [False, True], ids=["default", "share_across_platforms"])
def test_fp8_caches_of_other_compute_dtypes_get_separate_namespaces(share: bool) -> None:
    """float32 and bfloat16 K round to other fp8 bytes: the compute dtype is keyed where the cache does not hold it,
    also across platforms (there the compute identity, which names the CPU kernel's ISA, is dropped)."""
    connector = {"share_across_platforms": share}
    bf16, fp32, fp16 = (_namespace(dtype=d, kv_cache_dtype="fp8", connector=connector)
                        for d in ("bfloat16", "float32", "float16"))
    assert (bf16.compute_dtype, fp32.compute_dtype, fp16.compute_dtype) == ("bfloat16", "float32", "float16")
    assert len({bf16.digest, fp32.digest, fp16.digest}) == 3
    assert _namespace(connector=connector).compute_dtype == ""  # a bf16 cache of a bf16 model: dtype says it all


def test_kernel_choices_beyond_the_backend_are_in_the_compute_identity(monkeypatch) -> None:
    """Attention settings and kernel-choosing environment variables change the attention's output, and so every
    later layer's KV; named only when set, so that the engines without them keep their keys."""
    plain = _namespace()
    assert '"attention_config"' not in plain.compute and '"env"' not in plain.compute
    assert _namespace(attention_config={"flash_attn_version": 3}).compute != plain.compute
    assert _namespace(attention_config={"use_prefill_query_quantization": True}).compute != plain.compute
    for name, value in (("VLLM_BATCH_INVARIANT", "1"), ("VLLM_CPU_ATTN_SPLIT_KV", "0"),
                        ("ONEDNN_DEFAULT_FPMATH_MODE", "BF16"), ("VLLM_ROCM_USE_AITER", "1")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert _namespace().compute != plain.compute, name
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # not a kernel choice
    assert _namespace().compute == plain.compute


def test_a_chosen_block_size_is_keyed_where_it_can_change_the_default_backend() -> None:
    """On a GPU, vLLM skips a higher-priority backend that does not support the user's --block-size; on the CPU there
    is one backend, and a backend chosen by name is keyed by name. (The identity of a GPU engine cannot be built
    here: its rule is checked on the configurations vLLM makes on this host.)"""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvcodec.keys.identity import backend_block_size
    from vllm_kvcodec.tools.smollm2 import model_dir

    def config(**kw):
        args = {"model": str(model_dir()), "dtype": "bfloat16", "enforce_eager": True, "max_model_len": 2048}
        return EngineArgs(**{**args, **kw}).create_engine_config()

    chosen = config(block_size=64)
    assert backend_block_size(chosen, "cuda") == 64
    assert backend_block_size(chosen, "cpu") is None and '"block_size"' not in _namespace(block_size=64).compute
    assert backend_block_size(config(block_size=64, attention_config={"backend": "FLASH_ATTN"}), "cuda") is None
    assert backend_block_size(config(), "cuda") is None  # vLLM's own choice follows the backend, not the reverse


def test_dummy_weights_are_not_the_folder_s_weights() -> None:
    assert _namespace(load_format="dummy").config_inputs != _namespace().config_inputs


def test_token_digest_units_below_16_are_in_the_namespace() -> None:
    """Objects record a token digest per 16 tokens, or per block where blocks are smaller: engines of other units
    would fail every load of each other's objects (kind tokens) and overwrite them. Keyed also across platforms,
    where the compute identity (and the page layout with its block size) is dropped."""
    share = {"share_across_platforms": True, "chunk_size": 256}
    units = {b: _namespace(block_size=b, connector=share) for b in (1, 8, 32, 128)}
    assert [units[b].digest_unit for b in (1, 8, 32, 128)] == [1, 8, 0, 0]
    assert len({units[1].digest, units[8].digest, units[32].digest}) == 3
    assert units[32].digest == units[128].digest  # 16 tokens per digest either way: they share


def test_fp8_cache_dtypes_name_their_bytes() -> None:
    """fp8 and fp8_e4m3 write the same bytes (one namespace); fp8_e5m2 and bf16 do not."""
    e4m3, alias, e5m2 = (_namespace(kv_cache_dtype=d) for d in ("fp8_e4m3", "fp8", "fp8_e5m2"))
    assert e4m3.dtype == alias.dtype == "fp8_e4m3" and e5m2.dtype == "fp8_e5m2"
    assert e4m3 == alias and len({e4m3.digest, e5m2.digest, _namespace().digest}) == 3


@pytest.mark.engine
def test_cache_salt_tenants_never_share_chunks(engines) -> None:
    """One engine, reset between tenants as a fresh engine on the same store (vLLM's prefix cache and the
    connector's memory of the store emptied)."""
    from vllm_kvcodec.tools.smollm2 import sample_token_ids

    ids = sample_token_ids(1700)[1100:]
    e = engines.get(connected(codec="rans", chunk_size=128))
    alice = greedy(e.llm, ids, cache_salt="alice")
    alice_cached = greedy(e.llm, ids, cache_salt="alice")  # what a prefix hit must reproduce
    assert e.conn.flush()
    e.reset(keep_store=True)
    assert greedy(e.llm, ids, cache_salt="bob") == alice  # recomputed: same engine kind, same tokens
    assert e.counters().get("loaded_tokens", 0) == 0
    assert greedy(e.llm, ids) == alice  # no salt is a tenant of its own too
    assert e.counters().get("loaded_tokens", 0) == 0
    e.reset(keep_store=True)
    assert greedy(e.llm, ids, cache_salt="alice") == alice_cached
    assert e.counters()["loaded_tokens"] == 512  # alice's own chunks do come back


def _adapter(folder: Path, fill: int) -> Path:
    """A LoRA adapter folder as PEFT writes one (config and weights); only its bytes matter to the identity."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    (folder / "adapter_model.safetensors").write_bytes(bytes([fill]) * 4096)
    return folder


def test_lora_adapters_of_one_name_from_two_paths_never_share(tmp_path: Path) -> None:
    """vLLM keys its own cache by adapter name and path; a shared store also meets one name and path holding other
    weights (another version deployed there, an adapter rewritten in place): keyed by its files too."""
    from vllm.lora.request import LoRARequest

    from vllm_kvcodec.keys.identity import adapter_files, lora_identity

    p1, p2 = _adapter(tmp_path / "v1", 1), _adapter(tmp_path / "v2", 1)
    a1, a2 = LoRARequest("a", 1, str(p1)), LoRARequest("a", 1, str(p2))
    keys = {name: chunk_hashes(BASE, TOKENS, 4, PromptIdentity(lora=lora_identity(r, adapter_files(r.lora_path))))
            for name, r in {"p1": a1, "p2": a2, "p1 again": LoRARequest("a", 7, str(p1))}.items()}
    assert set(keys["p1"]).isdisjoint(keys["p2"])  # same name, same weights, other path: vLLM's rule
    assert keys["p1 again"] == keys["p1"]  # the int id is vLLM's handle, not the adapter
    assert set(keys["p1"]).isdisjoint(chunk_hashes(BASE, TOKENS, 4))  # never the base model's
    before = adapter_files(str(p1))
    _adapter(p1, 2)  # new weights written over the same path
    assert adapter_files(str(p1)) != before
    assert adapter_files(str(tmp_path / "not-here")) is None  # nothing to key by: not cached (lora_keys.py)


def test_a_vllm_request_with_a_lora_adapter_is_keyed_by_its_path(tmp_path: Path) -> None:
    """prompt_identity reads vLLM's own Request: two adapters named alike are two identities; an adapter whose weights
    are unknown is no identity at all (never cached)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from vllm_kvcodec.keys.identity import adapter_files, prompt_identity

    def request(lora: LoRARequest | None) -> Request:
        return Request("r", TOKENS, SamplingParams(max_tokens=1), None, 0, lora_request=lora)

    one, two = (LoRARequest("a", 1, str(_adapter(tmp_path / name, 1))) for name in ("one", "two"))
    keyed = [prompt_identity(request(r), adapter_files(r.lora_path)) for r in (one, two)]
    assert keyed[0] is not None and keyed[1] is not None and keyed[0].seed() != keyed[1].seed()
    assert prompt_identity(request(one)) is None and prompt_identity(request(one), "") is None
    assert prompt_identity(request(None)) == PLAIN
