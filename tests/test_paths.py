"""Request paths must stay inside their roots (docs/http-api.md section 3)."""

import os

import pytest

from poolcore.paths import PathError, resolve_inside, resolve_log_dir, resolve_task_path

pytestmark = pytest.mark.unit


@pytest.fixture
def tree(tmp_path):
    """tmp/root/{dataset/task-a, dataset/link-out -> outside, outside/secret, output/}."""
    root = tmp_path / "root"
    dataset = root / "dataset"
    (dataset / "task-a").mkdir(parents=True)
    (dataset / "task-a" / "task.yaml").write_text("instruction: x\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    (dataset / "link-out").symlink_to(outside)
    (dataset / "link-in").symlink_to(dataset / "task-a")
    (dataset / "abs-link-file").symlink_to("/etc/passwd")
    (dataset / "dangling-out").symlink_to(tmp_path / "nowhere")
    output = root / "output"
    output.mkdir()
    return dataset, output, outside


def test_relative_path_inside(tree):
    dataset, _, _ = tree
    assert resolve_inside(dataset, "task-a", allow_absolute=False) == dataset.resolve() / "task-a"


def test_result_is_resolved_and_absolute(tree):
    dataset, _, _ = tree
    got = resolve_inside(dataset, "./task-a/../task-a/", allow_absolute=False)
    assert got == dataset.resolve() / "task-a"
    assert got.is_absolute()


def test_root_given_as_str_or_relative(tree, monkeypatch):
    dataset, _, _ = tree
    monkeypatch.chdir(dataset.parent)
    assert resolve_inside("dataset", "task-a", allow_absolute=False) == dataset.resolve() / "task-a"


def test_symlink_inside_root_is_followed(tree):
    dataset, _, _ = tree
    assert resolve_inside(dataset, "link-in", allow_absolute=False) == dataset.resolve() / "task-a"


def test_root_itself_is_a_symlink(tree, tmp_path):
    dataset, _, _ = tree
    alias = tmp_path / "alias"
    alias.symlink_to(dataset)
    assert resolve_inside(alias, "task-a", allow_absolute=False) == dataset.resolve() / "task-a"
    assert resolve_inside(alias, str(dataset / "task-a"), allow_absolute=True) == dataset.resolve() / "task-a"


@pytest.mark.parametrize(
    "candidate",
    ["..", "../output", "task-a/../../output", "../../outside/secret", "task-a/../..", "./../dataset/../output"],
)
def test_dotdot_escape_is_refused(tree, candidate):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="outside"):
        resolve_inside(dataset, candidate, allow_absolute=False)


def test_dotdot_that_comes_back_is_fine(tree):
    dataset, _, _ = tree
    got = resolve_inside(dataset, "../dataset/task-a", allow_absolute=False)
    assert got == dataset.resolve() / "task-a"


@pytest.mark.parametrize(
    "candidate", ["link-out", "link-out/secret", "abs-link-file", "dangling-out", "dangling-out/x/y"]
)
def test_symlink_out_is_refused(tree, candidate):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="outside"):
        resolve_inside(dataset, candidate, allow_absolute=True)


def test_symlink_out_then_dotdot_back_is_judged_after_resolving(tree, tmp_path):
    dataset, _, _ = tree
    # link-out/.. is tmp_path (the symlink's parent), not dataset: lexical cleanup would be wrong
    with pytest.raises(PathError):
        resolve_inside(dataset, "link-out/../root/dataset/../../outside", allow_absolute=False)
    got = resolve_inside(dataset, "link-out/../root/dataset/task-a", allow_absolute=False)
    assert got == dataset.resolve() / "task-a"


def test_absolute_path_not_allowed(tree):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="relative"):
        resolve_inside(dataset, str(dataset / "task-a"), allow_absolute=False)


def test_absolute_path_inside_allowed(tree):
    dataset, _, _ = tree
    got = resolve_inside(dataset, str(dataset / "task-a"), allow_absolute=True)
    assert got == dataset.resolve() / "task-a"


@pytest.mark.parametrize("candidate", ["/etc", "/", "/etc/passwd"])
def test_absolute_path_outside_refused(tree, candidate):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="outside"):
        resolve_inside(dataset, candidate, allow_absolute=True)


def test_sibling_with_common_prefix_is_outside(tree):
    dataset, _, _ = tree
    sibling = dataset.parent / "dataset-evil"
    sibling.mkdir()
    with pytest.raises(PathError, match="outside"):
        resolve_inside(dataset, str(sibling), allow_absolute=True)
    with pytest.raises(PathError, match="outside"):
        resolve_inside(dataset, "../dataset-evil", allow_absolute=False)


