"""`flask --app app dataset ...`: download, check, prebuild and oracle-run task datasets.

The commands run with the app's settings (the same environment as the service: DATASET_DIR,
REDIS_URL, POOL_HOST_ID, ENV_SERVER_PORT, POOL_API_TOKEN, ...). Tables go to stdout,
progress bars to stderr. Exit codes: 0 all good, 1 some task has a problem, 2 the command
could not do its work at all (bad arguments, git, Redis or the service unreachable).
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import click
from flask import current_app
from flask.cli import AppGroup

from cli import download as dl
from cli import oracle as orc
from cli.checks import check_tasks, find_tasks, task_label
from cli.output import emit_json, progress, table
from poolcore.config import Settings

dataset_cli = AppGroup("dataset", help="Work with terminal-bench task datasets.")


class Fatal(click.ClickException):
    """The command could not do its work at all: exit 2."""

    exit_code = 2


def _fail_tasks() -> None:
    """Some task has a problem: exit 1."""
    click.get_current_context().exit(1)


def _cfg() -> Settings:
    return current_app.extensions["termpool"].cfg


def _dataset_dir(path: Path | None) -> Path:
    root = Path(path) if path else _cfg().dataset_dir
    if not root.is_dir():
        raise click.UsageError(f"dataset directory {root} does not exist")
    return root.resolve()


def _tasks(root: Path) -> list[Path]:
    tasks = find_tasks(root)
    if not tasks:
        raise Fatal(f"no task directories in {root}")
    return tasks


DIR_ARGUMENT = click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))


# ---- download -----------------------------------------------------------------------------
@dataset_cli.command("download")
@click.argument("name", type=click.Choice(sorted(dl.DATASETS)))
@click.option(
    "--dest",
    type=click.Path(file_okay=False, path_type=Path),
    help="Parent folder of the dataset (default: DATASET_DIR); it lands in DEST/NAME.",
)
@click.option(
    "--origin",
    help="Git URL or local path of the repository (default: the dataset's table entry, "
    "or TERMPOOL_DATASET_<NAME>_ORIGIN).",
)
@click.option("--ref", default=None, help="Branch or tag (TERMPOOL_DATASET_<NAME>_REF).")
@click.option(
    "--subdir",
    default=None,
    help="Folder of the repository to fetch; comma-separated candidates (TERMPOOL_DATASET_<NAME>_SUBDIR).",
)
@click.option("--force", is_flag=True, help="Replace an existing download.")
def download_command(name, dest, origin, ref, subdir, force):
    """Fetch dataset NAME's task folder with a shallow, sparse git clone."""
    source = dl.resolve_source(name, origin=origin, ref=ref, subdir=subdir, overrides=_cfg().dataset_sources.get(name))
    job = dl.Download(source, Path(dest) if dest else _cfg().dataset_dir, force=force)
    if job.exists() and not force:
        click.echo(f"{job.target} already exists; nothing to do (--force replaces it).")
        return
    click.echo(
        f"Downloading {name} from {source.origin}"
        f"{' @ ' + source.ref if source.ref else ''}, folder {' or '.join(source.subdirs)}",
        err=True,
    )
    try:
        with progress(len(dl.STEPS), "download", item_show_func=lambda s: s) as bar:
            for step in dl.STEPS:
                bar.update(0, step)
                job.step(step)
                bar.update(1, step)
    except dl.DownloadError as exc:
        raise Fatal(str(exc)) from None
    finally:
        job.cleanup()
    click.echo(f"{name}: {job.tasks} folders in {job.target} (commit {job.commit[:12]}, from {job.found_subdir}/)")


