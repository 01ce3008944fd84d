"""The pool's image registry (environments/registry.py, registry_server.py, registry_reclaim.py)
against a real one: Debian's docker-registry, the embedded default that scripts/test.sh starts
(start-backends.sh), and a private one per module on a free port for pushes, pulls and reclaim.
An image built on this machine's daemon is pulled on a second daemon (tests/second_docker.py),
which runs in the same network namespace: it reaches 127.0.0.1:<port> as this one does, and
Docker trusts registries on 127.0.0.0/8 without TLS, so it needs no insecure-registries."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import time
import uuid
import warnings

import docker
import pytest

from devstack import free_port
from devstack.second_docker import SecondDocker
from environments import registry_server
from environments.registry import Registry, RegistryUnavailable
from environments.registry_reclaim import reclaim
from poolcore.config import EMBEDDED_REGISTRY, load_registry, load_settings
from poolcore.state import Store
from tests.conftest import wait_for
from tests.second_docker import second_docker  # noqa: F401 (the fixture)

DAY = 86400.0


# ---- settings -----------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("ftp://reg:5000", "the scheme must be http or https"),
        ("http://reg:5000/v2", "no path"),
        ("reg:5000/termpool", "no path"),
        ("user:secret@reg:5000", "no path, query, user"),
        ("http://", "the host is empty"),
        (":5000", "the host is empty or not a host name"),
        ("-reg-", "not a host name"),
        ("reg:0", "the port must be a number from 1 to 65535"),
        ("reg:65536", "the port must be a number from 1 to 65535"),
        ("reg:http", "the port must be a number from 1 to 65535"),
        ("reg:", "the port must be a number from 1 to 65535"),
    ],
)
def test_bad_registry_urls_are_refused_at_start(value, says):
    with pytest.raises(ValueError, match="REGISTRY_URL must be host") as refused:
        load_settings({"REGISTRY_URL": value})
    assert says in str(refused.value) and repr(value) in str(refused.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("value", "address", "api"),
    [
        ("", EMBEDDED_REGISTRY, "http://" + EMBEDDED_REGISTRY),
        ("localhost:5000", "localhost:5000", "http://localhost:5000"),
        ("Registry.Example.com", "registry.example.com", "https://registry.example.com"),
        ("http://10.0.0.5:18082/", "10.0.0.5:18082", "http://10.0.0.5:18082"),
        ("https://10.0.0.5", "10.0.0.5", "https://10.0.0.5"),
        ("[::1]:5000", "[::1]:5000", "http://[::1]:5000"),
    ],
)
def test_registry_urls(value, address, api):
    cfg = load_registry({"REGISTRY_URL": value})
    assert (cfg.address, cfg.api, cfg.enabled) == (address, api, True)


@pytest.mark.unit
def test_registry_settings_off_api_url_and_secrets():
    assert not load_registry({"REGISTRY_URL": "OFF"}).enabled
    cfg = load_registry({"REGISTRY_API_URL": "http://registry:5000", "REGISTRY_PASSWORD": "hunter2x"})
    assert (cfg.address, cfg.api) == (EMBEDDED_REGISTRY, "http://registry:5000")
    cfg = load_registry({"REGISTRY_USERNAME": "pool", "REGISTRY_PASSWORD": "hunter2x"})
    assert cfg.password == "hunter2x"
    assert "hunter2x" not in repr(cfg) and "hunter2x" not in repr(load_settings({"REGISTRY_PASSWORD": "hunter2x"}))
    with pytest.raises(ValueError, match="REGISTRY_RETENTION_DAYS"):
        load_registry({"REGISTRY_RETENTION_DAYS": "-1"})
    with pytest.raises(ValueError, match="REGISTRY_TIMEOUT"):
        load_registry({"REGISTRY_TIMEOUT": "0"})
    with pytest.raises(ValueError, match="REGISTRY_API_URL"):
        load_registry({"REGISTRY_API_URL": "gopher://x"})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("local", "remote"),
    [
        ("tb__hello-world__client", "r:1/termpool/tb__hello-world__client:latest"),
        ("Tb__Hello__client:v1", "r:1/termpool/tb__hello__client:v1"),
        ("ghcr.io/org/img:1.2", "r:1/termpool/ghcr.io/org/img:1.2"),
        ("localhost:5000/x/y", "r:1/termpool/localhost-5000/x/y:latest"),
        ("img@sha256:" + "a" * 64, "r:1/termpool/img:sha256-" + "a" * 64),
        ("a..b___c-_d", "r:1/termpool/a-b-c-d:latest"),
    ],
)
def test_remote_names_are_valid_in_a_registry(local, remote):
    assert Registry(load_registry({"REGISTRY_URL": "r:1"})).remote_ref(local) == remote


# ---- a real registry --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A private embedded registry on a free port, started as start-backends.sh starts one."""
    data_dir = tmp_path_factory.mktemp("registry")
    cfg = load_registry({"REGISTRY_URL": f"127.0.0.1:{free_port()}", "REGISTRY_DATA_DIR": str(data_dir)})
    assert "started" in registry_server.ensure_running(cfg)
    pid = int((data_dir / "registry.pid").read_text())
    try:
        yield Registry(cfg)
    finally:
        os.kill(pid, signal.SIGTERM)


