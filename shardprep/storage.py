"""Storage: fsspec URLs for the builder: which paths are URLs, opening their filesystem with
bounded defaults, and turning a backend's exception into one message naming the URL.

Local paths and ``file://`` URLs never come here. Any other ``protocol://`` URL (``s3://``,
``gs://``, ``memory://``, chained ``simplecache::s3://``) is opened with
``fsspec.core.url_to_fs(url, **storage_options)``, so credentials, profiles, endpoints and
anonymous access are the backend's own options and environment variables (for s3fs: ``key``,
``secret``, ``profile``, ``anon``, ``client_kwargs={"endpoint_url": ...}``; ``AWS_PROFILE``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``
as botocore reads them).

For S3 the defaults bound every wait (:data:`S3_DEFAULTS`): a 5 s connect timeout and a 15 s
read timeout (a wait for the next bytes, not a whole transfer; s3fs's own defaults, stated),
and botocore's "standard" retry mode with ``max_attempts`` 3 (botocore counts retries there:
4 attempts in all; it retries refused connections, throttling and 5xx answers). s3fs retries read timeouts and
bodies cut short 5 times on top, so an endpoint that accepts connections and never answers
takes minutes to fail at these settings: the build's first contact with OUT therefore has an
overall deadline of its own (``destination.CONTACT_TIMEOUT_S``).
Options in ``fsspec.config.conf`` (``FSSPEC_S3_*`` variables) replace these defaults and
``storage_options`` replace both, one key deep: ``config_kwargs={"read_timeout": 300}`` keeps
the other defaults of ``config_kwargs``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from shardprep.format.errors import OutputError
from shardprep.format.interface import CLI, Interface
from shardprep.format.storage_options import merge_options

__all__ = [
    "S3_DEFAULTS",
    "credentials_problem",
    "describe_error",
    "endpoint_hint",
    "is_url",
    "local_path",
    "open_url",
]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-:]*://")
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 15,
        "retries": {"max_attempts": 3, "mode": "standard"},
    }
}
_EXTRAS = {"s3": "s3", "s3a": "s3"}


def is_url(path: str) -> bool:
    """True for a URL that needs fsspec: ``protocol://`` other than ``file://``."""
    return bool(_URL.match(path)) and not path.startswith("file://")


def local_path(path: str) -> str:
    """A local path or ``file://`` URL as a plain path."""
    return path[len("file://") :] if path.startswith("file://") else path


def _protocol(url: str) -> str:
    """The innermost protocol of ``url`` (``s3`` for ``simplecache::s3://b/k``)."""
    return url.split("::")[-1].split("://", 1)[0]


