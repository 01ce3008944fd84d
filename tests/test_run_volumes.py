"""A closed run leaves no Docker volume behind: neither the named volumes of its compose file
nor the anonymous ones an image's VOLUME makes on every start, on the compose path, the SDK
fast path and the reconcile sweep.

Fixture: compose-volumes (a sidecar whose image declares VOLUME /data and which mounts the
file's named volume `state`, declared with a fixed name).
"""

from __future__ import annotations

import pytest

from devstack import FIXTURES
from environments import lifecycle, task_builds
from poolcore.state import Store
from tests.conftest import wait_for
from tests.test_compose_fidelity import build_locks, episode, leaves_nothing, settings, start, task_copy

TASK = "compose-volumes"


def volume_mounts(containers) -> dict[str, str]:
    """Volume name -> where it is mounted, over a run's containers."""
    return {m["Name"]: m["Destination"] for c in containers for m in c.attrs["Mounts"] if m["Type"] == "volume"}


def existing(docker_client, names) -> set[str]:
    return {v.name for v in docker_client.volumes.list()} & set(names)


def labelled(docker_client, run_id: str, project: str) -> list:
    return [
        v.name
        for label in (f"termpool.run={run_id}", f"com.docker.compose.project={project}")
        for v in docker_client.volumes.list(filters={"label": label})
    ]


def test_episode_leaves_no_volume(router, docker_client):
    seen = {}  # what the run had, recorded before the close

    def checks(lease, containers):
        project = Store(router.stack.redis).get_run(lease)["env"]["project"]
        mounts = volume_mounts(containers.values())
        named = f"{project}_state"  # the file's fixed name, made the run's own
        assert mounts.pop(named) == "/state" and list(mounts.values()) == ["/data"], mounts
        assert docker_client.volumes.get(named).attrs["Labels"]["termpool.run"] == lease
        assert set(labelled(docker_client, lease, project)) == {named}
        seen.update(lease=lease, project=project, volumes=[named, *mounts])

    episode(router, docker_client, TASK, checks)  # reset, solution, evaluate = 1.0, close
    assert wait_for(lambda: not existing(docker_client, seen["volumes"]), 30), "teardown left volumes"
    assert not labelled(docker_client, seen["lease"], seen["project"])


VOLUME_DOCKERFILE = "FROM termpool-test-base:bookworm\nVOLUME /data\nWORKDIR /app\n"


@pytest.mark.parametrize("force_compose", [False, True])
def test_an_images_anonymous_volume_goes_with_the_run(tmp_path, docker_client, redis_server, force_compose):
    """A client image that declares a VOLUME: one anonymous volume per start, on either path."""
    cfg = settings(tmp_path)
    task_dir = task_copy(tmp_path, (FIXTURES / "hello-file" / "docker-compose.yaml").read_text(), "volume-client")
    (task_dir / "Dockerfile").write_text(VOLUME_DOCKERFILE)
    task_builds.ensure_image(task_dir.name, task_dir, cfg, 240, build_locks(redis_server, cfg))
    run, (env, container) = start(task_dir, cfg, tmp_path, force_compose=force_compose)
    try:
        assert env.mode == ("compose" if force_compose else "direct")
        [anonymous] = volume_mounts([container])
    finally:
        lifecycle.remove_run_resources(run["run_id"], env.project)
        lifecycle.remove_ctl_dir(env.ctl_dir)
    leaves_nothing(docker_client, run)
    assert not existing(docker_client, [anonymous])


def test_the_sweep_removes_an_orphans_volumes(tmp_path, docker_client, redis_server):
    """A teardown that died after the containers and networks went: the run's named volume is
    still found, by its labels, by the reconcile sweep."""
    cfg = settings(tmp_path)
    task_builds.ensure_image(TASK, FIXTURES / TASK, cfg, 240, build_locks(redis_server, cfg))
    run, (env, _) = start(FIXTURES / TASK, cfg, tmp_path)
    try:
        named = f"{env.project}_state"
        for each in docker_client.containers.list(all=True, filters={"label": f"termpool.run={run['run_id']}"}):
            each.remove(force=True, v=True)
        for network in docker_client.networks.list(filters={"label": f"termpool.run={run['run_id']}"}):
            network.remove()
        assert existing(docker_client, [named])
        assert lifecycle.reconcile(cfg.host_id, lambda run_id: False) == [run["run_id"]]
        assert not existing(docker_client, [named])
    finally:
        lifecycle.remove_run_resources(run["run_id"], env.project)
        lifecycle.remove_ctl_dir(env.ctl_dir)
    leaves_nothing(docker_client, run)
