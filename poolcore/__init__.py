"""The server's shared core: what the facade (app/) and the workers (tasks/, environments/)
both use, and what `pip install .` does not ship.

- config: the settings, read once from the environment (Settings)
- state: run state in Redis behind one Store (runs, jobs, hosts, leases, locks)
- dispatch, queues: how the facade sends jobs to a host's Celery queues
- hosts, liveness: worker hosts, their heartbeats and the failure detector
- task_spec, harbor_task, task_archive, uploaded_tasks: the two task formats and uploads
- tenants: the tenants file; failures: failure codes of a run
- disk, paths, processes, subnets, pytest_parser, warm_sizing: helpers of one job each

The client and the Harbor backend (termpool/) import nothing from here.
"""
