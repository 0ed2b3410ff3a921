"""Which top-level ``storage`` package this process imports: vllm-kvcodec's, or a loud refusal.

The stores live in a top-level package named ``storage`` (the layout users
know: ``from storage import open_store``, ``storage/`` beside
``vllm_kvcodec/``). That name is common: another distribution may install a
``storage`` package of its own, or a folder named ``storage`` on ``sys.path``
(a project's working directory) may shadow ours. Python then imports one of
them silently, and the connector would fail deep inside a load with an
``AttributeError``, or import the wrong code. Renaming it would break every
user's imports, so the collision is detected instead: ``vllm_kvcodec``'s own
import checks the package's marker (``storage.DISTRIBUTION``) and refuses
another with its path and the fix.
"""

from __future__ import annotations

OURS = "vllm-kvcodec"


def check_storage_package() -> None:
    """Raise ImportError, naming the culprit, unless ``import storage`` gives vllm-kvcodec's stores."""
    import storage

    if getattr(storage, "DISTRIBUTION", None) != OURS:
        where = getattr(storage, "__file__", None) or list(getattr(storage, "__path__", [])) or "an unknown place"
        raise ImportError(
            f"vllm_kvcodec: 'import storage' found a package that is not vllm-kvcodec's stores, at {where}: another "
            "distribution installs a top-level 'storage' package, or a folder named 'storage' on sys.path (the "
            "current directory?) shadows it. Uninstall or rename the other one, or run from another directory; "
            "vllm-kvcodec's stores are the 'storage' package installed with it."
        )
