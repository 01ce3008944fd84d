"""Task images termpool builds carry its labels (the building host, the build lock's image)."""

from __future__ import annotations

import pytest

from environments import container_spec, task_images
from environments.docker_client import TASK_IMAGE_LABEL, TASK_IMAGE_LOCK_LABEL
from termpool.config import load_settings


# ---- pure ------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_build_override_labels_each_image_it_builds(tmp_path):
    cfg = load_settings({"POOL_HOST_ID": "h1", "TBENCH_OUTPUT_ROOT": str(tmp_path)})
    resolved = {
        "name": "tb__t",
        "services": {
            "client": {"build": {"context": "."}, "image": "tb__t__client"},
            "side": {"build": {"context": "./side"}},
            "db": {"image": "redis:7"},
        },
    }
    labels = task_images.build_labels("h1", "tb__t__client")
    services = container_spec.run_override(resolved, "t", labels, "", [], cfg, 0)["services"]
    assert services == {
        "client": {"build": {"labels": labels}},
        "side": {"image": "tb__t__side", "build": {"labels": labels}},
        "db": {},  # pulled, never built: no build key, or compose would try to build it
    }
    assert labels == {TASK_IMAGE_LABEL: "h1", TASK_IMAGE_LOCK_LABEL: "tb__t__client"}