@pytest.mark.parametrize("candidate", ["", "   ", "\t\n"])
def test_empty_refused(tree, candidate):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="empty"):
        resolve_inside(dataset, candidate, allow_absolute=True)


@pytest.mark.parametrize("candidate", ["task-a\x00", "\x00", "task-a/\x00/../x"])
def test_nul_refused(tree, candidate):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="NUL"):
        resolve_inside(dataset, candidate, allow_absolute=True)


@pytest.mark.parametrize("candidate", [None, 3, 1.5, True, ["task-a"], {"p": "task-a"}, b"task-a"])
def test_non_string_refused(tree, candidate):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="must be a string"):
        resolve_inside(dataset, candidate, allow_absolute=True)


def test_path_error_is_value_error():
    assert issubclass(PathError, ValueError)


def test_missing_path_inside_is_fine(tree):
    _, output, _ = tree
    got = resolve_inside(output, "a/b/c", allow_absolute=False)
    assert got == output.resolve() / "a" / "b" / "c"
    assert not got.exists()


def test_missing_path_dotdot_inside_missing_parts(tree):
    _, output, _ = tree
    assert resolve_inside(output, "new/../other", allow_absolute=False) == output.resolve() / "other"
    with pytest.raises(PathError):
        resolve_inside(output, "new/../../x", allow_absolute=False)


def test_symlink_loop_refused(tree):
    dataset, _, _ = tree
    (dataset / "loop-a").symlink_to(dataset / "loop-b")
    (dataset / "loop-b").symlink_to(dataset / "loop-a")
    with pytest.raises(PathError, match="loop"):
        resolve_inside(dataset, "loop-a/x", allow_absolute=False)


def test_root_itself(tree):
    dataset, _, _ = tree
    assert resolve_inside(dataset, ".", allow_absolute=False) == dataset.resolve()
    with pytest.raises(PathError, match="itself"):
        resolve_inside(dataset, ".", allow_absolute=False, allow_root=False)
    with pytest.raises(PathError, match="itself"):
        resolve_inside(dataset, "task-a/..", allow_absolute=False, allow_root=False)


def test_root_may_not_exist_yet(tmp_path):
    root = tmp_path / "not" / "yet"
    assert resolve_inside(root, "x", allow_absolute=False) == tmp_path.resolve() / "not" / "yet" / "x"


def test_error_names_the_field(tree):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="^task_path"):
        resolve_inside(dataset, "..", allow_absolute=False, what="task_path")


# --- the two request fields -----------------------------------------------------------


def test_task_path_relative_and_absolute(tree):
    dataset, _, _ = tree
    assert resolve_task_path(dataset, "task-a") == dataset.resolve() / "task-a"
    assert resolve_task_path(dataset, str(dataset / "task-a")) == dataset.resolve() / "task-a"


@pytest.mark.parametrize("task_path", ["..", ".", "", "/etc", "link-out", "../output"])
def test_task_path_refused(tree, task_path):
    dataset, _, _ = tree
    with pytest.raises(PathError, match="task_path"):
        resolve_task_path(dataset, task_path)


def test_log_dir_relative_absolute_and_new(tree):
    _, output, _ = tree
    assert resolve_log_dir(output, "AgentRunner_Output") == output.resolve() / "AgentRunner_Output"
    assert resolve_log_dir(output, str(output / "runs" / "x")) == output.resolve() / "runs" / "x"
    assert resolve_log_dir(output, str(output)) == output.resolve()


@pytest.mark.parametrize("log_dir", ["..", "/tmp", "/etc/cron.d", "../dataset", "a/../../x"])
def test_log_dir_refused(tree, log_dir):
    _, output, _ = tree
    with pytest.raises(PathError, match="log_dir"):
        resolve_log_dir(output, log_dir)


def test_log_dir_symlink_out_refused(tree):
    _, output, outside = tree
    (output / "escape").symlink_to(outside)
    with pytest.raises(PathError, match="outside"):
        resolve_log_dir(output, "escape/new/run")
    with pytest.raises(PathError, match="outside"):
        resolve_log_dir(output, str(output / "escape"))


def test_relative_candidate_is_not_taken_from_cwd(tree, monkeypatch):
    dataset, _, outside = tree
    monkeypatch.chdir(outside)
    assert resolve_inside(dataset, "task-a", allow_absolute=False) == dataset.resolve() / "task-a"
    assert os.getcwd() == str(outside.resolve())
