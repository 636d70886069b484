"""TLS credentials of the services, read from PEM files and re-read when the files change.

A server's files are its certificate chain, its private key and, for mutual TLS, the CA bundle
its clients' certificates must be signed by. Every new connection looks at the files' status
(modification time, inode, size: a Kubernetes Secret update swaps a symlink, cert-manager and
``cp`` rewrite in place) and, when it changed, reads them again; connections already open keep
the certificate they started with. New files that do not load (a key written before its
certificate, say) are logged once and the last good ones stay in use, so a rotation in progress
never takes a server down.

- gRPC servers: :func:`server_credentials`, grpc's ``dynamic_ssl_server_credentials`` whose fetch
  callback gRPC calls before each handshake.
- The HTTP API (uvicorn): :class:`ReloadingSSLContext`, an ``ssl.SSLContext`` whose handshake
  callback (``sni_callback``, called on every ClientHello, with or without SNI) switches the
  connection to a context loaded from the new files. uvicorn takes it through its
  ``ssl_context_factory`` (uvicorn >= 0.47); uvicorn's own ``ssl_certfile`` would be read once.
- gRPC clients: :func:`channel_credentials`, read when called; :func:`reloading_channel_credentials`
  for a client that makes new channels when its files change (the coordinator's links to the
  draft and verify services: a gRPC channel keeps the credentials it was made with).

Misconfiguration (a missing file, a key that does not match its certificate, a file that is not
PEM) raises :class:`TLSFileError` naming the setting, so a service fails at start, not at its first
handshake.
"""

import logging
import os
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


class TLSFileError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the setting to fix."""


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of ``path``. Raises TLSFileError naming ``setting`` when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise TLSFileError(f"{setting} {path}: {err.strerror}: give a readable PEM file") from None


def _load_key_pair(context: ssl.SSLContext, cert_file: str, key_file: str, settings: tuple[str, str]) -> None:
    for path, setting in zip((cert_file, key_file), settings, strict=True):
        read_pem(path, setting)
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as err:
        raise TLSFileError(
            f"{settings[0]} {cert_file} / {settings[1]} {key_file}: {err.reason or err}: give a PEM certificate "
            "chain and the private key it was issued for"
        ) from None


def _load_ca(context: ssl.SSLContext, ca_file: str, setting: str) -> None:
    read_pem(ca_file, setting)
    try:
        context.load_verify_locations(ca_file)
    except ssl.SSLError as err:
        raise TLSFileError(f"{setting} {ca_file}: {err.reason or err}: give a PEM CA bundle") from None


def server_ssl_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """A server-side context presenting ``cert_file`` / ``key_file``; with ``client_ca_file``, it
    requires a client certificate signed by a CA in that bundle. Raises TLSFileError naming the
    setting (``tls_cert_file``, ``tls_key_file``, ``tls_client_ca_file``) when a file is missing or
    unusable, or the key does not match the certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_key_pair(context, cert_file, key_file, ("tls_cert_file", "tls_key_file"))
    if client_ca_file:
        _load_ca(context, client_ca_file, "tls_client_ca_file")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def check_client_files(ca_file: str, cert_file: str, key_file: str, settings: tuple[str, str, str]) -> None:
    """Checks a client's CA bundle and certificate and key (both or neither; empty: not used),
    set by the settings named ``settings`` (ca, cert, key). Raises TLSFileError naming them."""
    if bool(cert_file) != bool(key_file):
        raise TLSFileError(f"{settings[1]} and {settings[2]}: set both (a client certificate) or neither")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca_file:
        _load_ca(context, ca_file, settings[0])
    if cert_file:
        _load_key_pair(context, cert_file, key_file, settings[1:])


