"""Where bytes live: local paths, or object-store URLs ``msc://PROFILE/...`` through multi-storage-client.

The libraries underneath read and write ``msc://`` URLs themselves: energon opens datasets through its
``EPath`` (which is MSC), and megatron-core's dist_checkpointing saves and loads through MSC when its
``MultiStorageClientFeature`` flag is on. That flag is on by default in megatron-core 0.16 but off in 0.19, so
:func:`enable_object_store` switches it on explicitly wherever a URL is used (both versions have the flag). This module only adds
what megatron-vlm's own files need (spec, metadata, tracker, tokenizer, upload of a staged dataset) and the
checks that turn a missing configuration into an error naming the input and the fix.

An MSC profile says which bucket, endpoint and credentials a URL uses; profiles come from the file named by
the ``MSC_CONFIG`` environment variable (else ``~/.msc_config.yaml`` and the other MSC default locations).
Credentials stay in that file or the provider's standard environment variables and are never logged here.

Object stores have no directories and no rename; what *is* atomic is a single object write (a reader sees
the old object or the new one, never part of one). Writers here rely on exactly that (see
:mod:`megatron_vlm.training.checkpointing` for how a checkpoint is committed).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

SCHEME = "msc://"
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<profile>[^/]*)(?P<rest>/.*)?$")
EXTRA_HINT = "pip install 'megatron-vlm[s3]' (multi-storage-client with boto3)"


class RemoteStorageError(ValueError):
    """A remote URL that cannot be used as given; the message names the input and the fix."""


def is_remote(path) -> bool:
    return path is not None and "://" in str(path)


def join(base, *parts: str) -> str:
    """``base/part/...`` for a local path or a URL (``pathlib`` would turn ``msc://`` into ``msc:/``)."""
    out = str(base).rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def _profile_help() -> str:
    return ("an MSC config (YAML or JSON, named by MSC_CONFIG) like\n"
            "  profiles:\n    PROFILE:\n      storage_provider:\n        type: s3\n"
            "        options: {base_path: BUCKET, endpoint_url: https://..., region_name: us-east-1}\n"
            "      credentials_provider:\n        type: S3Credentials\n"
            "        options: {access_key: ..., secret_key: ...}\n"
            "(or leave credentials_provider out to use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")


def check_url(url: str, what: str) -> str:
    """Validate a remote URL given as ``what`` (e.g. ``--data-path``): scheme, MSC config, profile, provider.

    Returns the URL without a trailing ``/``. Opens no connection.
    """
    url = str(url).rstrip("/")
    m = _URL.match(url)
    if not m or not m.group("profile"):
        raise RemoteStorageError(f"{what} {url}: not a valid URL; write msc://PROFILE/PATH")
    scheme, profile = m.group("scheme"), m.group("profile")
    if scheme != "msc":
        raise RemoteStorageError(
            f"{what} {url}: the {scheme}:// scheme is not supported; define an MSC profile for the bucket and "
            f"write msc://PROFILE/PATH, with {_profile_help()}")
    try:
        import multistorageclient as msc
        from multistorageclient.config import StorageClientConfig
    except ImportError as e:
        raise RemoteStorageError(f"{what} {url}: multi-storage-client is not installed ({e}); {EXTRA_HINT}") from None
    env = os.environ.get("MSC_CONFIG")
    if env and not os.path.isfile(env):
        raise RemoteStorageError(f"{what} {url}: MSC_CONFIG={env} does not exist; point it at the MSC config file")
    try:
        config, source = StorageClientConfig.read_msc_config()
    except ValueError as e:
        raise RemoteStorageError(f"{what} {url}: {e}") from None
    if profile not in (config or {}).get("profiles", {}):
        where = f"the MSC config {source}" if source else "no MSC config (MSC_CONFIG is not set and ~/.msc_config.yaml does not exist)"
        raise RemoteStorageError(f"{what} {url}: profile {profile!r} is not defined in {where}; add it with "
                                 + _profile_help())
    try:
        msc.resolve_storage_client(f"msc://{profile}")
    except ImportError as e:
        raise RemoteStorageError(f"{what} {url}: profile {profile!r} needs a package that is missing ({e}); "
                                 f"{EXTRA_HINT}") from None
    except Exception as e:  # the provider rejected the profile's options
        raise RemoteStorageError(f"{what} {url}: profile {profile!r} of {source} is not usable: {e}") from None
    enable_object_store()
    return url


def enable_object_store() -> None:
    """Let megatron-core's dist_checkpointing read and write ``msc://`` URLs (idempotent; needs
    multi-storage-client). Without it megatron-core 0.19 hands the URL to pathlib, which fails."""
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.enable()


def path(p):
    """A pathlib-like object: ``pathlib.Path`` for a local path, ``multistorageclient.Path`` for a URL."""
    if is_remote(p):
        import multistorageclient as msc

        enable_object_store()

        return msc.Path(str(p))
    return Path(p)


def write_text(p, text: str) -> None:
    """Local: temporary file + rename. Remote: one object PUT, which readers see whole or not at all."""
    if is_remote(p):
        path(p).write_text(text)
    else:
        from megatron_vlm.files.atomic import atomic_write_text

        atomic_write_text(p, text)


def write_bytes(p, data: bytes) -> None:
    if is_remote(p):
        path(p).write_bytes(data)
    else:
        Path(p).write_bytes(data)


def remove_tree(p) -> None:
    """Remove a directory (local) or every object under the prefix ``p/`` (remote); missing is fine."""
    if is_remote(p):
        import multistorageclient as msc

        prefix = str(p).rstrip("/") + "/"
        for obj in list(msc.list(prefix)):
            msc.delete(obj.key)
    else:
        shutil.rmtree(p, ignore_errors=True)


def is_empty(p) -> bool:
    """No file under ``p`` (a missing directory or prefix is empty)."""
    if is_remote(p):
        import multistorageclient as msc

        return next(iter(msc.list(str(p).rstrip("/") + "/")), None) is None
    return not Path(p).exists() or (Path(p).is_dir() and not any(Path(p).iterdir()))


def upload_file(local, url: str) -> None:
    import multistorageclient as msc

    msc.upload_file(str(url), str(local))


def copy_file(src, dst) -> None:
    """Copy a local file to a local path or a URL."""
    if is_remote(dst):
        upload_file(src, dst)
    else:
        shutil.copy2(src, dst)