# ---- check --------------------------------------------------------------------------------
@dataset_cli.command("check")
@DIR_ARGUMENT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check_command(directory, as_json):
    """Check every task directory of DIRECTORY (default: DATASET_DIR).

    Each task must load (task.yaml, or a Harbor task's task.toml and instruction.md), have
    its grader (run-tests.sh and tests/, or tests/test.sh) and a compose file (a Harbor task's:
    termpool's base with environment/'s own) that compose resolves with termpool's variables, with services whose build contexts and
    Dockerfiles exist, and nothing termpool refuses (privileged, the Docker socket, host
    namespaces or devices, dangerous capabilities, builds from outside the task) or cannot
    honour for two runs at once (fixed container or network names, published host ports).
    Also lists, apart and not as problems, the tasks that allow one live run per host (a fixed
    subnet, a static address, a published host port) and why. Exits 1 when any task has problems.
    """
    root = _dataset_dir(directory)
    tasks = _tasks(root)
    with progress(len(tasks), "checking", hidden=as_json or len(tasks) < 50) as bar:
        reports = check_tasks(root, tasks, _cfg(), on_done=lambda _: bar.update(1))
    bad = [r for r in reports if r.problems]
    single = [r for r in reports if r.one_per_host]
    if as_json:
        emit_json(
            {
                "dataset": str(root),
                "tasks": len(reports),
                "tasks_with_problems": len(bad),
                "ok": not bad,
                "problems": [{"task": r.label, "problem": p} for r in bad for p in r.problems],
                "one_per_host": [{"task": r.label, "reason": why} for r in single for why in r.one_per_host],
            }
        )
    else:
        if bad:
            table(["TASK", "PROBLEM"], [[r.label, p] for r in bad for p in r.problems], max_width=160)
            click.echo("")
        if single:
            rows = [[r.label, why] for r in single for why in r.one_per_host]
            table(["TASK", "ONE LIVE RUN PER HOST (not a problem)"], rows, max_width=160)
            click.echo("")
        click.echo(
            f"{len(reports)} tasks checked in {root}: {len(reports) - len(bad)} clean, {len(bad)} with problems."
            + (f" {len(single)} allow one live run per host." if single else "")
        )
    if bad:
        _fail_tasks()