class Reloading(Generic[T]):
    """``value``, built by ``build`` from the files at ``paths`` (empty ones ignored), built again
    by :meth:`latest` when their status changed (see the module docstring). ``build`` raises
    TLSFileError for unusable files; the first build's error fails the construction."""

    def __init__(self, paths: list[str], build: Callable[[], T]):
        self.paths, self.build = [p for p in paths if p], build
        self._lock = threading.Lock()
        self._stamp = self._status()
        self.value = build()  # raises: unusable files fail the start
        self._failed: tuple | None = None  # the status whose files did not load (logged once)

    def _status(self) -> tuple | None:
        try:
            return tuple((s.st_mtime_ns, s.st_ino, s.st_size) for s in map(os.stat, self.paths))
        except OSError:
            return None  # a file missing for a moment, mid-rotation

    def latest(self) -> T | None:
        """The value built from changed files; None while the files are unchanged or unusable."""
        with self._lock:
            status = self._status()
            if status is None or status == self._stamp or status == self._failed:
                return None
            try:
                self.value = self.build()
            except TLSFileError as err:
                self._failed = status
                log.error("new TLS files do not load, still serving the previous ones: %s", err)
                return None
            self._stamp = status
            log.info("TLS files changed: loaded %s", ", ".join(self.paths))
            return self.value


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials:
    """gRPC server credentials from PEM files, re-read when they change (each new connection
    checks). With ``client_ca_file`` a client must present a certificate signed by a CA in it
    (mutual TLS); else none is asked for. Raises TLSFileError naming the setting to fix."""

    def configuration():
        server_ssl_context(cert_file, key_file, client_ca_file)  # raises for unusable files
        pair = (read_pem(key_file, "tls_key_file"), read_pem(cert_file, "tls_cert_file"))
        ca = read_pem(client_ca_file, "tls_client_ca_file") if client_ca_file else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    files = Reloading([cert_file, key_file, client_ca_file], configuration)
    return grpc.dynamic_ssl_server_credentials(
        files.value, files.latest, require_client_authentication=bool(client_ca_file)
    )


class ReloadingSSLContext:
    """A server-side ``ssl.SSLContext`` (``.context``) for asyncio servers whose certificate follows
    the files: each handshake first checks them, and a connection starts on the latest context
    loaded. The files as for :func:`server_ssl_context`, which raises TLSFileError for unusable ones."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = ""):
        paths = [cert_file, key_file, client_ca_file]
        self._files = Reloading(paths, lambda: self._load(*paths))
        self.context = self._files.value

    def _load(self, cert_file: str, key_file: str, client_ca_file: str) -> ssl.SSLContext:
        context = server_ssl_context(cert_file, key_file, client_ca_file)
        context.sni_callback = self._on_client_hello
        return context

    def _on_client_hello(self, connection, _server_name, _context) -> None:
        self._files.latest()
        if connection.context is not self._files.value:
            connection.context = self._files.value


def channel_credentials(
    ca_file: str = "", cert_file: str = "", key_file: str = "", settings: tuple[str, str, str] = ("ca", "cert", "key")
) -> grpc.ChannelCredentials:
    """gRPC client credentials: server certificates checked against ``ca_file`` (empty: the
    system's roots); ``cert_file`` / ``key_file``, the client certificate a mutual-TLS server asks
    for (empty: none). Raises TLSFileError naming the setting (of ``settings``: ca, cert, key) of
    an unusable file."""
    check_client_files(ca_file, cert_file, key_file, settings)
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, settings[0]) if ca_file else None,
        private_key=read_pem(key_file, settings[2]) if key_file else None,
        certificate_chain=read_pem(cert_file, settings[1]) if cert_file else None,
    )


def reloading_channel_credentials(
    ca_file: str, cert_file: str, key_file: str, settings: tuple[str, str, str]
) -> Reloading[grpc.ChannelCredentials]:
    """:func:`channel_credentials` of the files, built again (``latest()``) when they change.
    Raises TLSFileError naming the setting of an unusable file."""
    paths = [ca_file, cert_file, key_file]
    return Reloading(paths, lambda: channel_credentials(ca_file, cert_file, key_file, settings))
