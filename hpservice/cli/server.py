"""``hpservice serve``: the REST control plane (FastAPI) with its own local Ray head, or a cluster's."""

from __future__ import annotations


def add_parsers(sub) -> None:
    serve = sub.add_parser("serve", help="run the REST control plane (FastAPI) with a local Ray or --ray-address")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs API tokens)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument("--data-dir", default=None, help="store directory (default HPSERVICE_DATA_DIR or ~/.hpservice)")
    serve.add_argument(
        "--ray-address", default=None, help="Ray cluster (default RAY_ADDRESS, else an embedded local Ray)"
    )
    serve.add_argument(
        "--jobs-dir",
        default=None,
        help="where jobs write, <jobs-dir>/<owner>/<job id>/ (default <data-dir>/jobs; also HPSERVICE_JOBS_DIR): "
        "a path every Ray node mounts at the same place",
    )
    serve.add_argument("--tokens-file", default=None, help="YAML {TOKEN: {owner, admin}}; also HPSERVICE_TOKENS")
    serve.add_argument(
        "--quotas-file",
        default=None,
        help="YAML {OWNER or '*': {workers, gpus, priority}}: per-owner limits of concurrent workers and GPUs and "
        "default job priority (also HPSERVICE_QUOTAS_FILE)",
    )
    serve.add_argument(
        "--backfill-bound-s",
        type=float,
        default=600.0,
        help="how long a queued job that does not fit may be overtaken by smaller jobs that do (default 600)",
    )
    serve.add_argument(
        "--max-workers-per-job",
        type=int,
        default=None,
        help="the most workers one job may ask for (default 1024; also HPSERVICE_MAX_WORKERS_PER_JOB)",
    )
    serve.add_argument(
        "--min-cpus-per-worker",
        type=float,
        default=None,
        help="the smallest CPU share a job's worker may ask for (default 0.1; also HPSERVICE_MIN_CPUS_PER_WORKER)",
    )
    serve.add_argument(
        "--lease-ttl-s",
        type=float,
        default=None,
        help="replicas on one database: how soon a standby takes over from a leader that stopped renewing "
        "the supervisor lease (default 10)",
    )
    serve.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="MODULE:FACTORY",
        help="a model factory job specs may name (repeatable; also HPSERVICE_MODEL_FACTORIES and the "
        "hpservice.models entry points); others are refused",
    )
    serve.add_argument(
        "--data-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory job specs may read input files from (repeatable; also HPSERVICE_DATA_ROOTS); "
        "without one, jobs read no files",
    )
    serve.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs the embedded Ray head offers jobs (default: this machine's cores)"
    )
    serve.add_argument("--num-gpus", type=int, default=None, help="GPUs the embedded Ray head offers (default: Ray's count)")
    serve.add_argument("--no-docs", action="store_true", help="do not serve /docs, /redoc and /openapi.json")
    serve.add_argument(
        "--stop-ray",
        action="store_true",
        help="end the local Ray head a server with this --data-dir started (and the jobs on it), then exit",
    )
    serve.set_defaults(run=_serve)


def _serve(args) -> int:
    if args.stop_ray:
        from hpservice.serve import stop_ray

        return stop_ray(args.data_dir)
    from hpservice.serve import serve

    return serve(
        args.host,
        args.port,
        args.data_dir,
        args.ray_address,
        args.tokens_file,
        allow_models=args.allow_model,
        data_roots=args.data_root,
        docs=not args.no_docs,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        quotas_file=args.quotas_file,
        backfill_bound_s=args.backfill_bound_s,
        lease_ttl_s=args.lease_ttl_s,
        jobs_dir=args.jobs_dir,
        max_workers_per_job=args.max_workers_per_job,
        min_cpus_per_worker=args.min_cpus_per_worker,
    )