@pytest.fixture
def tiny_image(docker_client, base_image):
    """A new image on this machine's daemon, a marker file its only layer; removed after."""
    name = "termpool-registry-test:" + uuid.uuid4().hex[:10]
    dockerfile = f"FROM {base_image}\nRUN echo {name} > /marker\n".encode()
    image, _ = docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=name, rm=True)
    yield name
    docker_client.images.remove(image.id, force=True)  # every name of it (the registry's too)


def test_the_embedded_registry_answers():
    """test.sh's start-backends.sh started it (or this does): a second start starts none."""
    cfg = load_registry({})
    registry_server.ensure_running(cfg)
    assert registry_server.answers(cfg)
    assert registry_server.ensure_running(cfg) == f"registry {EMBEDDED_REGISTRY} already answers"
    assert Registry(cfg).reachable()


def test_an_image_pushed_from_one_host_is_pulled_on_another(registry, docker_client, second_docker, tiny_image):  # noqa: F811
    ref = registry.remote_ref(tiny_image)
    assert not registry.has(ref)
    digest = registry.push(docker_client, tiny_image)
    assert digest and digest.startswith("sha256:")
    assert registry.has(ref) and registry.digest(ref) == digest
    other = second_docker.client()
    try:
        image = registry.pull(other, ref, expected_digest=digest, tag_as=tiny_image)
        assert image is not None
        assert f"{ref.rpartition(':')[0]}@{digest}" in image.attrs["RepoDigests"]
        marker = other.containers.run(tiny_image, ["cat", "/marker"], remove=True)
        assert marker.decode().strip() == tiny_image
        registry.untag(other, ref)  # the registry's name off: the local name alone then removes it
        other.images.remove(tiny_image)
        assert not _exists(other, image.id)
    finally:
        other.images.remove(tiny_image, force=True) if _exists(other, tiny_image) else None
        other.close()


def test_a_pulled_image_of_another_digest_is_discarded(registry, docker_client, second_docker, tiny_image):  # noqa: F811
    ref = registry.remote_ref(tiny_image)
    assert registry.push(docker_client, tiny_image)
    other = second_docker.client()
    try:
        assert registry.pull(other, ref, expected_digest="sha256:" + "0" * 64) is None
        assert not _exists(other, ref)
        assert registry.pull(other, registry.remote_ref("termpool-never-pushed:x")) is None  # absent: None too
    finally:
        other.close()


def test_an_unreachable_registry_fails_nothing(docker_client, tiny_image, caplog):
    closed = f"127.0.0.1:{free_port()}"
    secret = "pw-" + uuid.uuid4().hex
    settings = {
        "REGISTRY_URL": closed,
        "REGISTRY_TIMEOUT": "1",
        "REGISTRY_USERNAME": "pool",
        "REGISTRY_PASSWORD": secret,
    }
    registry = Registry(load_registry(settings))
    started = time.monotonic()
    assert not registry.reachable()
    assert registry.push(docker_client, tiny_image) is None
    assert registry.pull(docker_client, registry.remote_ref(tiny_image)) is None
    assert time.monotonic() - started < 30
    with pytest.raises(RegistryUnavailable, match=f"registry {closed} unreachable"):
        registry.has(registry.remote_ref(tiny_image))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"registry {closed}: push of {tiny_image} failed" in w for w in warnings), warnings
    assert secret not in caplog.text and secret not in repr(registry) and secret not in repr(registry.cfg)


def test_reclaim_deletes_what_no_host_used_within_the_retention(
    registry, docker_client, redis_server, base_image, monkeypatch
):
    """Two tags: one last used 20 days ago, one now; with 14 days' retention only the old one's
    manifest is deleted, a tag seen for the first time starts its clock, and the storage is
    collected."""
    registry.usage = store = Store(redis_server)
    names = []
    try:
        for _ in range(3):
            name = "termpool-registry-gc:" + uuid.uuid4().hex[:10]
            dockerfile = f"FROM {base_image}\nRUN echo {name} > /marker\n".encode()
            docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=name, rm=True)
            names.append(name)
            assert registry.push(docker_client, name)
        old, recent, unknown = (registry.remote_ref(n) for n in names)
        monkeypatch.setattr("environments.registry.PAGE", 1)  # one tag a page: the Link header is followed
        assert sorted(registry.tags(registry.repository(old))) == sorted(n.rpartition(":")[2] for n in names)
        registry.touch(old, at=time.time() - 20 * DAY)
        store.registry_forget([registry.repository(unknown) + ":" + unknown.rpartition(":")[2]])
        assert reclaim(registry, store, dry_run=True).deleted == [registry.repository(old) + ":" + names[0][-10:]]
        assert registry.has(old)  # a dry run deletes nothing
        done = reclaim(registry, store)
        assert done.deleted == [registry.repository(old) + ":" + names[0][-10:]] and not done.failed
        assert not registry.has(old) and registry.has(recent) and registry.has(unknown)
        blobs = registry.cfg.data_dir / "docker" / "registry" / "v2" / "blobs"
        before = sum(1 for _ in blobs.rglob("data"))
        registry_server.garbage_collect(registry.cfg)
        assert sum(1 for _ in blobs.rglob("data")) < before  # the old image's own layer and config
        assert store.registry_last_used(registry.repository(unknown) + ":" + names[2][-10:]) is not None
    finally:
        registry.usage = None
        for name in names:
            docker_client.images.remove(docker_client.images.get(name).id, force=True)


