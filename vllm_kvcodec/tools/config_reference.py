"""Render docs/configuration.md from the typed config, so the reference never drifts.

``python -m vllm_kvcodec.tools.config_reference > docs/configuration.md``; a test
fails when the committed page differs from what this prints.
"""

from __future__ import annotations

from vllm_kvcodec.connector.config import ConnectorConfig

HEADER = """# Configuration reference

`kv_connector_extra_config` of `KVCodecConnector`. Unknown keys and bad values
stop the engine at start-up with a message naming the key. Generated from
`vllm_kvcodec/connector/config.py` by `python -m vllm_kvcodec.tools.config_reference`.

| key | type | default | meaning |
|---|---|---|---|
"""


def render() -> str:
    rows = []
    for name, field in ConnectorConfig.model_fields.items():
        default = "(cache dir)/store as file://" if field.default_factory else repr(field.default)
        kind = str(field.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{kind}` | `{default}` | {field.description} |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