# ---- prebuild -----------------------------------------------------------------------------
@dataset_cli.command("prebuild")
@DIR_ARGUMENT
@click.option(
    "--hosts",
    "where",
    type=click.Choice(["pool", "all", "here"]),
    default="pool",
    show_default=True,
    help="pool: spread the builds over the build queues of every serving host (each pushes to the "
    "pool's registry); all: that, then every host pulls every image; here: build with this "
    "machine's Docker.",
)
@click.option("-j", "--jobs", default=2, show_default=True, type=click.IntRange(1, 64), help="Builds at a time (here).")
@click.option("--timeout", type=click.FloatRange(min=1), help="Seconds per task (default ENSURE_IMAGE_TIMEOUT).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def prebuild_command(directory, where, jobs, timeout, as_json):
    """Build the images of every task of DIRECTORY (default: DATASET_DIR) for the pool.

    Uses the workers' own build code and Redis locks (REDIS_URL), so it is safe while the pool
    runs. Exits 1 when any build failed.
    """
    from cli import prebuild as pb
    from poolcore.state import connection

    cfg = _cfg()
    root = _dataset_dir(directory)
    tasks = [(path, task_label(path, root)) for path in _tasks(root)]
    try:
        locks = pb.lock_store(cfg)
    except Exception as exc:
        raise Fatal(f"{connection.describe(cfg)} is needed for the build locks: {exc}") from None
    limit = timeout or cfg.timeouts.ensure_image
    started = time.monotonic()
    if where == "here":
        results = _prebuild_here(pb, tasks, cfg, limit, jobs, locks, as_json)
    else:
        results = _prebuild_pool(pb, tasks, cfg, limit, locks, where == "all", as_json)
    _prebuild_report(root, results, time.monotonic() - started, as_json)
    if any(r.status == "failed" for r in results):
        _fail_tasks()


def _prebuild_here(pb, tasks, cfg, limit, jobs, locks, as_json):
    with progress(
        len(tasks),
        f"building ({jobs} at a time)",
        hidden=as_json,
        item_show_func=lambda r: r and f"{r.task}: {r.status}",
    ) as bar:
        return pb.build_all(tasks, cfg, limit, jobs, locks, on_done=lambda r: bar.update(1, r))


def _prebuild_pool(pb, tasks, cfg, limit, locks, everywhere, as_json):
    """The builds on the serving hosts' build queues; with `everywhere`, then a pull on each other host."""
    engine = current_app.extensions["termpool"]
    hosts = pb.serving_hosts(engine)
    if not hosts:
        raise Fatal("no worker host serves now: start the pool, or build with this machine's Docker (--hosts here)")
    paths = {}
    for path, label in tasks:
        if not path.is_relative_to(cfg.dataset_dir.resolve()):
            raise Fatal(f"{path} is not in DATASET_DIR {cfg.dataset_dir}: the hosts find tasks there")
        paths[str(path.relative_to(cfg.dataset_dir.resolve()))] = (path, label)
    batch = uuid.uuid4().hex
    deadline = time.monotonic() + limit * len(tasks) + 60  # every build one after another, at worst

    def phase(title: str, sent: list[tuple]) -> list:
        with progress(len(sent), f"{title} on {len(hosts)} hosts", hidden=as_json) as bar:
            answers = pb.wait_results(locks, batch, sent, deadline, on_done=lambda *_: bar.update(1))
        return [pb.pool_result(*paths[task], host, answers.get((host, task))) for host, task in sent]

    results = phase("building", pb.send_builds(engine.celery, hosts, list(paths), batch, limit))
    if everywhere and len(hosts) > 1:
        ready = [(r.host, str(r.path.relative_to(cfg.dataset_dir.resolve()))) for r in results if r.status != "failed"]
        results += phase("pulling", pb.send_pulls(engine.celery, hosts, ready, batch, limit))
    return results


def _prebuild_report(root, results, seconds: float, as_json: bool) -> None:
    failed = [r for r in results if r.status == "failed"]
    if as_json:
        counts = {status: sum(r.status == status for r in results) for status in ("built", "pulled", "present")}
        emit_json({"dataset": str(root), **counts, "failed": len(failed), "tasks": [r.to_dict() for r in results]})
        return
    table(
        ["TASK", "HOST", "RESULT", "SECONDS", "IMAGE / ERROR"],
        [[r.task, r.host, r.status, f"{r.seconds:.1f}", r.image or r.error] for r in results],
    )
    done = len(results) - len(failed)
    click.echo(f"\n{done} ready, {len(failed)} failed in {seconds:.0f} s.")


# ---- oracle -------------------------------------------------------------------------------
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples" / "tasks"


def _oracle_default_dir(cfg: Settings) -> Path:
    """DATASET_DIR when it holds tasks, else the bundled examples (what scripts/serve.sh
    serves when DATASET_DIR is unset)."""
    if cfg.dataset_dir.is_dir() and find_tasks(cfg.dataset_dir):
        return cfg.dataset_dir
    click.echo(f"DATASET_DIR {cfg.dataset_dir} holds no tasks: running the examples in {EXAMPLES_DIR}", err=True)
    return EXAMPLES_DIR


@dataset_cli.command("oracle")
@DIR_ARGUMENT
@click.option("--url", help="The termpool service (default http://127.0.0.1:<ENV_SERVER_PORT>).")
@click.option("--token", envvar="POOL_API_TOKEN", help="Bearer token (default POOL_API_TOKEN).")
@click.option("-j", "--jobs", default=4, show_default=True, type=click.IntRange(1, 256), help="Episodes at a time.")
@click.option("-t", "--task", "only", multiple=True, help="Only this task (name or path below DIRECTORY); repeatable.")
@click.option("--timeout", type=click.FloatRange(min=1), help="Seconds per episode, from submit to close.")
@click.option(
    "--solution-timeout",
    type=click.FloatRange(min=1),
    help=f"Seconds solution.sh may run (default max({orc.MIN_SOLUTION_TIMEOUT:g}, the task's max_agent_timeout_sec)).",
)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write a JSON report here.")
def oracle_command(directory, url, token, jobs, only, timeout, solution_timeout, report):
    """Run every task's solution.sh as one episode through the service's runs API and
    report its reward. Exits 1 unless every task that has a solution scores 1.0.

    DIRECTORY defaults to DATASET_DIR, or to the bundled examples/tasks when that does not
    exist (the dataset scripts/serve.sh serves by default). task_path is sent relative to
    the service's DATASET_DIR (this process's setting) when DIRECTORY is inside it, else
    relative to DIRECTORY.
    """
    cfg = _cfg()
    root = _dataset_dir(directory or _oracle_default_dir(cfg))
    tasks = _tasks(root)
    if only:
        wanted = set(only)
        tasks = [t for t in tasks if t.name in wanted or task_label(t, root) in wanted]
        missing = wanted - {t.name for t in tasks} - {task_label(t, root) for t in tasks}
        if missing:
            raise click.UsageError(f"no such task in {root}: {', '.join(sorted(missing))}")
    client = orc.connect(url or f"http://127.0.0.1:{cfg.port}", token=token if token is not None else cfg.api_token)
    try:
        orc.check(client)
    except orc.ServiceError as exc:
        raise Fatal(str(exc)) from None
    opts = orc.OracleSettings(
        dataset_root=cfg.dataset_dir,
        timeout=timeout,
        solution_timeout=solution_timeout,
        env_allowlist=cfg.harbor_env_allowlist,
    )
    timeouts = cfg.timeouts
    opts.default_budget = timeouts.ensure_image + timeouts.reset_session + timeouts.eval + timeouts.close_session

    started_at, started = time.time(), time.monotonic()
    results: dict[Path, orc.OracleResult] = {}
    with (
        progress(
            len(tasks), f"oracle ({jobs} at a time)", item_show_func=lambda r: r and f"{r.task}: {r.outcome}"
        ) as bar,
        ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="oracle") as pool,
    ):
        futures = {
            pool.submit(
                orc.run_oracle,
                client,
                path,
                task_label(path, root),
                orc.task_path_for(path, cfg.dataset_dir, root),
                opts,
            ): path
            for path in tasks
        }
        for future in as_completed(futures):
            result = future.result()
            results[futures[future]] = result
            bar.update(1, result)
    ordered = [results[path] for path in tasks]
    summary = orc.summarize(ordered)

    table(
        ["TASK", "OUTCOME", "REWARD", "TESTS", "SECONDS", "CODE", "DETAIL"],
        [
            [
                r.task,
                r.outcome,
                "" if r.reward is None else f"{r.reward:.2f}",
                r.tests_passed,
                f"{r.seconds:.0f}",
                r.code,
                r.error,
            ]
            for r in ordered
        ],
    )
    click.echo("")
    table(
        ["TASKS", "PASSED", "PARTIAL", "FAILED", "ERRORS", "SKIPPED", "MEAN REWARD"],
        [
            [
                summary["tasks"],
                summary["passed"],
                summary["partial"],
                summary["failed"],
                summary["errors"],
                summary["skipped"],
                "" if summary["mean_reward"] is None else f"{summary['mean_reward']:.3f}",
            ]
        ],
    )
    if summary["errors_by_code"]:
        click.echo("\nErrors by code: " + ", ".join(f"{code} {n}" for code, n in summary["errors_by_code"].items()))
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(
            json.dumps(
                {
                    "url": client.url,
                    "dataset": str(root),
                    "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at)),
                    "seconds": round(time.monotonic() - started, 1),
                    "summary": summary,
                    "tasks": [r.to_dict() for r in ordered],
                },
                indent=2,
            )
            + "\n"
        )
        click.echo(f"\nReport: {report}")
    click.echo("")
    for r in ordered:  # the last lines: one reward per task
        reward = "-" if r.reward is None else f"{r.reward:.2f}"
        click.echo(f"{r.task}: reward {reward} ({r.outcome}{', ' + r.code if r.code else ''})")
    if summary["tasks"] - summary["skipped"] != summary["passed"]:
        _fail_tasks()
