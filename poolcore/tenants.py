"""The tenants file (TENANTS_FILE, docs/tenants.md): who may use the pool, with which token and limits.

    tenants:
      trainer-a: {token: "...", max_runs: 64, reserved_runs: 16, priority: train}

Read and checked once, when settings are loaded: anything wrong refuses the start with the
file and the line (TenantsFileError), because a pool that guessed at a limit would hand out
capacity nobody meant to give. Tokens never appear in a repr or a message.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from poolcore import priorities

# A tenant's name goes into Redis keys, Lua and log lines: a safe identifier only.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: what a Bearer header carries
PRIORITIES = priorities.CLASSES
KEYS = {"token", "max_runs", "reserved_runs", "priority", "max_builds", "max_upload_bytes"}


class TenantsFileError(ValueError):
    """The tenants file is unusable; the message names the file and line."""


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str = field(repr=False)
    max_runs: int | None = None  # live runs at most; None: no limit of its own
    reserved_runs: int = 0  # slots no other tenant may take while it uses fewer
    priority: str = priorities.DEFAULT
    max_builds: int | None = None  # image builds in flight for its runs at most (tasks/build_quota.py)
    max_upload_bytes: int | None = None  # unpacked bytes of its held uploaded tasks at most


@dataclass(frozen=True)
class Tenants:
    """The tenants by name; empty when there is no tenants file (today's single-tenant pool)."""

    by_name: dict = field(default_factory=dict)
    path: str = ""

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def __repr__(self) -> str:  # no tokens, even through the dataclass's repr of by_name
        return f"Tenants({sorted(self.by_name)!r}, path={self.path!r})"

    def for_token(self, token: str) -> Tenant | None:
        """The tenant this bearer token names. Looked up by digest, so the dict's compare
        does not walk the secret itself byte by byte."""
        return self._by_digest().get(_digest(token))

    def _by_digest(self) -> dict:
        cached = self.__dict__.get("_digests")
        if cached is None:
            cached = {_digest(t.token): t for t in self.by_name.values()}
            object.__setattr__(self, "_digests", cached)
        return cached

    def reservations(self) -> dict[str, int]:
        """reserved_runs of each tenant that has some (what placement holds back for them)."""
        return {name: t.reserved_runs for name, t in self.by_name.items() if t.reserved_runs}

    def build_limits(self) -> dict[str, int]:
        """max_builds of each tenant that has one: what the workers read (Store.publish_build_limits)."""
        return {name: t.max_builds for name, t in self.by_name.items() if t.max_builds is not None}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def load(path: str, admin_token: str = "") -> Tenants:
    """The tenants of the file at `path` ("" or unset: none); TenantsFileError when unusable."""
    if not path:
        return Tenants()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"{path}: cannot read the tenants file: {exc}") from None
    return parse(text, path, admin_token)


def parse(text: str, path: str = "<tenants>", admin_token: str = "") -> Tenants:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes keep their line numbers
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise TenantsFileError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if root is None:
        raise TenantsFileError(f"{path}:1: empty tenants file; it needs a `tenants:` mapping")
    top = _mapping(root, path, "the file")
    if set(top) != {"tenants"}:
        extra = sorted(set(top) - {"tenants"})
        node = top[extra[0]][0] if extra else root
        raise TenantsFileError(f"{_at(path, node)}: the file holds one key, `tenants` (found {extra or 'none'})")
    tenants: dict[str, Tenant] = {}
    tokens: dict[str, str] = {}
    for name, (key_node, value) in _mapping(top["tenants"][1], path, "`tenants`").items():
        tenant = _tenant(name, key_node, value, path)
        if tenant.token in tokens:
            raise TenantsFileError(
                f"{_at(path, value)}: tenant {name!r} has the token of tenant {tokens[tenant.token]!r}"
            )
        if admin_token and tenant.token == admin_token:
            raise TenantsFileError(f"{_at(path, value)}: tenant {name!r} has the operator's token (POOL_API_TOKEN)")
        tokens[tenant.token] = name
        tenants[name] = tenant
    if not tenants:
        raise TenantsFileError(f"{_at(path, top['tenants'][1])}: `tenants` names no tenant")
    return Tenants(by_name=tenants, path=path)


def _at(path: str, node) -> str:
    return f"{path}:{node.start_mark.line + 1}"


def _mapping(node, path: str, what: str) -> dict:
    """A mapping node's entries by key: (key node, value node); duplicate or non-text keys refused."""
    if not isinstance(node, yaml.MappingNode):
        raise TenantsFileError(f"{_at(path, node)}: {what} must be a mapping")
    out: dict = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag != "tag:yaml.org,2002:str":
            raise TenantsFileError(f"{_at(path, key)}: a key of {what} must be text")
        if key.value in out:
            raise TenantsFileError(f"{_at(path, key)}: {key.value!r} appears twice in {what}")
        out[key.value] = (key, value)
    return out


def _tenant(name: str, key_node, node, path: str) -> Tenant:
    if not NAME.fullmatch(name):
        raise TenantsFileError(
            f"{_at(path, key_node)}: tenant name {name!r} is not a safe identifier "
            "(letters, digits, '_', '.', '-'; starting with a letter or digit; at most 64)"
        )
    entries = _mapping(node, path, f"tenant {name!r}")
    unknown = sorted(set(entries) - KEYS)
    if unknown:
        raise TenantsFileError(
            f"{_at(path, entries[unknown[0]][0])}: tenant {name!r}: unknown key {unknown[0]!r} "
            f"(known: {', '.join(sorted(KEYS))})"
        )
    if "token" not in entries:
        raise TenantsFileError(f"{_at(path, node)}: tenant {name!r} has no token")
    token_node = entries["token"][1]
    if token_node.tag != "tag:yaml.org,2002:str" or not TOKEN.fullmatch(token_node.value):
        raise TenantsFileError(f"{_at(path, token_node)}: tenant {name!r}: token must be printable text without spaces")
    max_runs = _limit(entries.get("max_runs"), name, "max_runs", path)
    reserved = _limit(entries.get("reserved_runs"), name, "reserved_runs", path) or 0
    if max_runs is not None and reserved > max_runs:
        where = _at(path, entries["reserved_runs"][1])
        raise TenantsFileError(f"{where}: tenant {name!r}: reserved_runs ({reserved}) is above max_runs ({max_runs})")
    priority = _priority(entries.get("priority"), name, path)
    builds = _limit(entries.get("max_builds"), name, "max_builds", path)
    upload_bytes = _limit(entries.get("max_upload_bytes"), name, "max_upload_bytes", path)
    return Tenant(name, token_node.value, max_runs, reserved, priority, builds, upload_bytes)


def _limit(entry, name: str, key: str, path: str) -> int | None:
    if entry is None:
        return None
    node = entry[1]
    if node.tag != "tag:yaml.org,2002:int" or not re.fullmatch(r"[0-9]+", node.value.replace("_", "")):
        raise TenantsFileError(
            f"{_at(path, node)}: tenant {name!r}: {key} must be a non-negative integer, not {node.value!r}"
        )
    return int(node.value.replace("_", ""))


def _priority(entry, name: str, path: str) -> str:
    if entry is None:
        return priorities.DEFAULT
    node = entry[1]
    if not isinstance(node, yaml.ScalarNode) or node.value not in PRIORITIES:
        raise TenantsFileError(f"{_at(path, node)}: tenant {name!r}: priority must be one of {', '.join(PRIORITIES)}")
    return node.value