def _htpasswd(path, user: str, password: str) -> None:
    with warnings.catch_warnings():  # crypt: deprecated from 3.11 on, and here the one bcrypt at hand
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

    path.write_text(f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")


def test_credentials_reach_docker_and_the_api(docker_client, tmp_path, tiny_image):
    """A registry that asks for credentials (htpasswd): without them, or with a wrong password,
    it is reachable but has() cannot say and push fails cleanly; with them every call works."""
    _htpasswd(tmp_path / "htpasswd", "pool", "right-password")
    address = f"127.0.0.1:{free_port()}"
    cfg = load_registry({"REGISTRY_URL": address, "REGISTRY_DATA_DIR": str(tmp_path)})
    auth = {
        "REGISTRY_AUTH": "htpasswd",
        "REGISTRY_AUTH_HTPASSWD_REALM": "termpool",
        "REGISTRY_AUTH_HTPASSWD_PATH": str(tmp_path / "htpasswd"),
    }
    env = {**registry_server.server_env(cfg, address), **auth}
    with open(tmp_path / "registry.log", "wb") as log:
        server = subprocess.Popen(
            ["docker-registry", "serve", str(registry_server.CONFIG)], env=env, stdout=log, stderr=log
        )
    try:
        wait_for(lambda: registry_server.answers(cfg), 15)
        for password in ("", "wrong-password"):
            anonymous = Registry(
                load_registry(
                    {
                        "REGISTRY_URL": address,
                        "REGISTRY_USERNAME": "pool" if password else "",
                        "REGISTRY_PASSWORD": password,
                    }
                )
            )
            assert anonymous.reachable()
            with pytest.raises(RegistryUnavailable, match=f"registry {address}: manifest of .*HTTP 401"):
                anonymous.has(anonymous.remote_ref(tiny_image))
            assert anonymous.push(docker_client, tiny_image) is None
        registry = Registry(
            load_registry({"REGISTRY_URL": address, "REGISTRY_USERNAME": "pool", "REGISTRY_PASSWORD": "right-password"})
        )
        digest = registry.push(docker_client, tiny_image)
        ref = registry.remote_ref(tiny_image)
        assert (
            digest and registry.digest(ref) == digest and registry.repositories() == ["termpool/termpool-registry-test"]
        )
        assert registry.pull(docker_client, ref, expected_digest=digest) is not None
    finally:
        server.terminate()
        server.wait(timeout=30)


def _host_address() -> str:
    """This machine's own address on its default route (no packet is sent), or "" without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return ""
        return probe.getsockname()[0]


def test_across_machines_a_daemon_trusts_the_registry_by_insecure_registries(
    docker_client, tmp_path, tiny_image, caplog
):
    """docs/operations.md's private-network setup: the embedded registry published on every
    address (REGISTRY_LISTEN=0.0.0.0:<port>), the serving host pushing by its loopback name,
    another host naming it by this machine's address. A daemon that does not list that address
    in its insecure-registries fails the pull cleanly (None, a warning); one that does pulls
    the same digest."""
    address, port = _host_address(), free_port()
    if not address or address.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    cfg = load_registry({"REGISTRY_URL": f"127.0.0.1:{port}", "REGISTRY_DATA_DIR": str(tmp_path)})
    registry_server.ensure_running(cfg, listen=f"0.0.0.0:{port}")
    trusting = SecondDocker(args=["--insecure-registry", f"{address}:{port}"])
    try:
        digest = Registry(cfg).push(docker_client, tiny_image)
        assert digest
        remote = Registry(load_registry({"REGISTRY_URL": f"http://{address}:{port}"}))
        ref = remote.remote_ref(tiny_image)
        assert remote.reachable() and remote.digest(ref) == digest
        assert remote.pull(docker_client, ref) is None  # this daemon trusts only 127.0.0.0/8
        assert any("HTTPS client" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        other = trusting.start().client()
        image = remote.pull(other, ref, expected_digest=digest)
        assert image is not None and f"{ref.rpartition(':')[0]}@{digest}" in image.attrs["RepoDigests"]
        other.close()
    finally:
        trusting.stop()
        os.kill(int((tmp_path / "registry.pid").read_text()), signal.SIGTERM)


def _exists(client, name: str) -> bool:
    try:
        client.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False
