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
    bounds = serve.add_argument_group(
        "what one job may cost", "refused at submit or stopped while running, saying which bound (docs/api.md)"
    )
    bounds.add_argument(
        "--max-worker-memory",
        default=None,
        metavar="SIZE",
        help="bytes one worker's training state may need, e.g. 64G (default: the largest Ray node's memory)",
    )
    bounds.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="memory of one worker's GPU, e.g. 80G: jobs whose estimated peak per rank is more are refused "
        "(default: the GPU type's as Ray reports it; docs/memory.md)",
    )
    bounds.add_argument(
        "--max-tensor-elements", type=int, default=None, help="elements of a model's largest tensor (default 2^33)"
    )
    bounds.add_argument("--max-checkpoints-kept", type=int, default=None, help="the largest checkpoint.keep (default 20)")
    bounds.add_argument(
        "--max-job-bytes", default=None, metavar="SIZE", help="bytes one job's directory may hold (default: 1/4 of the jobs volume)"
    )
    bounds.add_argument(
        "--max-owner-bytes",
        default=None,
        metavar="SIZE",
        help="bytes one owner's job directories may hold together (default: 1/2 of the jobs volume)",
    )
    bounds.add_argument(
        "--max-log-lines-per-job", type=int, default=None, help="log lines stored of one job; past it the job fails (default 10^6)"
    )
    bounds.add_argument(
        "--validation-timeout", type=float, default=None, metavar="SECONDS", help="the longest one spec's validation may take (default 30)"
    )
    bounds.add_argument(
        "--validations-per-owner", type=int, default=None, help="specs of one owner validated at once (default 2)"
    )
    bounds.add_argument("--exports-per-owner", type=int, default=None, help="exports of one owner running at once (default 2)")
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
        bounds={name: getattr(args, name) for name in BOUND_OPTIONS if getattr(args, name) is not None},
    )


BOUND_OPTIONS = (
    "max_worker_memory",
    "device_memory",
    "max_tensor_elements",
    "max_checkpoints_kept",
    "max_job_bytes",
    "max_owner_bytes",
    "max_log_lines_per_job",
    "validation_timeout",
    "validations_per_owner",
    "exports_per_owner",
)
