"""How long measuring one container's writable layer takes: a walk of its upper dir from the
worker (environments/disk_usage.folder_bytes) against `docker container inspect --size`
(dockerd walks the same dir, then answers over the API).

    python -m bench.disk_walk [--files 20000] [--image termpool-test-base:bookworm]

Starts one container, writes FILES small files and one 64 MiB file in it, times each way
(median of 5), prints both and removes the container.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from environments.disk_usage import folder_bytes
from environments.docker_client import docker_client


def _median_seconds(fn, rounds: int = 5) -> tuple[float, int]:
    times, value = [], 0
    for _ in range(rounds):
        began = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20000)
    parser.add_argument("--image", default="termpool-test-base:bookworm")
    args = parser.parse_args()
    client = docker_client()
    container = client.containers.run(args.image, ["sleep", "600"], detach=True, labels={"bench": "disk_walk"})
    try:
        fill = f"mkdir -p /data && cd /data && seq {args.files} | xargs touch && head -c 64M /dev/urandom > big"
        container.exec_run(["sh", "-c", fill + " && for f in $(seq 1000); do echo x > $f; done"])
        container.reload()
        upper = container.attrs["GraphDriver"]["Data"]["UpperDir"]
        walk, walked = _median_seconds(lambda: folder_bytes(upper))
        api, sized = _median_seconds(
            lambda: client.api.containers(all=True, size=True, filters={"id": container.id})[0]["SizeRw"]
        )
        print(
            json.dumps(
                {
                    "files": args.files,
                    "upper_dir_walk_s": round(walk, 4),
                    "upper_dir_walk_bytes": walked,
                    "inspect_size_s": round(api, 4),
                    "inspect_size_bytes": sized,
                },
                indent=2,
            )
        )
    finally:
        container.remove(force=True)


if __name__ == "__main__":
    main()
