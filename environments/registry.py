"""The pool's image registry, from a worker's side: name an image in it, ask whether it is
there, push a host's image to it and pull one from it onto another host (docs/operations.md,
"A pool's registry").

Docker itself pushes and pulls (the docker SDK, with REGISTRY_USERNAME/PASSWORD as its
auth_config); termpool's own questions (is this tag there, is the registry up, what may be
reclaimed) go to the registry's HTTP API v2. A registry that is down or refuses never fails a
run: push and pull log a warning naming the registry and return None, so the caller builds.

Each push and pull records the image's last use in Redis (Store.registry_used, when a store is given);
environments/registry_reclaim.py deletes what has not been used for REGISTRY_RETENTION_DAYS.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING

import docker
import redis
import requests

from environments.registry_server import is_local
from poolcore.config import RegistrySettings

if TYPE_CHECKING:
    from poolcore.state import Store

log = logging.getLogger(__name__)

NAMESPACE = "termpool"  # every image the pool pushes is under <registry>/termpool/
MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
    )
)
_SEPARATORS = re.compile(r"[._-]+")
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
PAGE = 1000  # catalog and tag list entries per request


class RegistryUnavailable(OSError):
    """The registry did not answer, or answered an error: the message names it."""


class PushRefused(Exception):
    """Docker's push stream reported an error."""


def split_ref(ref: str) -> tuple[str, str]:
    """'host:port/repo/name:tag' as ('host:port/repo/name', 'tag'); 'latest' when untagged."""
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:  # the colon was the registry's port, not a tag's
        return ref, "latest"
    return name, tag


def _component(part: str) -> str:
    """One path component as the distribution spec allows it: lowercase alphanumerics joined
    by one '.', '_', '__' or dashes."""
    part = re.sub(r"[^a-z0-9._-]+", "-", part.lower())
    part = _SEPARATORS.sub(lambda m: m[0] if m[0] in (".", "_", "__") or set(m[0]) == {"-"} else "-", part)
    return part.strip("._-") or "x"


def _tag(tag: str) -> str:
    tag = re.sub(r"[^\w.-]", "-", tag)[:128]
    return tag if re.match(r"\w", tag) else ("t" + tag)[:128]