def open_url(
    url: str, storage_options: Mapping[str, Any] | None = None, interface: Interface = CLI
) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` (a new instance) and the path inside it (``interface``:
    how a refusal names the storage options, ``--storage-option`` or ``storage_options=``).

    Raises:
        OutputError: fsspec or the protocol's backend is not installed (naming the extra or
            package to install), or the protocol is unknown.
    """
    protocol = _protocol(url)
    try:
        import fsspec
        import fsspec.config
        import fsspec.core
    except ImportError as err:
        raise OutputError(
            f"{url}: object storage needs fsspec and the backend of {protocol}://: "
            f'pip install "shardprep[s3]" (for s3://) or fsspec plus the backend',
            url,
        ) from err
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError as err:
        raise OutputError(
            f"{url}: unknown protocol {protocol!r} (fsspec knows no such filesystem); check the "
            "URL, or install the fsspec backend that provides it",
            url,
        ) from err
    except ImportError as err:
        extra = _EXTRAS.get(protocol)
        how = f'pip install "shardprep[{extra}]"' if extra else f"{err}".rstrip(".")
        raise OutputError(f"{url}: the {protocol}:// backend is not installed: {how}", url) from err
    # a deep copy: botocore rewrites the ``retries`` dict it is given in place
    defaults: dict[str, Any] = copy.deepcopy(S3_DEFAULTS) if protocol in _EXTRAS else {}
    protocols = cls.protocol if isinstance(cls.protocol, (tuple, list)) else [cls.protocol]
    configured = {key for p in protocols for key in fsspec.config.conf.get(p, {})}
    defaults = {k: v for k, v in defaults.items() if k not in configured}
    options = merge_options(defaults, storage_options or {})
    try:
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    except TypeError as err:  # an option the backend does not take
        raise OutputError(
            f"{url}: the {protocol}:// backend refused the storage options ({err}); "
            f"check the names given with {interface.option('storage_options')} against its "
            "documentation",
            url,
        ) from err
    return fs, str(path)


def _credentials_hint(interface: Interface) -> str:
    """Where the backend takes credentials from, the storage options named as the caller
    gives them: ``--storage-option profile=...`` or ``storage_options={'profile': ...}``."""
    if interface.cli:
        options = "--storage-option profile=..., key=..., secret=..., anon=true"
    else:
        options = "storage_options={'profile': ...}, {'key': ..., 'secret': ...} or {'anon': True}"
    return (
        "(for S3: AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or "
        f"{options} for a public bucket)"
    )


ENDPOINT_EXAMPLE = {"client_kwargs": {"endpoint_url": "..."}}


def endpoint_hint(interface: Interface = CLI) -> str:
    """How to name an S3-compatible endpoint, as the caller gives storage options:
    ``--storage-option 'client_kwargs={"endpoint_url": "..."}' or AWS_ENDPOINT_URL``."""
    return f"{interface.setting('storage_options', ENDPOINT_EXAMPLE)} or AWS_ENDPOINT_URL"


# exception class names (botocore, google-auth, azure-identity) that mean "no usable
# credentials were found", before any request was sent
_NO_CREDENTIALS = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "NoAuthTokenError",
        "DefaultCredentialsError",
        "CredentialUnavailableError",
    }
)
# S3 error codes that mean "the credentials sent are not valid" (not: valid, but not allowed)
_BAD_CREDENTIALS = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "AuthorizationHeaderMalformed",
    }
)


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from (``__cause__``, else ``__context__``)."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def credentials_problem(err: BaseException) -> str | None:
    """What is wrong with the credentials if ``err`` (or what it was raised from) says they
    are missing or not valid; None for any other error (access denied to valid ones too)."""
    for item in _chain(err):
        names = {cls.__name__ for cls in type(item).__mro__}
        if names & _NO_CREDENTIALS:
            return f"no credentials found ({type(item).__name__}: {item})"
        response = getattr(item, "response", None)  # botocore's ClientError
        error = response.get("Error") if isinstance(response, dict) else None
        if isinstance(error, dict) and error.get("Code") in _BAD_CREDENTIALS:
            return f"the credentials are not valid ({error['Code']}: {error.get('Message', '')})"
    return None


def describe_error(url: str, err: BaseException, interface: Interface = CLI) -> str:
    """``url``, what went wrong talking to its storage, and what to check; one line
    (``interface``: how the hints name the storage options, the build's caller's way)."""
    credentials = credentials_problem(err)
    hint = _credentials_hint(interface)
    if credentials is not None:
        return f"{url}: {credentials}; set the credentials the backend uses {hint}"
    if isinstance(err, FileNotFoundError) and "bucket" in str(err).lower():
        return f"{url}: the bucket does not exist ({err}); create it or fix the URL"
    if isinstance(err, PermissionError):
        return (
            f"{url}: access denied ({err}); check the credentials the backend uses "
            f"{hint} and the bucket's permissions"
        )
    if isinstance(err, FileNotFoundError):
        return f"{url}: not found ({err})"
    if isinstance(err, TypeError) and "unexpected keyword argument" in str(err):
        return (  # the client takes the storage options at its first request
            f"{url}: the storage client refused an option ({err}); pass the options its "
            f"fsspec filesystem takes {hint}"
        )
    name = type(err).__name__
    return (
        f"{url}: cannot reach the storage ({name}: {err}); check the endpoint "
        f"({endpoint_hint(interface)}) and the network"
    )
