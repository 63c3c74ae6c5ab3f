"""Whether the Hugging Face hub can be reached, decided once per process before a dataset is downloaded: with
no network, ``datasets`` retries each request for most of a minute, printing every retry, before it fails; here
a hub that cannot be reached is one line at once, and so is a dataset missing from the local cache while the
offline variables are set."""
from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..checks import UsageError

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
TIMEOUT_S = 3.0


def offline_setting() -> str | None:
    """The offline variable that is set (``HF_HUB_OFFLINE=1``), or None."""
    for name in OFFLINE_VARS:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={os.environ[name]}"
    return None


def endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.lru_cache(maxsize=1)
def hub_problem() -> str | None:
    """Why the hub cannot be reached (a name that does not resolve, a refused or timed-out connection), or None.
    Behind a proxy the proxy decides: nothing is probed."""
    if any(os.environ.get(name) for name in PROXY_VARS):
        return None
    host, port = endpoint()
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{host}:{port}: {getattr(exc, 'strerror', None) or exc}"


def is_hub_id(path: str) -> bool:
    """A hub dataset id (``org/name``), not a local dataset folder or file."""
    return not Path(path).expanduser().exists()


def check_reachable(path: str, where: str) -> None:
    """Refuse, in one line and at once, to download hub dataset ``path`` when the hub cannot be reached (with the
    offline variables set, ``datasets`` reads its cache and fails fast by itself: see :func:`offline_hint`)."""
    if not is_hub_id(path) or offline_setting():
        return
    why = hub_problem()
    if why is not None:
        raise UsageError(f"{where}: the Hugging Face hub cannot be reached ({why}), so dataset {path!r} cannot be "
                         f"downloaded; run `fibattn prepare` where there is network and copy the data folder, or set "
                         f"HF_HUB_OFFLINE=1 to read datasets already in the local Hugging Face cache")


def offline_hint(path: str) -> str:
    """What to add to a failed load when the offline variables are set."""
    setting = offline_setting()
    if not setting or not is_hub_id(path):
        return ""
    return (f" ({setting} is set and {path!r} is not in the local Hugging Face cache: unset it on a machine with "
            f"network, or prepare the data where there is one)")