class Registry:
    """The registry REGISTRY_URL names, as cfg has it; `usage`: a Redis client to record last
    use in (None: not recorded)."""

    def __init__(self, cfg: RegistrySettings, usage: Store | None = None):
        if not cfg.enabled:
            raise ValueError("the pool's registry is off (REGISTRY_URL=off)")
        self.cfg, self.usage = cfg, usage
        self.address = cfg.address
        self.session = requests.Session()
        # a proxy from the environment must not stand between a worker and its loopback registry
        self.session.trust_env = not is_local(cfg)

    def __repr__(self) -> str:
        return f"Registry({self.address!r})"

    # ---- names ------------------------------------------------------------------------------
    def remote_ref(self, local_name: str) -> str:
        """The image's name in the registry: '<address>/termpool/<name>:<tag>', the local name
        made valid there (lowercase, its own registry host a path component, a digest a tag)."""
        name, _, digest = local_name.partition("@")
        name, tag = (name, digest.replace(":", "-")) if digest else split_ref(name)
        path = "/".join(_component(part) for part in name.split("/"))
        return f"{self.address}/{NAMESPACE}/{path}:{_tag(tag)}"

    def repository(self, ref: str) -> str:
        """The repository's path inside the registry ('termpool/<name>'), for its HTTP API."""
        repo = split_ref(ref)[0]
        if not repo.startswith(self.address + "/"):
            raise ValueError(f"{ref!r} is not an image of registry {self.address}")
        return repo[len(self.address) + 1 :]

    # ---- questions over the HTTP API --------------------------------------------------------
    def reachable(self) -> bool:
        """Whether the registry answers its API (GET /v2/: 200, or 401 asking for credentials),
        within REGISTRY_TIMEOUT; never raises (for /status)."""
        try:
            reply = self.session.get(self.cfg.api + "/v2/", timeout=self.cfg.timeout)
        except requests.RequestException:
            return False
        return reply.status_code in (200, 401)

    def digest(self, ref: str) -> str | None:
        """The manifest digest the registry has under ref ('sha256:...'), None when it has no
        such image. Raises RegistryUnavailable when it cannot say."""
        repo, tag = self.repository(ref), split_ref(ref)[1]
        reply = self._request("HEAD", f"{repo}/manifests/{tag}", repo, "pull", headers={"Accept": MANIFEST_TYPES})
        if reply.status_code == 404:
            return None
        self._check(reply, f"manifest of {ref}")
        return reply.headers.get("Docker-Content-Digest")

    def has(self, ref: str) -> bool:
        """Whether the registry has the image ref. Raises RegistryUnavailable when it cannot say."""
        return self.digest(ref) is not None

    def repositories(self) -> list[str]:
        """Every repository in the registry (its catalog), e.g. 'termpool/tb__hello__client'."""
        return self._pages("_catalog", "", "repositories", scope="registry:catalog:*")

    def tags(self, repo: str) -> list[str]:
        """The tags of one repository (by its path inside the registry)."""
        return self._pages(f"{repo}/tags/list", repo, "tags")

    def delete(self, repo: str, digest: str) -> None:
        """Delete a manifest (and so every tag naming it in this repository); its blobs are
        freed by the registry's garbage collection. Raises RegistryUnavailable on a refusal."""
        reply = self._request("DELETE", f"{repo}/manifests/{digest}", repo, "delete")
        if reply.status_code != 404:  # already gone: as good as deleted
            self._check(reply, f"delete of {repo}@{digest}")

    # ---- Docker: push and pull ----------------------------------------------------------------
    def push(self, client: docker.DockerClient, local_image: str, ref: str = "") -> str | None:
        """Tag local_image with its registry name (`ref`, by default remote_ref's) and push it;
        returns the pushed manifest's digest. A failure logs a warning naming the registry and
        returns None (never raises: a push that fails must not fail a run). The registry name
        stays on the image (and gives it its RepoDigest): see untag."""
        ref = ref or self.remote_ref(local_image)
        repo, tag = split_ref(ref)
        try:
            client.images.get(local_image).tag(repo, tag)
            digest = self._pushed_digest(client.images.push(repo, tag=tag, stream=True, decode=True, **self._auth()))
        except (docker.errors.DockerException, requests.RequestException, PushRefused) as error:
            log.warning("registry %s: push of %s failed: %s", self.address, local_image, _short(error))
            return None
        if digest is None:
            log.warning("registry %s: push of %s reported no digest", self.address, local_image)
            return None
        self.touch(ref)
        log.info("registry %s: pushed %s as %s@%s", self.address, local_image, ref, digest)
        return digest

    @staticmethod
    def _pushed_digest(stream) -> str | None:
        """The digest in Docker's push progress (its last 'aux' line); an error line raises."""
        digest = None
        for line in stream:
            if line.get("error") or line.get("errorDetail"):
                raise PushRefused(line.get("error") or line["errorDetail"].get("message", "error"))
            digest = (line.get("aux") or {}).get("Digest") or digest
        return digest

    def pull(self, client: docker.DockerClient, ref: str, expected_digest: str | None = None, tag_as: str = ""):
        """Pull ref onto client's host; returns the image, or None when the pull failed (logged,
        naming the registry) or the image pulled is not expected_digest (it is removed again).
        tag_as: a local name to give it as well (the registry's stays: see untag)."""
        repo, tag = split_ref(ref)
        try:
            image = client.images.pull(repo, tag=tag, **self._auth())
        except (docker.errors.DockerException, requests.RequestException) as error:
            log.warning("registry %s: pull of %s failed: %s", self.address, ref, _short(error))
            return None
        if expected_digest and f"{repo}@{expected_digest}" not in image.attrs.get("RepoDigests", []):
            log.warning(
                "registry %s: %s is %s, not %s: discarded",
                self.address,
                ref,
                image.attrs.get("RepoDigests"),
                expected_digest,
            )
            self.untag(client, ref)
            return None
        if tag_as:
            image.tag(*split_ref(tag_as))
        self.touch(ref)
        return image

    def untag(self, client: docker.DockerClient, ref: str) -> None:
        """Remove the registry's name ref (remote_ref of a local name) from this host, and with
        it the image's RepoDigest; the image too when nothing else names it. What removes a
        pushed or pulled image from a host must remove this name as well as the local one, or
        the image stays. Never raises (a name already gone is fine)."""
        try:
            client.images.remove(ref)
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.DockerException as error:
            log.warning("registry %s: could not remove %s: %s", self.address, ref, _short(error))

    # ---- last use -----------------------------------------------------------------------------
    def touch(self, ref: str, at: float | None = None) -> None:
        """Record that ref was used now (reclaim keeps it REGISTRY_RETENTION_DAYS from here).
        Redis being away loses only this record: never raises."""
        if self.usage is None:
            return
        repo, tag = split_ref(ref)
        member = f"{repo[len(self.address) + 1 :]}:{tag}"
        try:
            self.usage.registry_used(member, time.time() if at is None else at)
        except redis.exceptions.RedisError as error:
            log.warning("registry %s: last use of %s not recorded: %s", self.address, ref, error)

    # ---- HTTP plumbing ------------------------------------------------------------------------
    def _auth(self) -> dict:
        """Docker's auth_config keyword, only when credentials are set (never logged)."""
        if not self.cfg.username:
            return {}
        return {"auth_config": {"username": self.cfg.username, "password": self.cfg.password}}

    def _basic(self):
        return (self.cfg.username, self.cfg.password) if self.cfg.username else None

    def _request(self, method: str, path: str, repo: str, action: str, scope: str = "", **kw) -> requests.Response:
        """One API request, with Basic credentials or, when the registry answers 401 with a
        Bearer challenge (token auth: Harbor, GHCR, Docker Hub...), a token for this scope."""
        url = f"{self.cfg.api}/v2/{path}"
        scope = scope or f"repository:{repo}:{action}"
        try:
            reply = self.session.request(method, url, auth=self._basic(), timeout=self.cfg.timeout, **kw)
            challenge = reply.headers.get("WWW-Authenticate", "")
            if reply.status_code == 401 and challenge.lower().startswith("bearer"):
                token = self._token(dict(_CHALLENGE.findall(challenge)), scope)
                kw["headers"] = {**kw.get("headers", {}), "Authorization": f"Bearer {token}"}
                reply = self.session.request(method, url, timeout=self.cfg.timeout, **kw)
        except requests.RequestException as error:
            raise RegistryUnavailable(f"registry {self.address} unreachable: {_short(error)}") from None
        return reply

    def _token(self, challenge: dict, scope: str) -> str:
        params = {"service": challenge.get("service", ""), "scope": scope}
        reply = self.session.get(
            challenge.get("realm", ""), params=params, auth=self._basic(), timeout=self.cfg.timeout
        )
        self._check(reply, "token")
        body = reply.json()
        return body.get("token") or body.get("access_token", "")

    def _check(self, reply: requests.Response, what: str) -> None:
        if reply.status_code >= 300:
            raise RegistryUnavailable(f"registry {self.address}: {what}: HTTP {reply.status_code} {reply.text[:200]}")

    def _pages(self, path: str, repo: str, field: str, scope: str = "") -> list[str]:
        """A paginated list (catalog, tags): follows the Link header's next page."""
        items: list[str] = []
        params: dict | None = {"n": PAGE}
        while True:
            reply = self._request("GET", path, repo, "pull", scope, params=params)
            self._check(reply, path)
            items += reply.json().get(field) or []
            following = reply.links.get("next", {}).get("url")
            if not following:
                return items
            path, params = following.split("/v2/", 1)[1], None


def _short(error: Exception) -> str:
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
